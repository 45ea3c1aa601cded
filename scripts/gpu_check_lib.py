"""What every group of scripts/gpu_check.py shares: settings, check names, a check's
PASS/FAIL line and time limit, and the comparisons with the single process."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4
CHECK_S = 60  # one check
# a group's limit (the child process is killed); together under 8 minutes, the promise
GROUP_S = {"env": 45, "single": 90, "nccl": 60, "ranks": 180, "bench": 100}
TOL = {"rtol": 1e-4, "atol": 1e-5}  # fp32 on the GPU: sums in another order per rank
MODELS = {"lenet": "digits", "resnet": "digits", "mlp": "digits",
          "transformer": "synthetic-lm"}
STRATEGIES = [  # (strategy, world size, transport, compared with the single process)
    ("ddp", 2, "torch", True), ("torch-ddp", 2, "torch", True), ("zero1", 2, "torch", True),
    ("zero2", 2, "torch", True), ("zero3", 2, "torch", True), ("torch-zero1", 2, "torch", True),
    ("model-parallel", 2, "torch", True), ("gpipe", 2, "torch", True),
    ("1f1b", 2, "torch", True), ("ddp", 2, "shm", True), ("zero2", 2, "shm", True),
    ("1f1b", 2, "shm", True), ("ps-sync", 3, "torch", True), ("ps-async", 3, "torch", False),
    ("ps-ssp", 3, "torch", False),
]


QUICK = {("ddp", 2, "torch", True), ("1f1b", 2, "shm", True)}  # one pool, two transports


@dataclasses.dataclass(frozen=True)
class Options:
    device: str  # "cuda", or "cpu" for the dry run
    nccl: str  # the backend of the one-rank collective check: "nccl", or "gloo" on CPU
    quick: bool = False  # a few checks of each group (the CI test of this script)

    @property
    def slack(self) -> int:
        """Time limits × this: the dry run shares a CPU (a CI machine's) between the ranks
        and the checks themselves; the 8-minute promise is the GPU machine's."""
        return 1 if self.device == "cuda" else 4

    def models(self) -> dict[str, str]:
        return {"mlp": MODELS["mlp"]} if self.quick else MODELS

    def strategies(self) -> list[tuple[str, int, str, bool]]:
        return [s for s in STRATEGIES if s in QUICK] if self.quick else STRATEGIES


def rank_check(name: str, world: int, transport: str) -> str:
    return (f"gloo-{world}rank:{name}" + ("" if transport == "torch" else f"/{transport}"))


def check_names(group: str, opts: Options) -> list[str]:
    """The checks ``group`` reports, in order."""
    if group == "env":
        return ["env:versions", "env:info"]
    if group == "single":
        return [f"single:{m}" for m in opts.models()] + ["single:fp16-loss-scaling",
                                                          "single:bf16"]
    if group == "nccl":
        return [f"{opts.nccl}:{n}" for n in ("collectives", "async-streams-staging",
                                             "ddp-1-rank", "zero1-1-rank", "zero3-1-rank")]
    if group == "ranks":
        return [rank_check(n, w, t) for n, w, t, _ in opts.strategies()] + [
            "gloo-2rank:ddp/fp16"]
    return ["bench:table"]


class CheckFailed(Exception):
    """A check's result was wrong (the message says how)."""


def say(status: str, name: str, seconds: float, detail: str) -> None:
    print(f"{status:4s}  {name:28s} {seconds:6.1f}s  {detail}", flush=True)


@contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """Raise TimeoutError in this (main) thread after ``seconds``."""
    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"no result within {seconds}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_check(name: str, fn: Callable[[], str], seconds: int) -> None:
    start = time.monotonic()
    try:
        with time_limit(seconds):
            detail = fn()
    except Exception as exc:  # a FAIL line, and the next check runs
        reason = str(exc).strip().splitlines()
        say("FAIL", name, time.monotonic() - start,
            f"{type(exc).__name__}: {reason[-1] if reason else ''}"[:300])
        if not isinstance(exc, CheckFailed):
            traceback.print_exc(file=sys.stderr)
        return
    say("PASS", name, time.monotonic() - start, detail)


# ---------------------------------------------------------------- helpers (child processes)
def config(opts: Options, **kwargs: Any) -> Any:
    from disttrain.train import TrainConfig

    base: dict[str, Any] = {"model": "mlp", "steps": STEPS, "global_batch": 32, "log_every": 0,
                            "progress": False, "eval_every": 0, "device": opts.device}
    return TrainConfig(**{**base, **kwargs})


def host_params(model: Any) -> dict[str, Any]:
    return {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


def compare(got: dict[str, Any], want: dict[str, Any], what: str) -> float:
    """Every tensor of ``got`` (a rank may hold a part) close to ``want``; the largest
    difference."""
    import torch

    worst = 0.0
    for name, tensor in got.items():
        try:
            torch.testing.assert_close(tensor, want[name], rtol=TOL["rtol"], atol=TOL["atol"])
        except AssertionError as exc:
            raise CheckFailed(f"{what}: {name} differs from the single process: "
                              f"{str(exc).splitlines()[-1]}") from None
        worst = max(worst, float((tensor - want[name]).abs().max()) if tensor.numel() else 0.0)
    return worst


def finite(params: dict[str, Any], what: str) -> None:
    import torch

    bad = [n for n, t in params.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise CheckFailed(f"{what}: inf/nan in {bad[:3]}")


def on_device(result: Any, opts: Options) -> str:
    peak = result.peak_mem_bytes_max / 1e6
    if opts.device == "cuda" and not peak > 0:
        raise CheckFailed("no CUDA memory was allocated: the run did not use the GPU")
    return f"peak {peak:.1f} MB"
