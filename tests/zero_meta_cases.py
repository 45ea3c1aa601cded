"""Models and rank functions for meta-device initialisation (runs inside ranks too).

Every rank seeds alike, builds the model on the meta device and wraps it; the test process
builds the same model eagerly with the same seed, and the two must agree bit for bit."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel import zero
from disttrain.parallel.mesh import MeshShape, build_mesh
from disttrain.parallel.zero import MetaInit, ZeroConfig
from tests import zero_cases

SGD = functools.partial(torch.optim.SGD, lr=0.1)


class Scaled(nn.Module):
    """A child layer and a parameter of its own set by ``reset_parameters()`` at the end of
    ``__init__``, as torch layers do: eager construction draws the child first, so a
    parent-first order would differ."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.gain = nn.Parameter(torch.empty(n))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.gain, 0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.gain


class MetaNet(nn.Module):
    """Layers, a norm, three blocks with parameters of their own, a batch norm (buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(zero_cases.IN, 16)
        self.norm = nn.LayerNorm(16)
        self.blocks = nn.ModuleList(Scaled(16) for _ in range(3))
        self.bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, zero_cases.OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.inp(x))
        for block in self.blocks:
            x = block(x)
        return self.head(self.bn(x))


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build(dtype_name: str, on_meta: bool, seed: int = 0) -> nn.Module:
    """``MetaNet`` in ``dtype`` (every draw in that dtype, as a float64 run makes it)."""
    torch.manual_seed(seed)
    with default_dtype(getattr(torch, dtype_name)), (
            torch.device("meta") if on_meta else contextlib.nullcontext()):
        return MetaNet()


def user_init(module: nn.Module) -> None:
    """An init function in the style of Hugging Face's ``_init_weights``."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        nn.init.zeros_(module.bias)
    elif isinstance(module, (nn.LayerNorm, nn.BatchNorm1d)):
        module.reset_parameters()
    elif isinstance(module, Scaled):
        nn.init.normal_(module.gain, mean=1.0, std=0.1)


def eager_with_user_init(dtype_name: str) -> nn.Module:
    model = build(dtype_name, False, seed=7)  # construction draws: init overwrites them
    torch.manual_seed(0)
    model.apply(user_init)
    return model


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in (*model.named_parameters(),
                                               *model.named_buffers())}


def wrapped_state(z: Any) -> dict[str, torch.Tensor]:
    if z.stage == 3:
        with z.gathered() as module:
            return state(module)
    return state(z.module)


def blocks_as_units(model: nn.Module) -> list[nn.Module]:
    return list(model.blocks)  # type: ignore[arg-type]


# ------------------------------------------------------------------ rank functions
def run_meta_init(comm: Communicator, stage: int, dtype_name: str, units: str,
                  user: bool, replicas: int = 1) -> dict[str, Any]:
    """Seed 0, build on meta, wrap (``replicas`` > 1: hybrid, sharded over the rest): the
    full state, and the generator's state afterwards (drawn as far as eager construction
    draws)."""
    torch.manual_seed(0)
    model = build(dtype_name, True)
    extra: dict[str, Any] = {}
    if stage == 3 and units == "blocks":
        extra["units"] = blocks_as_units(model)
    meta_init = MetaInit(init=user_init) if user else None
    world = comm.new_group(list(range(comm.world_size))) if replicas > 1 else None
    try:
        shard, replicate = comm, None
        if world is not None:
            mesh = build_mesh(world, MeshShape(dp_replicate=replicas,
                                               dp_shard=comm.world_size // replicas))
            shard, replicate = zero.zero_groups(mesh)
        z = zero.STAGES[stage](model, shard, SGD, ZeroConfig(), meta_init=meta_init,
                               replicate=replicate, **extra)
        return {"state": wrapped_state(z), "rng": torch.get_rng_state(),
                "dtype": str(z.param_dtype)}
    finally:
        if world is not None:
            world.close()


def run_error(comm: Communicator, case: str) -> str:
    """The one-line error a model on meta that cannot be initialised gets."""
    kwargs: dict[str, Any] = {}
    if case == "no initialiser":  # zero_cases.Net's root owns ``scale``, without one
        with torch.device("meta"):
            model: nn.Module = zero_cases.Net()
    else:
        model = build("float32", True)
        if case == "unset":  # forgets the LayerNorm
            kwargs["meta_init"] = MetaInit(
                init=lambda m: None if isinstance(m, nn.LayerNorm) else user_init(m))
    torch.manual_seed(comm.rank if case == "seeds" else 0)
    try:
        zero.ZeRO3(model, comm, SGD, **kwargs)
    except ValueError as exc:
        return str(exc)
    return "no error"


def chain(units: int, width: int) -> nn.Sequential:
    """``units`` equal Linear layers: the model is ``units`` × one unit."""
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(units)))


def run_wrap_peak(comm: Communicator, stage: int, units: int, width: int) -> dict[str, Any]:
    """What wrapping held at once: the same model built eagerly and on meta (same seed)."""
    out: dict[str, Any] = {}
    for name, on_meta in (("eager", False), ("meta", True)):
        torch.manual_seed(0)
        with torch.device("meta") if on_meta else contextlib.nullcontext():
            model = chain(units, width)
        z = zero.STAGES[stage](model, comm, SGD)
        out[name] = z.wrap_memory.as_dict()
        out[f"{name}_state"] = wrapped_state(z)
    out["unit_bytes"] = (width * width + width) * 4
    out["model_bytes"] = units * out["unit_bytes"]
    return out
