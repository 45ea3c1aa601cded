"""Expert parallelism: the experts of each mixture-of-experts layer spread over the ``ep``
ranks of a group (E experts, E/ep per rank), tokens sent to their experts' ranks and back
by all-to-all (GShard, Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021; the
layout of Megatron-Core's MoE). Read in this order:

* this file: :func:`apply_expert_parallel` (the composer's step: the model's experts cut
  to this rank's share), :func:`finish_gradients` (after backward, before the optimizer),
  the full state dict, and the traffic a step should send (:func:`step_bytes`);
* :mod:`.layers`: :class:`Experts` (every expert, one process) and
  :class:`ExpertParallelExperts` (this rank's experts; dispatch → experts → combine);
* :mod:`.ops`: the all-to-all as an autograd function (backward: the reverse all-to-all)
  and the exchange of row counts before it;
* :mod:`.theory`: an expert's capacity and the bytes per rank per step, pure functions.

The router, the capacity rule and the auxiliary loss belong to the model
(:mod:`disttrain.train.moe`): they are computed on each rank for its own tokens, identically
on one process and on ep ranks, and decide which rows this engine moves.

**Layout: ep is carved out of data parallelism.** The ranks of an ep group read *different*
data (as in Megatron-Core, GShard and DeepSpeed-MoE): on ``dp × ep`` ranks every rank reads
its own shard of the global batch (shard index ``dp_rank · ep + ep_rank``, the mesh's
coordinate along ``("dp", "ep")``), and holds E/ep experts. Parameters fall in two kinds::

                          held by                  gradient = mean over the global batch
    replicated            every rank               average over ep (here), then over dp
    (attention, router,                            (DDP or the caller): dp × ep ranks
     norms, embeddings)
    expert e              one rank per ep group,   the all-to-all's backward already sums
                          dp copies                the ep ranks' contributions on its owner:
                                                   divide by ep (here), average over dp

Each rank's loss is the mean over its own tokens, and the global loss the mean of the
dp · ep ranks' losses. On its owner, expert e's gradient is already Σ over the ep group of
∂loss_r/∂θ_e (every rank's rows brought their gradients back through the combine's and the
dispatch's reverse all-to-alls), so expert gradients are **not averaged** over ep, only
scaled by 1/ep; replicated gradients are averaged over ep. The dp average that follows
(DDP over the mesh's dp group, which holds the copies of the same experts) completes both.
With dp = 1, ep alone is the data parallelism. :func:`finish_gradients` does the ep part in
one flat all-reduce per dtype.

Usage (the composer's order: tp → cp → **ep** → pipeline → DDP over dp)::

    model = apply_expert_parallel(model, mesh.ep)     # in place: experts cut to E/ep
    model = DataParallel(model, mesh.dp)              # when dp > 1
    loss = loss_fn(model(x), y) + moe_aux_loss(model) # x: this rank's own shard
    loss.backward()
    finish_gradients(model, mesh.ep)                  # replicated: avg over ep; experts: /ep
    optimizer.step()

Every forward is a collective over the ep group (evaluation too): all ranks of a group must
run the same number of forwards. See docs/expert_parallel.md.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel.backward import all_reduce_flat_gradients
from disttrain.parallel.experts.layers import ExpertParallelExperts, Experts, expert_mlp
from disttrain.parallel.experts.ops import EPGroup, all_to_all, exchange_counts
from disttrain.parallel.experts.theory import (
    LayerTraffic,
    all_reduce_bytes,
    capacity,
    ep_bytes_per_step,
    expected_ep_bytes,
    layer_bytes,
)
from disttrain.parallel.mesh import check_agreement


def _experts_of(model: nn.Module) -> list[tuple[nn.Module, str, Experts]]:
    """(parent, attribute, experts) of every MoE layer's experts, in module order."""
    return [(parent, name, child) for parent in model.modules()
            for name, child in parent.named_children() if isinstance(child, Experts)]


def apply_expert_parallel(model: nn.Module, ep: Communicator | EPGroup | None, *,
                          algorithm: str | None = None) -> nn.Module:
    """``model`` with each MoE layer's experts cut to this rank's E/ep (in place; the
    expert modules kept are the model's own, so build the optimizer afterwards). ``ep``:
    the expert-parallel communicator (a mesh's ``mesh.ep``; None: ep = 1, nothing to do);
    ``algorithm``: its all-to-alls' (None: the communicator's default). Collective: the
    ranks first check that they built the same MoE layers."""
    if ep is None:
        return model
    group = ep if isinstance(ep, EPGroup) else EPGroup(ep, algorithm)
    found = _experts_of(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no mixture-of-experts layer "
                         f"(disttrain.parallel.experts.Experts) to spread over ep = "
                         f"{group.size} ranks: use --model transformer-moe")
    for _, name, experts in found:
        if isinstance(experts, ExpertParallelExperts):
            raise ValueError(f"{name} is already expert-parallel: apply_expert_parallel "
                             f"once per model")
        if experts.n_experts % group.size:
            raise ValueError(f"{experts.n_experts} experts do not divide over ep = "
                             f"{group.size} ranks; choose --ep dividing the number of experts")
    sizes = [len(found), *(e.n_experts for _, _, e in found),
             sum(p.numel() for p in model.parameters())]
    check_agreement(group.comm, sizes, "the MoE layers (count, experts of each, parameters)")
    for parent, name, experts in found:
        setattr(parent, name, ExpertParallelExperts.from_experts(experts, group))
    return model


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of the experts held here (on ep ranks: this rank's E/ep per layer)."""
    return [p for _, _, experts in _experts_of(model) for p in experts.parameters()]


def replicated_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every other parameter: the same on all ep ranks (attention, router, norms, ...)."""
    experts = {id(p) for p in expert_parameters(model)}
    return [p for p in model.parameters() if id(p) not in experts]


def finish_gradients(model: nn.Module, ep: Communicator | EPGroup | None, *,
                     algorithm: str | None = None) -> None:
    """After backward, before the optimizer: average the replicated gradients over ``ep``
    (one flat all-reduce per dtype, by ``algorithm``) and divide the expert gradients by
    its size (see the layout above). Once per step, after the last micro-batch's backward
    (it is linear: accumulated gradients need it once). A replicated parameter without a
    gradient on this rank contributes zeros and receives the average. Collective over
    ``ep``."""
    comm = ep.comm if isinstance(ep, EPGroup) else ep
    if comm is None or comm.world_size == 1:
        return
    params = [p for p in replicated_parameters(model) if p.requires_grad]
    for dtype in sorted({p.dtype for p in params}, key=str):  # the same order on all ranks
        all_reduce_flat_gradients([p for p in params if p.dtype == dtype], comm, "avg",
                                  algorithm)
    for p in expert_parameters(model):
        if p.grad is not None:
            p.grad.div_(comm.world_size)


def drain_traffic(model: nn.Module) -> list[LayerTraffic]:
    """Each expert-parallel layer's rows sent and received since the last drain."""
    return [e.drain_traffic() for _, _, e in _experts_of(model)
            if isinstance(e, ExpertParallelExperts)]


def step_bytes(model: nn.Module, traffic: list[LayerTraffic], rank: int, *,
               algorithm: str = "ring", element_size: int | None = None) -> float:
    """What this rank (``rank`` in the ep group) should have sent in a training step whose
    forwards moved ``traffic`` (:func:`drain_traffic`), replicated gradients all-reduced by
    ``algorithm``: :func:`~.theory.ep_bytes_per_step` with the model's sizes. Rows are
    ``element_size`` bytes per element (None: the parameters'; give it under autocast)."""
    layers = [e for _, _, e in _experts_of(model) if isinstance(e, ExpertParallelExperts)]
    if not layers:
        return 0.0
    if len(traffic) != len(layers):
        raise ValueError(f"traffic of {len(traffic)} layers for a model with {len(layers)} "
                         f"expert-parallel layers")
    replicated = replicated_parameters(model)
    size = element_size or replicated[0].element_size()
    total = 0.0
    for layer, moved in zip(layers, traffic):
        d_model = next(layer.parameters()).shape[1]  # the first Linear's in_features
        total += layer_bytes(moved, d_model, size, layer.group.size, layer.n_experts)
    numel = sum(p.numel() for p in replicated if p.requires_grad)
    return total + all_reduce_bytes(numel, replicated[0].element_size(), layers[0].group.size,
                                    rank, algorithm)


def full_state_dict(model: nn.Module, ep: Communicator | EPGroup | None
                    ) -> dict[str, torch.Tensor]:
    """The unsplit model's state dict on every rank (every expert, under its one-process
    name): each local expert's tensors all-gathered over ``ep``. Collective."""
    state = dict(model.state_dict())
    comm = ep.comm if isinstance(ep, EPGroup) else ep
    if comm is None or comm.world_size == 1:
        return state
    for prefix, module in model.named_modules():
        if not isinstance(module, ExpertParallelExperts):
            continue
        base = f"{prefix}." if prefix else ""
        for i in range(module.n_local):
            for name, tensor in module[str(module.first + i)].state_dict().items():
                flat = tensor.detach().reshape(-1).contiguous()
                gathered = flat.new_empty(flat.numel() * comm.world_size)
                comm.all_gather(gathered, flat)
                for r, part in enumerate(gathered.split(flat.numel())):
                    state[f"{base}{r * module.n_local + i}.{name}"] = part.view_as(tensor)
    return state


def load_full_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load an unsplit state dict (one process's, or :func:`full_state_dict`'s) into this
    rank's expert-parallel model: its names are a subset of the full model's."""
    model.load_state_dict({name: state[name] for name in model.state_dict()})


__all__ = [
    "EPGroup",
    "ExpertParallelExperts",
    "Experts",
    "LayerTraffic",
    "all_to_all",
    "apply_expert_parallel",
    "capacity",
    "drain_traffic",
    "ep_bytes_per_step",
    "exchange_counts",
    "expected_ep_bytes",
    "expert_mlp",
    "expert_parameters",
    "finish_gradients",
    "full_state_dict",
    "load_full_state_dict",
    "replicated_parameters",
    "step_bytes",
]
