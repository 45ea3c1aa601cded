"""Shared rank functions and single-process references for the parameter-server tests.

No tests here: the test_ps_* modules import these. Rank functions are module-level so the
pools can run them; each returns plain data (tensors, report dataclasses) to the test.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel.parameter_server import (
    SPARSE_PARAMS,
    ClickData,
    ClickModel,
    PSConfig,
    PSError,
    PSWorker,
    assign_roles,
    build_parameter_server,
    make_click_data,
    run_parameter_server,
)

TIMEOUT_S = 15.0  # below the pools' communicator timeout (20 s)
CLICKS = ClickData(num_users=600, num_items=400, samples=2048, seed=3)


# ---------------------------------------------------------------- models, data, optimizers
def make_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3)).double()


def make_clicks(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return ClickModel(CLICKS.num_users, CLICKS.num_items, dim=8, hidden=16).double()


def mlp_batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    x = torch.randn(n, 6, generator=gen, dtype=torch.float64)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()


def make_linreg(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(6, 1).double()


def linreg_batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A noiseless linear target: SGD converges to zero loss, whatever the staleness."""
    gen = torch.Generator().manual_seed(700 + step)
    x = torch.randn(n, 6, generator=gen, dtype=torch.float64)
    w = torch.tensor([[1.0, -2.0, 0.5, 0.0, 1.5, -1.0]], dtype=torch.float64)
    return x, x @ w.T + 0.3


COUNTER_SLOTS = 64  # clocks × workers a counter run may use


class Slots(nn.Module):
    """One weight per (clock, worker), starting at 0: the update of worker w at clock c adds
    to slot c·W + w only, so a read shows exactly which updates it contains."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(COUNTER_SLOTS, dtype=torch.float64))

    def forward(self, slots: torch.Tensor) -> torch.Tensor:
        return self.weight[slots]


def make_counter(seed: int = 0) -> nn.Module:
    return Slots()


def counter_batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row w of global batch ``step`` (n = W rows, b = 1) is slot step·W + w."""
    return torch.arange(step * n, (step + 1) * n), torch.zeros(n, dtype=torch.float64)


def click_batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, clicks = make_click_data(CLICKS)
    rows = torch.arange(step * n, (step + 1) * n) % inputs.shape[0]
    return inputs[rows], clicks[rows].double()


def sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def plain_sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


OPTIMIZERS = {"sgd": sgd, "adam": adam, "plain-sgd": plain_sgd}
MODELS = {"mlp": (make_mlp, mlp_batch), "clicks": (make_clicks, click_batch),
          "linreg": (make_linreg, linreg_batch), "counter": (make_counter, counter_batch)}


def loss_of(model_name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if model_name == "clicks":
        return F.binary_cross_entropy_with_logits(model(x), y)
    if model_name == "linreg":
        return F.mse_loss(model(x), y)
    if model_name == "counter":
        return -model(x).sum()  # gradient −1 on this row's slot: SGD raises it by lr
    return F.cross_entropy(model(x), y)


def reference(model_name: str, opt: str, steps: int, global_batch: int,
              start: int = 0) -> list[torch.Tensor]:
    """One process, batch W·b, the same optimizer: the parameters after ``steps`` steps."""
    make, batch = MODELS[model_name]
    model = make()
    optimizer = OPTIMIZERS[opt](model.parameters())
    for step in range(start, start + steps):
        x, y = batch(step, global_batch)
        optimizer.zero_grad()
        loss_of(model_name, model, x, y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


# ---------------------------------------------------------------- rank functions
def ps_train(comm: Communicator, servers: int, steps: int, b: int, *, model_name: str = "mlp",
             opt: str = "sgd", sparse: bool = False, compute_s: float = 0.0,
             start_clock: int | None = None, server_kwargs: dict[str, Any] | None = None,
             hook: Callable[[Communicator, int, int], Any] | None = None,
             record_reads: bool = False, **config: Any) -> dict[str, Any]:
    """Run a PS job; worker w trains on rows [w·b, (w+1)·b) of global batch ``clock``.
    ``compute_s`` adds a sleep to each step's compute (so stragglers have time to slow);
    ``hook(comm, worker index, clock)`` runs on workers before the PSWorker exists (clock
    −1) and before each step; its results are returned as ``hook_results``. With
    ``record_reads`` a worker returns, as ``reads``, its first parameter after each pull."""
    roles = assign_roles(comm.world_size, servers)
    make, batch = MODELS[model_name]
    cfg = PSConfig(timeout_s=TIMEOUT_S, sparse_params=SPARSE_PARAMS if sparse else (), **config)
    role = roles.role(comm.rank)
    if role.kind == "server":
        if not (server_kwargs or {}).get("record_updates"):
            report = run_parameter_server(comm, roles, make(), OPTIMIZERS[opt], cfg,
                                          **(server_kwargs or {}))
            return {"role": "server", "report": report}
        server = build_parameter_server(comm, roles, make(), OPTIMIZERS[opt], cfg,
                                        **server_kwargs)
        report = server.serve()
        return {"role": "server", "report": report, "updates": server.updates,
                "values": server.shard.param.detach().clone()}
    hooked = [hook(comm, role.index, -1)] if hook is not None else []
    model = make(seed=100 + comm.rank)  # other weights than the servers': the pull fixes them
    ps = PSWorker(comm, model, roles, cfg)
    if start_clock is not None:
        assert ps.clock == start_clock, (ps.clock, start_clock)
    w, n = role.index, roles.num_workers
    before = comm.stats.bytes_sent + comm.stats.bytes_recv
    reads: list[torch.Tensor] = []
    for _ in range(steps):
        x, y = batch(ps.clock, n * b)
        x, y = x[w * b:(w + 1) * b], y[w * b:(w + 1) * b]
        if hook is not None:
            hooked.append(hook(comm, w, ps.clock))
        ps.pull(sparse_ids=model.sparse_ids(x) if sparse else None)  # type: ignore[operator]
        if record_reads:
            reads.append(next(model.parameters()).detach().clone())
        time.sleep(compute_s)
        model.zero_grad()
        loss_of(model_name, model, x, y).backward()
        ps.push()
    loop_bytes = comm.stats.bytes_sent + comm.stats.bytes_recv - before
    ps.pull_all()
    params = [p.detach().clone() for p in model.parameters()]
    return {"role": "worker", "params": params, "report": ps.close(), "loop_bytes": loop_bytes,
            "hook_results": hooked, "reads": reads}


def catching(fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Run ``fn`` and return its PSError as data (a raised error would stop the harness)."""
    begin = time.time()
    try:
        return {"result": fn(*args, **kwargs), "error": None}
    except PSError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "at": time.time(),
                "after_s": time.time() - begin}
