"""Model parallelism, the plain split: consecutive layers on consecutive ranks, one batch at a
time (no micro-batches).

::

    rank 0: layers 0..a   ──activation──▶  rank 1: layers a..b  ──▶ ... ──▶ rank p−1: loss
    rank 0: backward      ◀──gradient────  rank 1: backward     ◀── ... ◀──

Only one rank computes at any moment: the idle fraction is (p − 1)/p, the price that
pipelining cuts by splitting the batch. This is the "manual MP" row of the benchmark. It is
a pipeline of one micro-batch, so it runs on the pipeline engine
(:mod:`disttrain.parallel.pipeline.runtime`): GPipe's schedule with m = 1 is exactly this
split, with the same messages, failure notices and checks.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from disttrain.comm import Communicator
from disttrain.parallel.pipeline.runtime import PipelineParallel, build_pipeline


def build_model_parallel(model: Any, comm: Communicator, *,
                         partition: str | Sequence[int] = "params",
                         sample: torch.Tensor | None = None) -> PipelineParallel:
    """Split ``model`` over every rank of ``comm`` and return this rank's part: a pipeline
    of one micro-batch (``train_step``, ``eval_forward``, ``share_from_last`` as there)."""
    return build_pipeline(model, comm, schedule="gpipe", microbatches=1, partition=partition,
                          sample=sample, warn_bubble=False)


def __getattr__(name: str) -> Any:
    if name == "ModelParallel":  # the second engine this module used to be
        warnings.warn("disttrain.parallel.pipeline.ModelParallel is the pipeline engine with "
                      "one micro-batch now: build it with build_model_parallel(...) (a "
                      "PipelineParallel)", DeprecationWarning, stacklevel=2)
        return PipelineParallel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["build_model_parallel"]
