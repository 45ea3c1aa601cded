"""One training step of one stage: the interpreter of its schedule's actions.

Each action type has one small handler; the tensors between them wait in dictionaries
keyed by micro-batch (inputs received, outputs to send, gradients received, input
gradients to send), so the handlers need no knowledge of the schedule: any valid action
list (GPipe, 1F1B, or a new one) runs unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache

import torch

from disttrain.parallel.pipeline.link import TRAIN, Direction, PipelineError, StageLink
from disttrain.parallel.pipeline.schedules import (
    Action,
    Backward,
    Forward,
    RecvAct,
    RecvGrad,
    SendAct,
    SendGrad,
)
from disttrain.parallel.pipeline.stage import Stage

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ACTIVATION, GRADIENT = Direction.ACTIVATION, Direction.GRADIENT


@lru_cache(maxsize=64)
def _message_counts(actions: tuple[Action, ...]) -> tuple[int, int, int, int]:
    """(activations sent, gradients sent, activations received, gradients received): the
    same every step of a schedule, so counted once."""
    def count(kind: type[Action]) -> int:
        return sum(isinstance(a, kind) for a in actions)

    return count(SendAct), count(SendGrad), count(RecvAct), count(RecvGrad)


def begin_step(link: StageLink, actions: Sequence[Action]) -> None:
    """Tell the link how many messages this step sends and receives each way (it posts the
    receives now, so they land while the stage computes)."""
    send_act, send_grad, recv_act, recv_grad = _message_counts(tuple(actions))
    link.begin(TRAIN, sends={ACTIVATION: send_act, GRADIENT: send_grad},
               recvs={ACTIVATION: recv_act, GRADIENT: recv_grad})


class StepRun:
    """The state of one ``train_step`` on one stage."""

    def __init__(self, stage: Stage, link: StageLink | None, call: int,
                 inputs: list[torch.Tensor] | None, targets: list[torch.Tensor] | None,
                 loss_fn: LossFn) -> None:
        self.stage = stage
        self.link = link
        self.call = call
        self.inputs: dict[int, torch.Tensor] = dict(enumerate(inputs)) if inputs else {}
        self.targets = targets
        self.loss_fn = loss_fn
        self.total_rows = sum(len(t) for t in targets) if targets else 0
        self.rows: dict[int, int] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.grads: dict[int, torch.Tensor] = {}
        self.input_grads: dict[int, torch.Tensor] = {}
        self.loss_sum: torch.Tensor | None = None  # the last stage's running loss
        self.loss_seen = 0.0  # the loss as carried by the latest gradient header
        self.handlers: dict[type[Action], Callable[[int], None]] = {
            RecvAct: self.recv_act, Forward: self.forward, SendAct: self.send_act,
            RecvGrad: self.recv_grad, Backward: self.backward, SendGrad: self.send_grad,
        }

    def execute(self, actions: Sequence[Action]) -> None:
        """Run ``actions`` in order (after :func:`begin_step` announced their messages)."""
        for action in actions:
            self.handlers[type(action)](action.microbatch)

    def _link(self) -> StageLink:
        if self.link is None:
            raise PipelineError("a single-stage pipeline has no neighbours to talk to")
        return self.link

    def _source(self) -> str | None:
        return None if self.stage.index == 0 else self._link().describe(self.stage.index - 1)

    def recv_act(self, mb: int) -> None:
        message = self._link().recv(ACTIVATION, call=self.call, mode=TRAIN, microbatch=mb)
        self.inputs[mb], self.rows[mb] = message.tensor, message.rows

    def forward(self, mb: int) -> None:
        x = self.inputs.pop(mb)
        if self.stage.index == 0:
            self.rows[mb] = x.shape[0] if x.dim() else 0
        if self.targets is None:
            self.outputs[mb] = self.stage.forward(mb, x, source=self._source())
            return
        target = self.targets[mb]
        if self.rows[mb] != len(target):
            raise PipelineError(
                f"stage {self.stage.index} (the last) has targets of {len(target)} rows for "
                f"micro-batch {mb} but stage 0 cut that micro-batch with {self.rows[mb]} rows: "
                f"every rank must pass the same batch (inputs and targets of equal length)")
        weight = len(target) / self.total_rows  # 1/m for equal micro-batches

        def loss(out: torch.Tensor) -> torch.Tensor:
            return self.loss_fn(out, target) * weight

        key = (tuple(target.shape), target.dtype, target.untyped_storage().nbytes())
        value = self.stage.forward(mb, x, source=self._source(), loss=loss, loss_key=key)
        if value.numel() != 1:
            raise PipelineError(f"loss_fn must return a scalar (the micro-batch's mean loss), "
                                f"got shape {tuple(value.shape)}")
        detached = value.detach().reshape(())
        self.loss_sum = detached if self.loss_sum is None else self.loss_sum + detached

    def send_act(self, mb: int) -> None:
        self._link().send(ACTIVATION, self.outputs.pop(mb), call=self.call, mode=TRAIN,
                          microbatch=mb, rows=self.rows[mb])

    def recv_grad(self, mb: int) -> None:
        link = self._link()
        message = link.recv(GRADIENT, call=self.call, mode=TRAIN, microbatch=mb)
        grad, self.loss_seen = message.tensor, message.value
        expected = self.stage.output_shape(mb)
        if tuple(grad.shape) != expected:
            raise PipelineError(
                f"{link.describe(self.stage.index)} sent an output of shape {expected} for "
                f"micro-batch {mb} but {link.describe(self.stage.index + 1)} sent back a "
                f"gradient of shape {tuple(grad.shape)}")
        self.grads[mb] = grad

    def backward(self, mb: int) -> None:
        grad_in = self.stage.backward(mb, self.grads.pop(mb, None))
        if grad_in is not None:
            self.input_grads[mb] = grad_in

    def send_grad(self, mb: int) -> None:
        self._link().send(GRADIENT, self.input_grads.pop(mb), call=self.call, mode=TRAIN,
                          microbatch=mb, rows=self.rows.pop(mb), value=self.loss())

    def loss(self) -> float:
        """The batch's loss: summed here on the last stage; elsewhere what the last gradient
        received said (the last stage sends its final gradient after its final forward, and
        every stage its final gradient after its final receive, so it is the full sum once
        the step is done)."""
        return float(self.loss_sum) if self.loss_sum is not None else self.loss_seen
