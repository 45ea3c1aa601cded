"""Model parallelism, the plain split: consecutive layers on consecutive ranks, one batch at a
time (no micro-batches).

::

    rank 0: layers 0..a   ──activation──▶  rank 1: layers a..b  ──▶ ... ──▶ rank p−1: loss
    rank 0: backward      ◀──gradient────  rank 1: backward     ◀── ... ◀──

Only one rank computes at any moment: the idle fraction is (p − 1)/p, the price that
pipelining (:mod:`disttrain.parallel.pipeline`) cuts by splitting the batch. This is the
"manual MP" row of the benchmark. The split and the messages (a header in front of each
tensor, one message each; failures passed on to the neighbours) are the pipeline's own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel.pipeline import partition as part
from disttrain.parallel.pipeline.collectives import agreed_balance
from disttrain.parallel.pipeline.link import EVAL, TRAIN, Direction, PipelineError, StageLink
from disttrain.parallel.pipeline.runtime import StepStats
from disttrain.parallel.pipeline.stage import Stage, device_of

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ACTIVATION, GRADIENT = Direction.ACTIVATION, Direction.GRADIENT


class ModelParallel:
    """This rank's share of the layers; every rank of ``comm`` is one stage."""

    def __init__(self, module: nn.Sequential, comm: Communicator,
                 device: torch.device | None = None) -> None:
        self.comm = comm
        self.stage = Stage(module, comm.rank, comm.world_size)
        self.link = StageLink(comm, comm.rank, device)
        self.last_step: StepStats | None = None
        self._call = 0
        self._failure: BaseException | None = None

    @property
    def module(self) -> nn.Sequential:
        return self.stage.module

    @property
    def is_first(self) -> bool:
        return self.comm.rank == 0

    @property
    def is_last(self) -> bool:
        return self.comm.rank == self.comm.world_size - 1

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def _input(self, inputs: torch.Tensor | None, mode: int) -> tuple[torch.Tensor, str | None]:
        if not self.is_first:
            message = self.link.recv(ACTIVATION, call=self._call, mode=mode, microbatch=0)
            return message.tensor, self.link.describe(self.comm.rank - 1)
        if not isinstance(inputs, torch.Tensor):
            raise ValueError(f"the first stage needs the inputs as a tensor, got "
                             f"{type(inputs).__name__}")
        return inputs, None

    def _step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None,
              loss_fn: LossFn) -> float:
        """Forward, loss, backward on this rank; returns the loss (which travels back from
        the last rank in the gradient headers)."""
        first, last = int(self.is_first), int(self.is_last)
        self.link.begin(TRAIN, sends={ACTIVATION: 1 - last, GRADIENT: 1 - first},
                        recvs={ACTIVATION: 1 - first, GRADIENT: 1 - last})
        x, source = self._input(inputs, TRAIN)
        rows = x.shape[0] if x.dim() else 0
        if self.is_last:
            if not isinstance(targets, torch.Tensor):
                raise ValueError("the last stage needs the targets as a tensor")
            target = targets
            key = (tuple(target.shape), target.dtype, target.untyped_storage().nbytes())
            value = self.stage.forward(0, x, source=source, loss=lambda out: loss_fn(out, target),
                                       loss_key=key)
            loss = float(value.detach())
            self.stage.backward(0, None)
        else:
            out = self.stage.forward(0, x, source=source)
            self.link.send(ACTIVATION, out, call=self._call, mode=TRAIN, microbatch=0, rows=rows)
            message = self.link.recv(GRADIENT, call=self._call, mode=TRAIN, microbatch=0)
            if message.tensor.shape != out.shape:
                raise PipelineError(f"stage {self.comm.rank + 1} sent back a gradient of shape "
                                    f"{tuple(message.tensor.shape)} for an output of shape "
                                    f"{tuple(out.shape)}")
            self.stage.backward(0, message.tensor)
            loss = message.value
        if not self.is_first:
            grad_in = x.grad if x.grad is not None else torch.zeros_like(x)
            self.link.send(GRADIENT, grad_in, call=self._call, mode=TRAIN, microbatch=0,
                           rows=rows, value=loss)
        return loss

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise PipelineError(f"this model-parallel module failed earlier and its ranks are "
                                f"out of step: {self._failure}; build a new one") from None

    def _abort(self, exc: BaseException) -> None:
        """Remember the failure and tell the neighbouring ranks, who raise at their next
        receive instead of waiting for a message that will never come."""
        self._failure = exc
        self.stage.clear()
        self.link.report_failure(exc)

    def train_step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None,
                   loss_fn: LossFn) -> float:
        """Forward through every rank, loss on the last, backward through every rank; returns
        the loss on every rank. Gradients are left in ``.grad`` for the optimizer."""
        self._check_usable()
        self._call += 1
        start = time.perf_counter()
        self.stage.reset_counters()
        try:
            loss = self._step(inputs, targets, loss_fn)
            self.link.flush()
        except BaseException as exc:
            self._abort(exc)
            raise
        self.last_step = StepStats(time.perf_counter() - start, self.stage.busy_s, 0.0,
                                   self.stage.peak_stashed, self.stage.peak_bytes,
                                   self.link.wait_s)
        return loss

    def share_from_last(self, value: float) -> float:
        """The last rank's ``value`` (e.g. an accuracy from ``eval_forward``) on every rank.
        A collective: every rank calls it."""
        t = torch.tensor([value if self.is_last else 0.0], dtype=torch.float64)
        self.comm.broadcast(t, root=self.comm.world_size - 1)
        return float(t[0])

    def eval_forward(self, inputs: torch.Tensor | None) -> torch.Tensor | None:
        """Forward only; the last rank returns the output, the others None."""
        self._check_usable()
        self._call += 1
        try:
            self.link.begin(EVAL, sends={ACTIVATION: 1 - int(self.is_last)},
                            recvs={ACTIVATION: 1 - int(self.is_first)})
            x, source = self._input(inputs, EVAL)
            out = self.stage.forward_only(x, source)
            if self.is_last:
                return out
            self.link.send(ACTIVATION, out, call=self._call, mode=EVAL, microbatch=0,
                           rows=x.shape[0] if x.dim() else 0)
            self.link.flush()
        except BaseException as exc:
            self._abort(exc)
            raise
        return None


def build_model_parallel(model: Any, comm: Communicator, *,
                         partition: str | Sequence[int] = "params",
                         sample: torch.Tensor | None = None) -> ModelParallel:
    """Split ``model`` over every rank of ``comm`` (``partition`` as in
    :func:`~disttrain.parallel.pipeline.build_pipeline`) and return this rank's part."""
    layers = part.layers_of(model)
    balance = agreed_balance(comm, layers, comm.world_size, partition, sample,
                             [comm.world_size], "the model split")
    return ModelParallel(part.stage_module(layers, balance, comm.rank), comm, device_of(layers))
