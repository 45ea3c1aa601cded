"""Gradient compression end to end: the loop's ``ddp`` strategy with ``--compression X``
(``ParallelOptions(compression=X)``, what ``disttrain run`` maps the flag to) trains the
model that one process gets by simulating the same compression over the same ranks.

The simulation is written here from each compressor's definition, not from its code: per
step, every rank's gradient on its own shard of the batch (the loop's DistributedSampler),
packed as DataParallel packs one bucket (the parameters in reverse registration order),
then for every rank together

* ``fp16`` / ``bf16``: each rank's bucket divided by p and cast, summed in that type, cast back;
* ``topk``: per rank, ``acc = grad + residual``; its k largest entries (k = ⌈ratio·n⌉) are
  sent, the rest kept as the next residual; the average of what was sent;
* ``powersgd``: per matrix, ``M = grad + error``, ``P = mean(M Q)``, orthogonalized,
  ``Q = mean(Mᵀ P)``, the rank-r approximation ``P Qᵀ``, ``error = M − P Qᵀ``, Q kept as the
  next step's warm start (the first Q drawn from the bucket's seed); vectors averaged as is.

With two ranks a sum of two values has one rounding whatever the order, so the simulation
may differ from the ranks only by the order of float32 sums inside one rank's backward
(none here: the same thread count and batch): the tolerance is float32's own, a thousandth
of what an fp16 rounding or one step of lost error feedback moves.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from disttrain.cli import build_parser
from disttrain.train import ParallelOptions, TrainConfig, train
from disttrain.train.cli import config_from_args
from disttrain.train.data import build_dataset, fetch, size
from disttrain.train.models import build_model
from disttrain.train.sampler import DistributedSampler

WORLD = 2
CONFIG = TrainConfig(model="mlp", strategy="ddp", steps=5, global_batch=32, eval_every=0,
                     log_every=0, progress=False)
TOPK_RATIO, POWERSGD_RANK, POWERSGD_SEED = 0.01, 2, 0  # DataParallel's for a name
TOL = {"rtol": 1e-6, "atol": 1e-7}


@pytest.fixture(autouse=True)
def one_thread():
    """The ranks' thread count: the same float32 sums inside each backward."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------- the compressors, simulated
def cast_average(dtype: torch.dtype) -> Callable[[list[torch.Tensor], dict[str, Any],
                                                  list[torch.Size]], torch.Tensor]:
    def average(flats: list[torch.Tensor], state: dict[str, Any],
                shapes: list[torch.Size]) -> torch.Tensor:
        p = len(flats)
        total = flats[0].to(dtype) / p
        for flat in flats[1:]:
            total = total + flat.to(dtype) / p
        return total.to(flats[0].dtype)
    return average


def topk_average(flats: list[torch.Tensor], state: dict[str, Any],
                 shapes: list[torch.Size]) -> torch.Tensor:
    p, n = len(flats), flats[0].numel()
    k = math.ceil(TOPK_RATIO * n)
    residuals = state.setdefault("residuals", [torch.zeros(n) for _ in flats])
    indices, values = [], []
    for r, flat in enumerate(flats):
        acc = flat + residuals[r]
        keep = acc.abs().topk(k).indices
        indices.append(keep)
        values.append(acc[keep])
        residuals[r] = acc.clone()
        residuals[r][keep] = 0
    out = torch.zeros(n)
    out.index_add_(0, torch.cat(indices), torch.cat(values))
    return out / p


def powersgd_average(flats: list[torch.Tensor], state: dict[str, Any],
                     shapes: list[torch.Size]) -> torch.Tensor:
    p, r = len(flats), POWERSGD_RANK
    layout, at = [], 0  # (offset, numel, rows, cols or None for a vector sent as is)
    for shape in shapes:
        rows = shape[0] if len(shape) >= 2 else 1
        cols = shape.numel() // rows
        matrix = len(shape) >= 2 and (rows + cols) * min(r, rows, cols) < rows * cols
        layout.append((at, shape.numel(), rows, cols if matrix else None))
        at += shape.numel()
    if "q" not in state:  # one draw for the bucket, the matrices' Q one after the other
        sizes = [cols * r for _, _, _, cols in layout if cols is not None]
        gen = torch.Generator().manual_seed(POWERSGD_SEED * 100_003 + 0)
        drawn = torch.randn(sum(sizes), generator=gen, dtype=torch.float64).float()
        state["q"] = [q.view(-1, r).clone() for q in drawn.split(sizes)]
        state["errors"] = [torch.zeros_like(flats[0]) for _ in flats]
    m_all = [flat + state["errors"][k] for k, flat in enumerate(flats)]
    out = torch.zeros_like(flats[0])
    matrix = 0
    for offset, numel, rows, cols in layout:
        if cols is None:
            out[offset:offset + numel] = sum(m[offset:offset + numel] for m in m_all) / p
            continue
        mats = [m[offset:offset + rows * cols].view(rows, cols) for m in m_all]
        q = state["q"][matrix]
        p_hat = torch.linalg.qr(sum(mat @ q for mat in mats) / p, mode="reduced").Q
        q_new = sum(mat.t() @ p_hat for mat in mats) / p
        approx = p_hat @ q_new.t()
        for k, mat in enumerate(mats):
            state["errors"][k][offset:offset + rows * cols] = (mat - approx).reshape(-1)
        out[offset:offset + rows * cols] = approx.reshape(-1)
        state["q"][matrix] = q_new
        matrix += 1
    return out


SIMULATIONS = {"fp16": cast_average(torch.float16), "bf16": cast_average(torch.bfloat16),
               "topk": topk_average, "powersgd": powersgd_average}


def simulate(config: TrainConfig, world: int, compression: str) -> dict[str, torch.Tensor]:
    """The loop's ddp run on ``world`` ranks, with ``compression``, in one process."""
    data = build_dataset(config.dataset, config.data)
    torch.manual_seed(config.seed)
    model = build_model(config.model, data.info)
    params = list(model.parameters())
    bucket = params[::-1]  # DataParallel's one bucket: reverse registration order
    shapes = [p.shape for p in bucket]
    optimizer = torch.optim.SGD(params, lr=config.lr, momentum=config.momentum)
    micro = config.global_batch // world
    shards = [DistributedSampler(size(data.train), world, r, shuffle=True, seed=config.seed,
                                 drop_last=True).indices() for r in range(world)]
    state: dict[str, Any] = {}
    for step in range(config.steps or 0):
        flats = []
        for shard in shards:
            x, y = fetch(data.train, shard[step * micro:(step + 1) * micro])
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            flats.append(torch.cat([p.grad.reshape(-1) for p in bucket]))
        average = SIMULATIONS[compression](flats, state, shapes)
        at = 0
        for p in bucket:
            p.grad = average[at:at + p.numel()].view_as(p).clone()
            at += p.numel()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def rank_train(comm: Any, config: TrainConfig) -> dict[str, torch.Tensor]:
    result = train(config, comm)
    return {k: v.detach().clone() for k, v in result.model.state_dict().items()}


@pytest.mark.parametrize("compression", ["fp16", "bf16", "topk", "powersgd"])
def test_compressed_ddp_in_the_loop_equals_its_single_process_simulation(pools, compression):
    config = dataclasses.replace(CONFIG, parallel=ParallelOptions(compression=compression,
                                                                  algorithm="ring"))
    expected = simulate(config, WORLD, compression)
    uncompressed = simulate_plain(config, WORLD)
    for rank, got in enumerate(pools(WORLD).run(rank_train, config)):
        for name, want in expected.items():
            torch.testing.assert_close(got[name], want, **TOL, msg=f"rank {rank} {name}")
        # the compression shows: the run is not plain averaging in disguise
        assert any(not torch.allclose(got[k], uncompressed[k], **TOL) for k in got)


@pytest.mark.parametrize("compression", ["fp16", "bf16", "topk", "powersgd"])
def test_the_run_flag_is_the_option_the_loop_test_uses(compression):
    args = build_parser().parse_args(["run", "--strategy", "ddp", "-n", "2",
                                      "--compression", compression])
    assert config_from_args(args).parallel.compression == compression


def simulate_plain(config: TrainConfig, world: int) -> dict[str, torch.Tensor]:
    """No compression: one process on the global batch (what plain DDP must equal)."""
    return {k: v.detach().clone() for k, v in
            train(dataclasses.replace(config, strategy="single",
                                      parallel=ParallelOptions())).model.state_dict().items()}
