"""A float64 model is the CPU stand-in for "a device the code forgot".

Every tensor a strategy makes must take the device and dtype of the tensor it derives from
(docs/gpu.md). On a machine without a GPU, a tensor built on the default device is built on
the right one by luck; a tensor built in the default dtype is not: a float64 model shows it.
Each strategy here trains a float64 model for two steps, then every floating-point tensor
the strategy holds (parameters, buffers, gradients, optimizer state, ZeRO shards and flat
buffers, DDP buckets, pipeline stages) and the loss of every step must be float64. A piece
rebuilt with a bare factory (``nn.LayerNorm(...)``, ``torch.zeros(())``) is float32 there,
and on a GPU it would be on the CPU. Activations between pipeline stages travel with their
dtype in the message header, so a float32 one reaches the next stage as float32 and its
float64 layers refuse it: such a run fails here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.train import ParallelOptions, TrainConfig
from disttrain.train.data import DataOptions
from disttrain.train.loop import _Run, checked_setup, loss_fn
from disttrain.train.ps_server import ServerRun, serves_parameters

DATA = DataOptions(num_samples=96, input_shape=(1, 4, 4), seq_len=8, vocab_size=16)
MLP = ["ddp", "zero1", "zero2", "zero3", "gpipe", "1f1b", "model-parallel", "ps-sync",
       "ps-async", "ps-ssp", "torch-ddp", "torch-zero1", "torch-fsdp", "torch-gpipe"]
LM = ["tp", "tp-sp", "3d", "torch-tp", "torch-tp-sp"]
DEEPSPEED = ["deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"]


def config(strategy: str, **parallel: Any) -> TrainConfig:
    lm = strategy in LM
    return TrainConfig(strategy=strategy, model="transformer" if lm else "mlp",
                       dataset="synthetic-lm" if lm else "synthetic", data=DATA,
                       optimizer="adam", lr=1e-3, steps=2, global_batch=8, eval_every=0,
                       log_every=0, progress=False, dtype="float64",
                       parallel=ParallelOptions(**parallel))


def floating_tensors(root: Any) -> list[tuple[str, torch.dtype]]:
    """(path, dtype) of every floating-point tensor reachable from ``root`` through modules
    (parameters, their gradients, buffers), optimizers (state but torch's float32 step
    counts), containers and the
    attributes of disttrain's own objects; communicators (byte buffers) are not entered."""
    found: list[tuple[str, torch.dtype]] = []
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("strategy", root)]
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (Communicator, str, bytes, int, float)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.is_floating_point():
                found.append((path, obj.dtype))
            if obj.grad is not None:
                stack.append((f"{path}.grad", obj.grad))
            continue
        if isinstance(obj, nn.Module):
            stack += [(f"{path}.{n}", p) for n, p in obj.named_parameters()]
            stack += [(f"{path}.{n}", b) for n, b in obj.named_buffers()]
        if isinstance(obj, torch.optim.Optimizer):  # Adam's step count is float32 by design
            stack += [(f"{path}.state[{i}][{k!r}]", v)
                      for i, s in enumerate(obj.state.values()) for k, v in s.items()
                      if k != "step"]
        if isinstance(obj, dict):
            stack += [(f"{path}[{k!r}]", v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set)):
            stack += [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        elif type(obj).__module__.startswith("disttrain") and hasattr(obj, "__dict__"):
            stack += [(f"{path}.{k}", v) for k, v in vars(obj).items()]
    return found


def train_and_inspect(comm: Communicator, cfg: TrainConfig) -> dict[str, Any]:
    if serves_parameters(cfg, comm):
        return serve_and_inspect(comm, cfg)
    run = _Run(cfg, comm)
    losses: list[torch.dtype] = []
    step = run.strategy.train_step

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        loss = step(*args, **kwargs)
        losses.append(loss.dtype)
        return loss

    run.strategy.train_step = recording  # type: ignore[method-assign]
    try:
        run.execute(())
        tensors = floating_tensors(run.strategy)
    finally:
        run.close()
    wrong = sorted({(path, str(dtype)) for path, dtype in tensors if dtype != torch.float64})
    return {"checked": len(tensors), "wrong": wrong[:10],
            "losses": sorted({str(d) for d in losses})}


def serve_and_inspect(comm: Communicator, cfg: TrainConfig) -> dict[str, Any]:
    """A parameter server's rank: its shard, optimizer state and final model (no loss)."""
    run = ServerRun(cfg, comm, checked_setup(cfg, comm.world_size))
    try:
        run.execute(loss_fn)
        tensors = floating_tensors([run.server, run.module])
    finally:
        run.close()
    wrong = sorted({(path, str(dtype)) for path, dtype in tensors if dtype != torch.float64})
    return {"checked": len(tensors), "wrong": wrong[:10], "losses": []}


def check(per_rank: list[dict[str, Any]], strategy: str) -> None:
    for rank, seen in enumerate(per_rank):
        assert seen["checked"] > 0, f"{strategy}: rank {rank} holds no tensor to check"
        assert not seen["wrong"], f"{strategy}: rank {rank} holds non-float64 tensors: " \
                                  f"{seen['wrong']}"
        losses = seen["losses"]
        assert losses in ([], ["torch.float64"]), f"{strategy}: rank {rank} losses {losses}"
    assert any(seen["losses"] for seen in per_rank), f"{strategy}: no rank reported a loss"


@pytest.mark.parametrize("strategy", MLP + LM)
def test_every_strategy_keeps_a_float64_model_float64(pools, strategy):
    parallel: dict[str, Any] = {"servers": 1} if strategy.startswith("ps-") else {}
    if strategy == "3d":
        parallel = {"tp_size": 2, "pp_size": 1}
    check(pools(2).run(train_and_inspect, config(strategy, **parallel)), strategy)


def test_a_pipeline_of_tensor_parallel_stages_keeps_float64(pools):
    cfg = config("3d", tp_size=2, pp_size=2)
    check(pools(4).run(train_and_inspect, cfg), "3d pp=2 tp=2")


@pytest.mark.parametrize("strategy", DEEPSPEED)
def test_deepspeed_rows_keep_float64(pools, strategy):
    pytest.importorskip("deepspeed")
    check(pools(2).run(train_and_inspect, config(strategy)), strategy)


@pytest.mark.parametrize("strategy", ["deepspeed-ddp", "deepspeed-pipe"])
def test_a_baseline_that_cannot_run_float64_refuses_in_one_line(pools, strategy):
    pytest.importorskip("deepspeed")
    errors = pools(2).run(refusal, config(strategy))
    assert all("float64" in e and "--dtype float32" in e and "\n" not in e for e in errors)


def refusal(comm: Communicator, cfg: TrainConfig) -> str:
    try:
        _Run(cfg, comm).close()
    except ValueError as exc:
        return str(exc)
    return "no error"
