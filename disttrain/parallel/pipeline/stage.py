"""One pipeline stage's compute: its layers, and the micro-batches it holds between their
forward and their backward.

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
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from disttrain.parallel.pipeline.link import PipelineError


@dataclass
class _Stashed:
    input: torch.Tensor
    output: torch.Tensor  # the last stage stashes the (scalar) loss
    nbytes: int


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

    def _run_layers(self, x: torch.Tensor, source: str | None) -> torch.Tensor:
        for offset, layer in enumerate(self.module):
            try:
                x = layer(x)
            except (RuntimeError, ValueError, TypeError) as exc:
                if offset > 0 or source is None:
                    raise
                raise PipelineError(
                    f"stage {self.index} could not run its first layer (layer "
                    f"{self.first_layer}, {type(layer).__name__}) on the activation of shape "
                    f"{tuple(x.shape)} and dtype {x.dtype} received from {source}: the layers "
                    f"on either side of this stage boundary do not fit together ({exc})"
                ) from exc
            if not isinstance(x, torch.Tensor):
                raise PipelineError(f"layer {self.first_layer + offset} on stage {self.index} "
                                    f"returned {type(x).__name__}; pipeline layers must return "
                                    f"one tensor")
        return x

    def forward(self, microbatch: int, x: torch.Tensor, *, source: str | None = None,
                loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
                loss_key: tuple[object, ...] = ()) -> torch.Tensor:
        """Run the layers on ``x`` (received from ``source``, or None on the first stage) and
        stash what backward needs. With ``loss``, return and stash ``loss(output)`` instead;
        ``loss_key`` describes what the loss saves besides the output (its target's shape,
        dtype and storage size), so the saved bytes are counted once per signature."""
        if source is not None and x.is_floating_point():
            x.requires_grad_(True)
        kind = x.device.type
        key = (tuple(x.shape), x.dtype, x.requires_grad, x.untyped_storage().nbytes(),
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
        self._stash[microbatch] = _Stashed(x, out, nbytes)
        self._held_bytes += nbytes
        self.peak_stashed = max(self.peak_stashed, len(self._stash))
        self.peak_bytes = max(self.peak_bytes, self._held_bytes)
        return out

    def output_shape(self, microbatch: int) -> tuple[int, ...]:
        return tuple(self._stash[microbatch].output.shape)

    def backward(self, microbatch: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        """Back-propagate ``grad`` (None for the loss) through the micro-batch's stashed
        graph; parameter gradients accumulate in ``.grad``. Returns the input's gradient
        (zeros if the input did not influence the output), or None on the first stage."""
        stashed = self._stash.pop(microbatch)
        self._held_bytes -= stashed.nbytes
        start = time.perf_counter()
        if stashed.output.requires_grad:
            torch.autograd.backward(stashed.output, grad)
        self.busy_s += time.perf_counter() - start
        x = stashed.input
        if self.index == 0:
            return None
        return x.grad if x.grad is not None else torch.zeros_like(x)

    def forward_only(self, x: torch.Tensor, source: str | None = None) -> torch.Tensor:
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
