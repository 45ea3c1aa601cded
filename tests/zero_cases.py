"""Models, data, references and rank functions for the ZeRO tests (runs inside ranks too).

The reference is one process training the same model on the whole global batch (the mean
loss over GLOBAL_BATCH rows); rank r of N trains on rows [r·B/N, (r+1)·B/N) of the same
batch, so averaging gradients over ranks gives exactly the reference gradient.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel import zero
from disttrain.parallel.zero import ZeroConfig

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4
IN, OUT = 5, 3


class Net(nn.Module):
    """191 parameters (a prime: never divisible by N), a LayerNorm, nested modules and a
    parameter owned by the root (stage 3's root unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(IN, 11), nn.Tanh(), nn.Linear(11, 7),
                                  nn.LayerNorm(7), nn.Tanh())
        self.head = nn.Linear(7, OUT)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)) * self.scale


def make_net(dtype: torch.dtype = torch.float32) -> Net:
    torch.manual_seed(0)
    return Net().to(dtype)


def batch(step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(GLOBAL_BATCH, IN, generator=gen)
    y = torch.randn(GLOBAL_BATCH, OUT, generator=gen)
    return x.to(dtype), y.to(dtype)


def local_batch(step: int, rank: int, world_size: int,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(step, dtype)
    per = GLOBAL_BATCH // world_size
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


OPTIMIZERS = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
    "adam": functools.partial(torch.optim.Adam, lr=0.01),
    "adamw": functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.1),
}


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out.float() - y.float()) ** 2).mean()


def reference(optimizer: str, steps: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Single-process training on the global batch: parameters and per-parameter state."""
    model = make_net()
    opt = OPTIMIZERS[optimizer](model.parameters())
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    return {n: p.detach().clone() for n, p in model.named_parameters()}, state


def reference_bf16(steps: int, lr: float) -> dict[str, torch.Tensor]:
    """bf16 model, fp32 master weights, Adam: the fp32 masters after ``steps``."""
    model = make_net(torch.bfloat16)
    masters = [p.detach().float().clone() for p in model.parameters()]
    opt = torch.optim.Adam(masters, lr=lr)
    for step in range(steps):
        x, y = batch(step, torch.bfloat16)
        model.zero_grad()
        loss_fn(model(x), y).backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)
    return {n: m for (n, _), m in zip(model.named_parameters(), masters)}


def wrap(stage: int, model: nn.Module, comm: Communicator, optimizer: str,
         config: ZeroConfig | None = None) -> Any:
    return zero.STAGES[stage](model, comm, OPTIMIZERS[optimizer], config)


def train(z: Any, comm: Communicator, first: int, last: int,
          dtype: torch.dtype = torch.float32, micro: int = 1,
          model_zero_grad: bool = False) -> None:
    """Steps ``first``..``last``−1 on this rank's share, in ``micro`` micro-batches.
    ``model_zero_grad``: clear with ``model.zero_grad()`` (autograd then allocates new
    ``.grad`` tensors that stage 1 must adopt) instead of the wrapper's ``zero_grad``."""
    forward = z if z.stage == 3 else z.module
    for step in range(first, last):
        x, y = local_batch(step, comm.rank, comm.world_size, dtype)
        if model_zero_grad:
            z.module.zero_grad(set_to_none=True)
        else:
            z.zero_grad()
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            (loss_fn(forward(xs), ys) / micro).backward()
        z.step()


def full_params(z: Any) -> dict[str, torch.Tensor]:
    if z.stage == 3:
        with z.gathered() as module:
            return {n: p.detach().clone() for n, p in module.named_parameters()}
    return {n: p.detach().clone() for n, p in z.module.named_parameters()}


# ------------------------------------------------------------------ rank functions
def run_equivalence(comm: Communicator, stage: int, optimizer: str, steps: int,
                    bucket_bytes: int = 4 << 20, micro: int = 1,
                    model_zero_grad: bool = False) -> dict[str, torch.Tensor]:
    z = wrap(stage, make_net(), comm, optimizer, ZeroConfig(bucket_bytes=bucket_bytes))
    train(z, comm, 0, steps, micro=micro, model_zero_grad=model_zero_grad)
    return full_params(z)


def run_bf16(comm: Communicator, stage: int, steps: int, lr: float,
             reduce_dtype: str | None = None) -> dict[str, Any]:
    """bf16 model with fp32 master shards: each rank's master shards with their layouts,
    the (bf16) parameters, and the dtype of the kept gradient shards."""
    config = ZeroConfig(reduce_dtype=None if reduce_dtype is None else getattr(torch, reduce_dtype))
    z = zero.STAGES[stage](make_net(torch.bfloat16), comm,
                           functools.partial(torch.optim.Adam, lr=lr), config)
    train(z, comm, 0, steps, torch.bfloat16)
    grad_dtypes = {str(t.dtype) for t in z.model_state_tensors()["grads"]}
    groups = [(g.names, g.shapes, g.layout, g.master.detach().clone())
              for g in z.shard_groups()]
    return {"groups": groups, "params": full_params(z), "grad_dtypes": grad_dtypes,
            "master_dtypes": {str(g.master.dtype) for g in z.shard_groups()}}


def big_mlp(dtype: torch.dtype) -> nn.Module:
    """~1.3M parameters: large enough that the formula dominates any bookkeeping."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1023), nn.ReLU(),
                         nn.Linear(1023, 10)).to(dtype)


def reachable_bytes(root: object) -> int:
    """Bytes of every tensor storage reachable from ``root`` (each counted once): through
    attributes of modules and of disttrain.parallel.zero objects, lists, tuples, sets, dicts
    (keys too), optimizers (state, param_groups) and leaf tensors' ``.grad``. Unlike the
    wrapper's ``model_state_tensors()``, it also sees what the wrapper keeps but forgot to
    list (a staging buffer left in a pending list, a stray copy)."""
    storages: dict[int, int] = {}
    visited: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in visited:
            continue
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.nbytes():
                storages[storage.data_ptr()] = storage.nbytes()
            if obj.is_leaf and obj.grad is not None:
                stack.append(obj.grad)
        elif isinstance(obj, dict):
            stack += [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += list(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            stack += [obj.state, obj.param_groups]
        elif isinstance(obj, nn.Module) or (
                type(obj).__module__.startswith("disttrain.parallel.zero")
                and hasattr(obj, "__dict__")):
            stack += list(vars(obj).values())
    return sum(storages.values())


def run_memory(comm: Communicator, stage: int, dtype_name: str) -> dict[str, Any]:
    """One Adam step; the measured model-state bytes next to the formula's, and the bytes
    reachable from the wrapper object."""
    dtype = getattr(torch, dtype_name)
    z = zero.STAGES[stage](big_mlp(dtype), comm, functools.partial(torch.optim.Adam, lr=1e-3))
    forward = z if stage == 3 else z.module
    gen = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(8, 256, generator=gen).to(dtype)
    forward(x).float().square().mean().backward()
    z.step()
    return {"measured": zero.zero_measured(z).as_dict(),
            "formula": zero.zero_formula(z).as_dict(), "numel": z.numel,
            "reachable": reachable_bytes(z)}


def run_save(comm: Communicator, stage: int, optimizer: str, steps: int,
             directory: str) -> None:
    z = wrap(stage, make_net(), comm, optimizer, ZeroConfig(bucket_bytes=256))
    train(z, comm, 0, steps)
    zero.save(z, directory)


def run_resume(comm: Communicator, stage: int, optimizer: str, first: int, last: int,
               directory: str, out_directory: str) -> dict[str, Any]:
    """Load a checkpoint saved on any world size, train on, save again (to compare)."""
    torch.manual_seed(1234 + comm.rank)  # different initial values everywhere: load must win
    model = Net()
    z = wrap(stage, model, comm, optimizer, ZeroConfig(bucket_bytes=512,
                                                       broadcast_from_rank0=False))
    reader = zero.load(z, directory)
    loaded = full_params(z)
    train(z, comm, first, last)
    zero.save(z, out_directory)
    return {"opened": reader.opened, "loaded": loaded, "layouts": [g.layout for g in
                                                                    z.shard_groups()]}


def run_load_wrong_model(comm: Communicator, directory: str) -> str:
    """Load into a model whose first layer is wider: the error must name the parameter."""
    model = Net()
    model.body[0] = nn.Linear(IN, 12)
    model.body[2] = nn.Linear(12, 7)
    z = wrap(1, model, comm, "adam")
    try:
        zero.load(z, directory)
    except ValueError as exc:
        return str(exc)
    return "no error"


class Loop(nn.Module):
    """One cell applied three times (a unit used repeatedly), an in-place activation on a
    unit's output, and a parameter-free branch: stage 3's hooks must survive all three."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, 9)
        self.cell = nn.Linear(9, 9)
        self.act = nn.ReLU(inplace=True)
        self.out = nn.Linear(9, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.inp(x))
        for _ in range(3):
            h = torch.tanh(self.cell(h)) + h
        return self.out(h)


def reference_loop(steps: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Loop()
    opt = OPTIMIZERS["adam"](model.parameters())
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run_loop(comm: Communicator, stage: int, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    z = wrap(stage, Loop(), comm, "adam", ZeroConfig(bucket_bytes=128))
    train(z, comm, 0, steps)
    x, _ = batch(0)
    forward = z if stage == 3 else z.module
    with torch.no_grad():  # evaluation: gathers and frees, no hooks for backward
        evaluated = forward(x)
    return {"params": full_params(z), "eval": evaluated}


def run_staging_peak(comm: Communicator, stage: int) -> dict[str, int]:
    """Eight equal layers, one bucket each: how many staging bytes were alive at once."""
    torch.manual_seed(0)
    layers = [m for _ in range(8) for m in (nn.Linear(128, 128), nn.Tanh())]
    config = ZeroConfig(bucket_bytes=1024, inflight_buckets=2)
    z = zero.STAGES[stage](nn.Sequential(*layers), comm, OPTIMIZERS["sgd"], config)
    z.module(torch.randn(4, 128)).square().mean().backward()
    z.step()
    sizes = [g.layout.padded_total * 4 for g in z.shard_groups()]
    return {"peak": z.peak_staging_bytes, "largest": max(sizes), "total": sum(sizes),
            "buckets": len(sizes)}


# ------------------------------------------------------------------ gradients on some ranks
GATE_RANKS = (1,)  # ranks where the gates are used


class GatedLinear(nn.Module):
    """``(x Wᵀ + b) · gate`` where ``gate_on``, else ``x Wᵀ + b``: one stage-3 unit of three
    parameters, one of which gets no gradient on ranks where the gate is off."""

    def __init__(self, n_in: int, n_out: int, gate_on: bool) -> None:
        super().__init__()
        linear = nn.Linear(n_in, n_out)
        self.weight, self.bias = linear.weight, linear.bias
        self.gate = nn.Parameter(torch.linspace(0.8, 1.2, n_out))
        self.gate_on = gate_on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return y * self.gate if self.gate_on else y


class Gated(nn.Module):
    """Five units in a chain, the 2nd and 4th gated: on ranks without gates those units'
    gradients are incomplete, while backward keeps gathering the units before them."""

    def __init__(self, gate_on: bool) -> None:
        super().__init__()
        self.l0, self.g1 = nn.Linear(IN, 8), GatedLinear(8, 8, gate_on)
        self.l2, self.g3 = nn.Linear(8, 8), GatedLinear(8, 8, gate_on)
        self.l4 = nn.Linear(8, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in (self.l0, self.g1, self.l2, self.g3):
            x = torch.tanh(layer(x))
        return self.l4(x)


def make_gated(gate_on: bool) -> Gated:
    torch.manual_seed(0)
    return Gated(gate_on)


def reference_gated(steps: int, world_size: int, micro: int) -> dict[str, torch.Tensor]:
    """One process playing every rank: each rank's gradient (its gates on or off, its
    micro-batches summed), zero where it has none, averaged over ranks; then Adam."""
    model = make_gated(False)
    opt = OPTIMIZERS["adam"](model.parameters())
    params = list(model.parameters())
    for step in range(steps):
        total = [torch.zeros_like(p) for p in params]
        for rank in range(world_size):
            model.g1.gate_on = model.g3.gate_on = rank in GATE_RANKS
            model.zero_grad()
            x, y = local_batch(step, rank, world_size)
            for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
                (loss_fn(model(xs), ys) / micro).backward()
            for t, p in zip(total, params):
                if p.grad is not None:
                    t += p.grad
        for t, p in zip(total, params):
            p.grad = t / world_size
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run_gated(comm: Communicator, stage: int, steps: int, micro: int,
              bucket_bytes: int) -> dict[str, torch.Tensor]:
    model = make_gated(comm.rank in GATE_RANKS)
    z = wrap(stage, model, comm, "adam", ZeroConfig(bucket_bytes=bucket_bytes))
    train(z, comm, 0, steps, micro=micro)
    return full_params(z)


def run_reentrant_checkpoint(comm: Communicator) -> str:
    """Stage 2, small buckets; ``lin`` runs inside a reentrant checkpoint, then outside.
    Backward reduces lin's bucket after the outer use, then the checkpoint's nested
    backward adds a second gradient to lin: that must be a clear error, not a lost
    gradient."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    pre, lin = nn.Linear(IN, 4), nn.Linear(4, 4)
    z = wrap(2, nn.Sequential(pre, lin), comm, "sgd", ZeroConfig(bucket_bytes=64))
    x, _ = local_batch(0, comm.rank, comm.world_size)
    try:
        lin(checkpoint(lin, pre(x), use_reentrant=True)).sum().backward()
    except RuntimeError as exc:
        return str(exc)
    finally:
        z.zero_grad()
    return "no error"
