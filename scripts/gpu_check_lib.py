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
# a group's limit (the child process is killed); together 6 minutes, the promise
GROUP_S = {"env": 30, "single": 60, "nccl": 40, "ranks": 160, "cli": 40, "bench": 30}
TOL = {"rtol": 1e-4, "atol": 1e-5}  # fp32 on the GPU: sums in another order per rank
# synthetic data only: nothing here needs scikit-learn (or a download)
MODELS = {"lenet": "synthetic", "resnet": "synthetic", "mlp": "synthetic",
          "transformer": "synthetic-lm"}
LM = "gpu_check_lib:transformer_h6"  # splits over 2 and 3 tensor-parallel ranks
LM_STRATEGIES = ("tp", "tp-sp", "3d", "torch-tp", "torch-tp-sp")
# torch's own collectives on CUDA tensors need NCCL: over Gloo they refuse in one line
REFUSED_ON_CUDA = ("torch-fsdp", "torch-tp", "torch-tp-sp")
_EVERY_STRATEGY = ("ddp", "torch-ddp", "zero1", "zero2", "zero3", "torch-zero1", "torch-fsdp",
                   "model-parallel", "gpipe", "1f1b", "tp", "tp-sp", "3d", "torch-tp",
                   "torch-tp-sp")
STRATEGIES = [  # (strategy, world size, transport, compared with the single process)
    *((name, world, "torch", True) for world in (2, 3) for name in _EVERY_STRATEGY),
    ("ddp", 2, "shm", True), ("zero2", 2, "shm", True), ("1f1b", 2, "shm", True),
    ("ddp", 3, "shm", True), ("ps-sync", 3, "torch", True), ("ps-async", 3, "torch", False),
    ("ps-ssp", 3, "torch", False),
]


QUICK = {("ddp", 2, "torch", True), ("1f1b", 2, "shm", True), ("tp", 2, "torch", True),
         ("torch-fsdp", 2, "torch", True)}  # one pool, two transports, a transformer


@dataclasses.dataclass(frozen=True)
class Options:
    device: str  # "cuda", or "cpu" for the dry run
    nccl: str  # the backend of the one-rank collective check: "nccl", or "gloo" on CPU
    quick: bool = False  # a few checks of each group (the CI test of this script)

    @property
    def slack(self) -> int:
        """Time limits × this: the dry run shares a CPU (a CI machine's) between the ranks
        and the checks themselves; the 6-minute promise is the GPU machine's."""
        return 1 if self.device == "cuda" else 4

    def models(self) -> dict[str, str]:
        return {"mlp": MODELS["mlp"]} if self.quick else MODELS

    def strategies(self) -> list[tuple[str, int, str, bool]]:
        return [s for s in STRATEGIES if s in QUICK] if self.quick else STRATEGIES

    def refuses(self, name: str) -> bool:
        """Whether strategy ``name`` must refuse this device over Gloo (one line)."""
        return self.device == "cuda" and name in REFUSED_ON_CUDA


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
        return [f"{opts.nccl}-smoke:{n}" for n in ("collectives", "async-streams-staging",
                                                   "ddp-1-rank", "zero1-1-rank",
                                                   "zero3-1-rank")]
    if group == "ranks":
        return [rank_check(n, w, t) for n, w, t, _ in opts.strategies()] + [
            "gloo-2rank:ddp/fp16", "gloo-2rank:async-avg-side-stream"]
    if group == "cli":
        return ["cli:run", "cli:checkpoint-resume"]
    return ["bench:table"]


def transformer_h6(info: Any) -> Any:
    """A TransformerLM whose heads, width, MLP and vocabulary divide by 2 and by 3."""
    from disttrain.train.transformer import TransformerLM

    vocab, length = info.num_classes, info.input_shape[0]
    return TransformerLM(vocab_size=vocab, max_len=length, d_model=48, n_heads=6, n_layers=2)


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
    from disttrain.train import DataOptions, TrainConfig

    base: dict[str, Any] = {"model": "mlp", "dataset": "synthetic", "steps": STEPS,
                            "global_batch": 24, "log_every": 0, "progress": False,
                            "eval_every": 0, "device": opts.device,
                            "data": DataOptions(num_samples=384, seq_len=12, vocab_size=48)}
    return TrainConfig(**{**base, **kwargs})


def lm_config(opts: Options, **kwargs: Any) -> Any:
    """The transformer that 2 and 3 tensor-parallel ranks split, on synthetic tokens. SGD:
    Adam turns the noise of a gradient that is zero in exact arithmetic (the key bias: a
    softmax ignores a shift) into full-size steps of either sign."""
    return config(opts, model=LM, dataset="synthetic-lm", optimizer="sgd", lr=0.1, **kwargs)


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
