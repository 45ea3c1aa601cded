"""One pipeline stage: its layers, the micro-batches it holds between their forward and their
backward, and the interpreter that runs one step of its schedule (:class:`StepRun`).

Forward keeps the micro-batch's input and output (and, inside autograd, every tensor the
layers save for backward) until that micro-batch's backward: this *stash* is the activation
memory that GPipe lets grow to m micro-batches and 1F1B bounds by p − s. The stage measures
it as it happens: the number of stashed micro-batches, and the bytes autograd saves for
them (counted by ``torch.autograd.graph.saved_tensors_hooks``, parameters excluded, each
storage once), plus the time spent computing (the stage's busy time; the rest of a step is
waiting: the bubble).

Counting calls a Python hook for every tensor autograd saves (and one more per tensor in
backward): about a sixth of the CPU time of a small stage (LeNet's last layers, 4-sample
micro-batches). The bytes depend on what the forward sees, not on the values: the input's
shape, dtype and storage, the loss's target, train/eval mode and autocast. So a stage
counts the first forward of each such *signature* and reuses that count for the next ones;
a model whose saved tensors depend on the values themselves (data-dependent control flow)
is counted as its first micro-batch of that signature.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import nn

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


@dataclass
class _Stashed:
    inputs: list[torch.Tensor]  # the input's tensor leaves (one: a plain tensor)
    spec: Any  # the input's structure (None: a plain tensor)
    output: Any  # a tensor or a tree of them; the last stage stashes the (scalar) loss
    nbytes: int


def _flat(value: Any, what: str) -> tuple[list[torch.Tensor], Any]:
    """A boundary value's tensor leaves and structure (None for a plain tensor)."""
    return ([value], None) if bundle.is_tensor(value) else bundle.leaves(value, what)


def _describe(value: Any) -> str:
    if bundle.is_tensor(value):
        return f"of shape {tuple(value.shape)} and dtype {value.dtype}"
    flat, _ = bundle.leaves(value, "the activation")
    return f"{type(value).__name__} of tensors {[tuple(t.shape) for t in flat]}"


class Stage:
    """The layers of stage ``index`` of ``num_stages`` (an ``nn.Sequential`` whose children
    are named by their index in the whole model, see ``partition.stage_module``)."""

    def __init__(self, module: nn.Sequential, index: int, num_stages: int) -> None:
        self.module = module
        self.index = index
        self.num_stages = num_stages
        self.first_layer = int(next(iter(module._modules))) if len(module) else 0
        self._stash: dict[int, _Stashed] = {}
        self._held_bytes = 0
        self.busy_s = 0.0
        self.peak_stashed = 0
        self.peak_bytes = 0
        self._not_activations = _storages(module)
        self._saved_bytes: dict[tuple[object, ...], int] = {}  # forward signature → bytes

    @property
    def stashed(self) -> int:
        return len(self._stash)

    def reset_counters(self) -> None:
        """Start a new measurement of busy time and peaks."""
        self.busy_s = 0.0
        self.peak_stashed = len(self._stash)
        self.peak_bytes = self._held_bytes
        storages = _storages(self.module)  # once per step, not per micro-batch
        if storages != self._not_activations:  # parameters moved: counts may differ
            self._not_activations, self._saved_bytes = storages, {}

    def _run_layers(self, x: Any, source: str | None) -> Any:
        """Each layer takes the previous one's output as its one argument: a tensor, or a
        tuple, list or dict of tensors (a stage boundary carries any of them)."""
        for offset, layer in enumerate(self.module):
            try:
                x = layer(x)
            except (RuntimeError, ValueError, TypeError) as exc:
                if offset > 0 or source is None:
                    raise
                raise PipelineError(
                    f"stage {self.index} could not run its first layer (layer "
                    f"{self.first_layer}, {type(layer).__name__}) on the activation "
                    f"{_describe(x)} received from {source}: the layers on either side of "
                    f"this stage boundary do not fit together ({exc})") from exc
            if not bundle.is_tensor(x):
                bundle.leaves(x, f"the output of layer {self.first_layer + offset} on stage "
                                 f"{self.index}")
        return x

    def forward(self, microbatch: int, x: Any, *, source: str | None = None,
                loss: Callable[[Any], torch.Tensor] | None = None,
                loss_key: tuple[object, ...] = ()) -> Any:
        """Run the layers on ``x`` (received from ``source``, or None on the first stage) and
        stash what backward needs. With ``loss``, return and stash ``loss(output)`` instead;
        ``loss_key`` describes what the loss saves besides the output (its target's shape,
        dtype and storage size), so the saved bytes are counted once per signature."""
        inputs, spec = _flat(x, f"the input of stage {self.index}")
        if source is not None:
            for leaf in inputs:
                if leaf.is_floating_point():
                    leaf.requires_grad_(True)
        kind = inputs[0].device.type if inputs else "cpu"
        key = (tuple((tuple(t.shape), t.dtype, t.requires_grad, t.untyped_storage().nbytes())
                     for t in inputs),
               self.module.training, torch.is_autocast_enabled(kind),
               torch.get_autocast_dtype(kind), loss is not None, loss_key)
        nbytes = self._saved_bytes.get(key)
        saved = _SavedBytes(self._not_activations) if nbytes is None else None
        start = time.perf_counter()
        with saved.counting() if saved is not None else nullcontext():
            out = self._run_layers(x, source)
            if loss is not None:
                out = loss(out)
        self.busy_s += time.perf_counter() - start
        if saved is not None:
            nbytes = self._saved_bytes[key] = saved.nbytes
        assert nbytes is not None
        self._stash[microbatch] = _Stashed(inputs, spec, out, nbytes)
        self._held_bytes += nbytes
        self.peak_stashed = max(self.peak_stashed, len(self._stash))
        self.peak_bytes = max(self.peak_bytes, self._held_bytes)
        return out

    def output_leaves(self, microbatch: int) -> list[torch.Tensor]:
        """The tensor leaves of the micro-batch's stashed output (one: a plain tensor)."""
        return _flat(self._stash[microbatch].output, "the output")[0]

    def input_spec(self, microbatch: int) -> Any:
        """The structure of the micro-batch's input (None: a plain tensor)."""
        return self._stash[microbatch].spec

    def backward(self, microbatch: int, grads: list[torch.Tensor] | None
                 ) -> list[torch.Tensor] | None:
        """Back-propagate ``grads`` (one per output leaf; None for the loss) through the
        micro-batch's stashed graph; parameter gradients accumulate in ``.grad``. Returns
        the input leaves' gradients (zeros where a leaf did not influence the output, empty
        for a leaf that takes none), or None on the first stage."""
        stashed = self._stash.pop(microbatch)
        self._held_bytes -= stashed.nbytes
        start = time.perf_counter()
        if grads is None:
            if stashed.output.requires_grad:
                torch.autograd.backward(stashed.output)
        else:
            outs = _flat(stashed.output, "the output")[0]
            pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        self.busy_s += time.perf_counter() - start
        if self.index == 0:
            return None
        if stashed.spec is None:  # a plain tensor: its gradient, as before bundles existed
            x = stashed.inputs[0]
            return [x.grad if x.grad is not None else torch.zeros_like(x)]
        return bundle.gradients_of(stashed.inputs)

    def forward_only(self, x: Any, source: str | None = None) -> Any:
        """Inference: run the layers without building a graph or stashing anything."""
        start = time.perf_counter()
        with torch.no_grad():
            out = self._run_layers(x, source)
        self.busy_s += time.perf_counter() - start
        return out

    def clear(self) -> None:
        """Drop every stashed micro-batch (after a failed step)."""
        self._stash.clear()
        self._held_bytes = 0


class _SavedBytes:
    """Bytes of the tensors autograd saves for backward during one forward, each storage
    counted once and the module's parameters and buffers left out (they are not
    activations: they live whether or not a micro-batch is in flight)."""

    def __init__(self, exclude: set[int]) -> None:
        self.nbytes = 0
        self._seen = set(exclude)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._seen:
            self._seen.add(storage.data_ptr())
            self.nbytes += storage.nbytes()
        return t

    @contextmanager
    def counting(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield


def device_of(modules: Iterable[nn.Module]) -> torch.device:
    """Where a model computes: the device of its first parameter or buffer (the CPU when it
    has none). A stage puts what it receives there, also a stage of parameterless layers."""
    for module in modules:
        for tensor in (*module.parameters(), *module.buffers()):
            return tensor.device
    return torch.device("cpu")


def _storages(module: nn.Module) -> set[int]:
    """Addresses of the storages of ``module``'s parameters and buffers."""
    return {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}


# ----------------------------------------------------------------------
# One training step of one stage: the interpreter of its schedule's actions.
#
# Each action type has one small handler; the tensors between them wait in dictionaries
# keyed by micro-batch (inputs received, outputs to send, gradients received, input
# gradients to send), so the handlers need no knowledge of the schedule: any valid action
# list (GPipe, 1F1B, or a new one) runs unchanged.

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
                 inputs: list[Any] | None, targets: list[torch.Tensor] | None,
                 loss_fn: LossFn) -> None:
        self.stage = stage
        self.link = link
        self.call = call
        self.inputs: dict[int, Any] = dict(enumerate(inputs)) if inputs else {}
        self.targets = targets
        self.loss_fn = loss_fn
        self.total_rows = sum(len(t) for t in targets) if targets else 0
        self.rows: dict[int, int] = {}
        self.outputs: dict[int, Any] = {}
        self.grads: dict[int, list[torch.Tensor]] = {}
        self.input_grads: dict[int, tuple[list[torch.Tensor], Any]] = {}
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
        self.inputs[mb], self.rows[mb] = received(message, "an activation"), message.rows

    def forward(self, mb: int) -> None:
        x = self.inputs.pop(mb)
        if self.stage.index == 0:
            self.rows[mb] = bundle.rows_of(x)
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

        def loss(out: Any) -> torch.Tensor:
            return self.loss_fn(out, target) * weight

        key = (tuple(target.shape), target.dtype, target.untyped_storage().nbytes())
        value = self.stage.forward(mb, x, source=self._source(), loss=loss, loss_key=key)
        if value.numel() != 1:
            raise PipelineError(f"loss_fn must return a scalar (the micro-batch's mean loss), "
                                f"got shape {tuple(value.shape)}")
        detached = value.detach().reshape(())
        self.loss_sum = detached if self.loss_sum is None else self.loss_sum + detached

    def send_act(self, mb: int) -> None:
        send_value(self._link(), ACTIVATION, self.outputs.pop(mb), call=self.call,
                   mode=TRAIN, microbatch=mb, rows=self.rows[mb])

    def recv_grad(self, mb: int) -> None:
        link = self._link()
        message = link.recv(GRADIENT, call=self.call, mode=TRAIN, microbatch=mb)
        self.loss_seen = message.value
        outputs = self.stage.output_leaves(mb)
        if message.bundle:  # a leaf that takes no gradient gets an empty one
            grads = bundle.unpack(message.tensor, "a gradient")[0]
            shapes = [tuple(o.shape) if o.is_floating_point() else (0,) for o in outputs]
        else:
            grads, shapes = [message.tensor], [tuple(o.shape) for o in outputs]
        if [tuple(g.shape) for g in grads] != shapes:
            raise PipelineError(
                f"{link.describe(self.stage.index)} sent an output of shape(s) {shapes} for "
                f"micro-batch {mb} but {link.describe(self.stage.index + 1)} sent back "
                f"gradient(s) of shape(s) {[tuple(g.shape) for g in grads]}")
        self.grads[mb] = grads

    def backward(self, mb: int) -> None:
        spec = self.stage.input_spec(mb)
        grads_in = self.stage.backward(mb, self.grads.pop(mb, None))
        if grads_in is not None:
            self.input_grads[mb] = (grads_in, spec)

    def send_grad(self, mb: int) -> None:
        grads, spec = self.input_grads.pop(mb)
        value = grads[0] if spec is None else bundle.build(grads, spec)
        send_value(self._link(), GRADIENT, value, call=self.call, mode=TRAIN, microbatch=mb,
                   rows=self.rows.pop(mb), value=self.loss())

    def loss(self) -> float:
        """The batch's loss: summed here on the last stage; elsewhere what the last gradient
        received said (the last stage sends its final gradient after its final forward, and
        every stage its final gradient after its final receive, so it is the full sum once
        the step is done)."""
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
