"""Rank functions of the interop tests: torch's own FSDP2 (``fully_shard``) saving and loading
through torch.distributed.checkpoint on the pools' Gloo process group, on CPU."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from disttrain.comm import Communicator
from disttrain.train.transformer import TransformerLM

VOCAB, SEQ = 48, 8


def fsdp_model(comm: Communicator, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """disttrain's TransformerLM under torch's FSDP2 (each child a unit, then the root), with
    Adam: the setting torch users checkpoint with DCP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = TransformerLM(VOCAB, SEQ)
    mesh = init_device_mesh("cpu", (comm.world_size,))
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=3e-3)


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer
               ) -> dict[str, torch.Tensor]:
    """Parameters and Adam's state whole, named as a universal checkpoint names them."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    out = {k: v.detach().clone() for k, v in get_model_state_dict(model, options=options).items()}
    optim = get_optimizer_state_dict(model, optimizer, options=options)
    for name, keys in optim["state"].items():
        out.update({f"{name}/{k}": torch.as_tensor(v).detach().clone() for k, v in keys.items()})
    return out


def rank_fsdp_save(comm: Communicator, directory: str, steps: int) -> dict[str, torch.Tensor]:
    """Train ``steps`` under FSDP2 and save as torch users do; returns the whole state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = fsdp_model(comm, seed=3)
    gen = torch.Generator().manual_seed(comm.rank)
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (4, SEQ), generator=gen)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    return full_state(model, optimizer)


def rank_fsdp_load(comm: Communicator, directory: str) -> dict[str, Any]:
    """A fresh FSDP2 model and optimizer (another seed) filled by ``dcp.load`` from
    ``directory``; returns their whole state and the optimizer's hyper-parameters."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer = fsdp_model(comm, seed=99)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    hyper = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    return {"state": full_state(model, optimizer), "hyper": hyper}


def rank_zero_load(comm: Communicator, directory: str) -> dict[str, torch.Tensor]:
    """disttrain's ZeRO-3 on this pool's ranks loading a universal checkpoint (an import
    of torch's files); returns its parameters, gathered."""
    from disttrain.parallel import zero

    torch.manual_seed(1234 + comm.rank)  # the load must win over these
    model = TransformerLM(VOCAB, SEQ)
    z = zero.ZeRO3(model, comm, lambda p: torch.optim.Adam(p, lr=3e-3),
                   zero.ZeroConfig(broadcast_from_rank0=False))
    try:
        zero.load(z, directory)
        with z.gathered():
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        z.remove_hooks()


def rank_zero_hf_save(comm: Communicator, directory: str) -> dict[str, torch.Tensor]:
    """``transformers``' GPT-2 (a tiny config, built, never downloaded) trained 2 steps
    under disttrain's ZeRO-2 and saved: the checkpoint an ``hf:gpt2`` run writes. Returns
    the trained state dict."""
    from disttrain.parallel import zero
    from tests import hf_cases

    model = hf_cases.make_model("gpt2", torch.float32)
    z = zero.ZeRO2(model, comm, lambda p: torch.optim.Adam(p, lr=3e-3))
    for ids, labels in hf_cases.batches(2, seed=comm.rank):
        hf_cases.reference_loss(model(ids).logits, labels).backward()
        z.step()
        z.zero_grad()
    zero.save(z, directory)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
