"""One pipeline stage: its layers and the micro-batches it holds between their forward and
their backward (:mod:`.step` runs one step of its schedule on it).

Under interleaved 1F1B a rank holds v *chunks* of layers (chunk c is virtual stage c·p + r
of p·v): the stage runs each action on the chunk it names, and holds every chunk's
micro-batches in one stash, so its peaks are the rank's.

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
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from disttrain.parallel.pipeline import bundle
from disttrain.parallel.pipeline.link import PipelineError


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


Key = tuple[int, int]  # (micro-batch, chunk)


class Stage:
    """The layers of stage ``index`` of ``num_stages`` (an ``nn.Sequential`` whose children
    are named by their index in the whole model, see ``partition.stage_module``), or its v
    chunks (a list of them: chunk c is virtual stage ``c · num_stages + index``)."""

    def __init__(self, module: nn.Sequential | Sequence[nn.Sequential], index: int,
                 num_stages: int) -> None:
        self.chunks = [module] if isinstance(module, nn.Module) else list(module)
        # all the rank's layers in one module, named by their index in the whole model: its
        # parameters and state dict are the stage's
        self.module = self.chunks[0] if len(self.chunks) == 1 else nn.Sequential(OrderedDict(
            (name, layer) for chunk in self.chunks for name, layer in chunk.named_children()))
        self.index = index
        self.num_stages = num_stages
        self.first_layers = [int(next(iter(c._modules))) if len(c) else 0 for c in self.chunks]
        self._stash: dict[Key, _Stashed] = {}
        self._held_bytes = 0
        self.busy_s = 0.0
        self.peak_stashed = 0
        self.peak_bytes = 0
        self._not_activations = _storages(self.module)
        self._saved_bytes: dict[tuple[object, ...], int] = {}  # forward signature → bytes

    @property
    def stashed(self) -> int:
        return len(self._stash)

    def virtual(self, chunk: int) -> int:
        """The virtual stage ``chunk`` is (the stage itself without chunks)."""
        return chunk * self.num_stages + self.index

    @property
    def num_virtual(self) -> int:
        return self.num_stages * len(self.chunks)

    def name(self, chunk: int) -> str:
        """``stage 1``, or ``stage 1 (chunk 1, virtual stage 3)``."""
        if len(self.chunks) == 1:
            return f"stage {self.index}"
        return f"stage {self.index} (chunk {chunk}, virtual stage {self.virtual(chunk)})"

    def reset_counters(self) -> None:
        """Start a new measurement of busy time and peaks."""
        self.busy_s = 0.0
        self.peak_stashed = len(self._stash)
        self.peak_bytes = self._held_bytes
        storages = _storages(self.module)  # once per step, not per micro-batch
        if storages != self._not_activations:  # parameters moved: counts may differ
            self._not_activations, self._saved_bytes = storages, {}

    def _run_layers(self, x: Any, source: str | None, chunk: int = 0) -> Any:
        """Each layer takes the previous one's output as its one argument: a tensor, or a
        tuple, list or dict of tensors (a stage boundary carries any of them)."""
        first = self.first_layers[chunk]
        for offset, layer in enumerate(self.chunks[chunk]):
            try:
                x = layer(x)
            except (RuntimeError, ValueError, TypeError) as exc:
                if offset > 0 or source is None:
                    raise
                raise PipelineError(
                    f"{self.name(chunk)} could not run its first layer (layer {first}, "
                    f"{type(layer).__name__}) on the activation {_describe(x)} received from "
                    f"{source}: the layers on either side of this stage boundary do not fit "
                    f"together ({exc})") from exc
            if not bundle.is_tensor(x):
                bundle.leaves(x, f"the output of layer {first + offset} on {self.name(chunk)}")
        return x

    def forward(self, microbatch: int, x: Any, *, chunk: int = 0, source: str | None = None,
                loss: Callable[[Any], torch.Tensor] | None = None,
                loss_key: tuple[object, ...] = ()) -> Any:
        """Run the ``chunk``'s layers on ``x`` (received from ``source``, or None on the
        first stage) and stash what backward needs. With ``loss``, return and stash
        ``loss(output)`` instead; ``loss_key`` describes what the loss saves besides the
        output (its target's shape, dtype and storage size), so the saved bytes are counted
        once per signature."""
        inputs, spec = _flat(x, f"the input of {self.name(chunk)}")
        if source is not None:
            for leaf in inputs:
                if leaf.is_floating_point():
                    leaf.requires_grad_(True)
        kind = inputs[0].device.type if inputs else "cpu"
        key = (tuple((tuple(t.shape), t.dtype, t.requires_grad, t.untyped_storage().nbytes())
                     for t in inputs),
               self.module.training, torch.is_autocast_enabled(kind),
               torch.get_autocast_dtype(kind), loss is not None, loss_key, chunk)
        nbytes = self._saved_bytes.get(key)
        saved = _SavedBytes(self._not_activations) if nbytes is None else None
        start = time.perf_counter()
        with saved.counting() if saved is not None else nullcontext():
            out = self._run_layers(x, source, chunk)
            if loss is not None:
                out = loss(out)
        self.busy_s += time.perf_counter() - start
        if saved is not None:
            nbytes = self._saved_bytes[key] = saved.nbytes
        assert nbytes is not None
        self._stash[(microbatch, chunk)] = _Stashed(inputs, spec, out, nbytes)
        self._held_bytes += nbytes
        self.peak_stashed = max(self.peak_stashed, len(self._stash))
        self.peak_bytes = max(self.peak_bytes, self._held_bytes)
        return out

    def output_leaves(self, microbatch: int, chunk: int = 0) -> list[torch.Tensor]:
        """The tensor leaves of the micro-batch's stashed output (one: a plain tensor)."""
        return _flat(self._stash[(microbatch, chunk)].output, "the output")[0]

    def input_spec(self, microbatch: int, chunk: int = 0) -> Any:
        """The structure of the micro-batch's input (None: a plain tensor)."""
        return self._stash[(microbatch, chunk)].spec

    def backward(self, microbatch: int, grads: list[torch.Tensor] | None, chunk: int = 0
                 ) -> list[torch.Tensor] | None:
        """Back-propagate ``grads`` (one per output leaf; None for the loss) through the
        micro-batch's stashed graph in ``chunk``; parameter gradients accumulate in
        ``.grad``. Returns the input leaves' gradients (zeros where a leaf did not influence
        the output, empty for a leaf that takes none), or None on the first (virtual)
        stage."""
        stashed = self._stash.pop((microbatch, chunk))
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
        if self.virtual(chunk) == 0:
            return None
        if stashed.spec is None:  # a plain tensor: its gradient, as before bundles existed
            x = stashed.inputs[0]
            return [x.grad if x.grad is not None else torch.zeros_like(x)]
        return bundle.gradients_of(stashed.inputs)

    def forward_only(self, x: Any, source: str | None = None, chunk: int = 0) -> Any:
        """Inference: run the layers without building a graph or stashing anything."""
        start = time.perf_counter()
        with torch.no_grad():
            out = self._run_layers(x, source, chunk)
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
