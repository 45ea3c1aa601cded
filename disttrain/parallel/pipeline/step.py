"""One training step of one stage: the interpreter of its schedule's actions.

Each action type has one small handler; the tensors between them wait in dictionaries
keyed by (micro-batch, chunk) (inputs received, outputs to send, gradients received, input
gradients to send), so the handlers need no knowledge of the schedule: any valid action
list (GPipe, 1F1B, interleaved 1F1B, or a new one) runs unchanged. A message's chunk is the
receiver's: the same on the neighbour, except across the ring's wrap (the last stage's
chunk c feeds stage 0's chunk c + 1, and gradients come back to chunk c).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import torch

from disttrain.parallel.pipeline import bundle
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
from disttrain.parallel.pipeline.stage import Key, Stage

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
    """The state of one ``train_step`` on one stage. Everything waits under its (micro-batch,
    chunk) key: without chunks, the chunk is always 0."""

    def __init__(self, stage: Stage, link: StageLink | None, call: int,
                 inputs: list[Any] | None, targets: list[torch.Tensor] | None,
                 loss_fn: LossFn) -> None:
        self.stage = stage
        self.link = link
        self.call = call
        self.inputs: dict[Key, Any] = {(mb, 0): x for mb, x in enumerate(inputs or [])}
        self.targets = targets  # the last stage's: its last chunk computes the loss
        self.loss_fn = loss_fn
        self.total_rows = sum(len(t) for t in targets) if targets else 0
        self.rows: dict[Key, int] = {}
        self.outputs: dict[Key, Any] = {}
        self.grads: dict[Key, list[torch.Tensor]] = {}
        self.input_grads: dict[Key, tuple[list[torch.Tensor], Any]] = {}
        self.loss_sum: torch.Tensor | None = None  # the last stage's running loss
        self.loss_seen = 0.0  # the loss as carried by the latest gradient header
        self.handlers: dict[type[Action], Callable[[int, int], None]] = {
            RecvAct: self.recv_act, Forward: self.forward, SendAct: self.send_act,
            RecvGrad: self.recv_grad, Backward: self.backward, SendGrad: self.send_grad,
        }

    def execute(self, actions: Sequence[Action]) -> None:
        """Run ``actions`` in order (after :func:`begin_step` announced their messages)."""
        for action in actions:
            self.handlers[type(action)](action.microbatch, action.chunk)

    def _link(self) -> StageLink:
        if self.link is None:
            raise PipelineError("a single-stage pipeline has no neighbours to talk to")
        return self.link

    def _source(self, c: int) -> str | None:
        if self.stage.virtual(c) == 0:
            return None
        link = self._link()
        return link.describe(link.neighbour(-1))

    def _to(self, direction: Direction, c: int) -> int:
        """The chunk a message of chunk ``c`` goes to: the same one on the neighbour, or,
        where it crosses the ring's wrap, the next (activations) or previous (gradients)."""
        if direction is ACTIVATION:
            return c + 1 if self.stage.index == self.stage.num_stages - 1 else c
        return c - 1 if self.stage.index == 0 else c

    def recv_act(self, mb: int, c: int) -> None:
        message = self._link().recv(ACTIVATION, call=self.call, mode=TRAIN, microbatch=mb,
                                    chunk=c)
        self.inputs[(mb, c)], self.rows[(mb, c)] = (received(message, "an activation"),
                                                    message.rows)

    def forward(self, mb: int, c: int) -> None:
        x = self.inputs.pop((mb, c))
        if self.stage.virtual(c) == 0:
            self.rows[(mb, c)] = bundle.rows_of(x)
        if self.targets is None or self.stage.virtual(c) != self.stage.num_virtual - 1:
            self.outputs[(mb, c)] = self.stage.forward(mb, x, chunk=c, source=self._source(c))
            return
        target = self.targets[mb]
        if self.rows[(mb, c)] != len(target):
            raise PipelineError(
                f"stage {self.stage.index} (the last) has targets of {len(target)} rows for "
                f"micro-batch {mb} but stage 0 cut that micro-batch with {self.rows[(mb, c)]} "
                f"rows: every rank must pass the same batch (inputs and targets of equal "
                f"length)")
        weight = len(target) / self.total_rows  # 1/m for equal micro-batches

        def loss(out: Any) -> torch.Tensor:
            return self.loss_fn(out, target) * weight

        key = (tuple(target.shape), target.dtype, target.untyped_storage().nbytes())
        value = self.stage.forward(mb, x, chunk=c, source=self._source(c), loss=loss,
                                   loss_key=key)
        if value.numel() != 1:
            raise PipelineError(f"loss_fn must return a scalar (the micro-batch's mean loss), "
                                f"got shape {tuple(value.shape)}")
        detached = value.detach().reshape(())
        self.loss_sum = detached if self.loss_sum is None else self.loss_sum + detached

    def send_act(self, mb: int, c: int) -> None:
        send_value(self._link(), ACTIVATION, self.outputs.pop((mb, c)), call=self.call,
                   mode=TRAIN, microbatch=mb, rows=self.rows[(mb, c)],
                   chunk=self._to(ACTIVATION, c))

    def recv_grad(self, mb: int, c: int) -> None:
        link = self._link()
        message = link.recv(GRADIENT, call=self.call, mode=TRAIN, microbatch=mb, chunk=c)
        self.loss_seen = message.value
        outputs = self.stage.output_leaves(mb, c)
        if message.bundle:  # a leaf that takes no gradient gets an empty one
            grads = bundle.unpack(message.tensor, "a gradient")[0]
            shapes = [tuple(o.shape) if o.is_floating_point() else (0,) for o in outputs]
        else:
            grads, shapes = [message.tensor], [tuple(o.shape) for o in outputs]
        if [tuple(g.shape) for g in grads] != shapes:
            raise PipelineError(
                f"{link.describe(self.stage.index)} sent an output of shape(s) {shapes} for "
                f"micro-batch {mb} but {link.describe(link.neighbour(1))} sent back "
                f"gradient(s) of shape(s) {[tuple(g.shape) for g in grads]}")
        self.grads[(mb, c)] = grads

    def backward(self, mb: int, c: int) -> None:
        spec = self.stage.input_spec(mb, c)
        grads_in = self.stage.backward(mb, self.grads.pop((mb, c), None), c)
        if grads_in is not None:
            self.input_grads[(mb, c)] = (grads_in, spec)

    def send_grad(self, mb: int, c: int) -> None:
        grads, spec = self.input_grads.pop((mb, c))
        value = grads[0] if spec is None else bundle.build(grads, spec)
        send_value(self._link(), GRADIENT, value, call=self.call, mode=TRAIN, microbatch=mb,
                   rows=self.rows.pop((mb, c)), value=self.loss(),
                   chunk=self._to(GRADIENT, c))

    def loss(self) -> float:
        """The batch's loss: summed here on the last stage; elsewhere what the last gradient
        received said (the last stage sends its final gradient after its final forward, and
        every stage its final gradient after its final receive, so it is the full sum once
        the step is done; interleaved, each rank's final backward is chunk 0's, whose
        gradient comes from the next rank's final backward)."""
        return float(self.loss_sum) if self.loss_sum is not None else self.loss_seen


def received(message: Any, what: str) -> Any:
    """A message's value: its tensor, or the tuple, list or dict of tensors it bundles."""
    if not message.bundle:
        return message.tensor
    flat, spec = bundle.unpack(message.tensor, what)
    return bundle.build(flat, spec)


def send_value(link: StageLink, direction: Direction, payload: Any, **header: Any) -> None:
    """Send a tensor as itself, and any other value as a bundle (one message either way)."""
    if bundle.is_tensor(payload):
        link.send(direction, payload, **header)
        return
    flat, spec = bundle.leaves(payload, f"the {direction.noun}")
    device = flat[0].device if flat else "cpu"
    link.send(direction, bundle.pack(flat, spec, device), bundle=True, **header)
