"""Per-layer forward and backward times of a model, inside passes of the whole model.

A timestamp after each layer's forward, and during the one backward call a timestamp when
the gradient of each layer's output arrives (a tensor hook), so layer i's backward is the
time between the gradient of its output and that of its input. Summed, the layers are the
pass, less what lies between the last forward and the first gradient (the loss, the start
of backward), which the training loop's cost holds
(:func:`~disttrain.probe.wrappers.loop_cost`). (Timing each layer on its own, with its own
backward call, charged every layer the autograd engine's start and cold caches: on LeNet
the layers summed to 1.3–1.7× the whole model's forward+backward.) Each layer also runs on
its own once, on a detached input, to count the bytes of the tensors autograd saves for
backward (``torch.autograd.graph.saved_tensors_hooks``: what a layer's activations cost in
memory) and its output bytes (what a pipeline stage sends to the next).
:mod:`~disttrain.probe.profiler` fits these into a profile.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

REPEATS = 5  # standalone runs of a layer, when whole-model passes cannot time it
PASSES = 21  # whole-model passes timed per batch size (the median per layer)
Rows = list[tuple[float, float, int, int]]  # per layer: forward s, backward s, saved, out


def saved_bytes(run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """``run()``'s output and the bytes of the tensors autograd saved while it ran."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, total


def time_layer(layer: nn.Module, x: torch.Tensor, loss: bool, repeats: int = REPEATS
               ) -> tuple[float, float, int, int]:
    """Median (forward s, backward s) of ``repeats`` runs after one warm-up, saved bytes and
    output bytes of ``layer`` on ``x``."""
    fwd, bwd, saved, out_bytes = [], [], 0, 0
    for run in range(repeats + 1):
        x_in = x.detach().requires_grad_(x.is_floating_point())
        start = time.perf_counter()
        y, saved = saved_bytes(lambda: layer(x_in))  # noqa: B023 (used at once)
        out_bytes = y.numel() * y.element_size()
        target = y.float().pow(2).mean() if loss else None  # a scalar loss on the last layer
        mid = time.perf_counter()
        if y.requires_grad:
            (target if target is not None else y).backward(
                None if target is not None else torch.ones_like(y))
        end = time.perf_counter()
        if run:
            fwd.append(mid - start)
            bwd.append(end - mid)
        layer.zero_grad(set_to_none=True)
    return statistics.median(fwd), statistics.median(bwd), saved, out_bytes


def run_layers(layers: list[nn.Module], sample: torch.Tensor) -> Rows:
    """Per layer: (forward s, backward s) from whole-model passes (:func:`pass_times`),
    saved bytes and output bytes from a standalone run (its times are used only when the
    passes cannot time the layers: then each layer is timed alone, :data:`REPEATS` runs)."""
    times = pass_times(layers, sample)
    rows, x = [], sample
    for i, layer in enumerate(layers):
        rows.append(time_layer(layer, x, loss=i == len(layers) - 1,
                               repeats=REPEATS if times is None else 1))
        with torch.no_grad():
            x = layer(x)
    if times is None:  # a layer's output takes no gradient: keep the standalone times
        return rows
    return [(f, b, saved, out) for (f, b), (_, _, saved, out) in zip(times, rows, strict=True)]


def one_pass(layers: list[nn.Module], sample: torch.Tensor) -> list[tuple[float, float]] | None:
    """One forward and one backward of ``layers`` in sequence (the loss on the last output
    as :func:`time_layer` uses), with a timestamp after each layer's forward and one when
    the gradient of each layer's output arrives; None if an output takes no gradient. An
    in-place layer (``ReLU(inplace=True)``) returns its input tensor, so both hooks sit on
    one tensor: its backward is counted in the layer before it (the sum stays right)."""
    n = len(layers)
    marks = [time.perf_counter()]
    outputs, x = [], sample
    for layer in layers:
        x = layer(x)
        marks.append(time.perf_counter())
        outputs.append(x)
    if not all(y.requires_grad for y in outputs):
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        return None
    arrived = [0.0] * n  # arrived[i]: gradient of layer i's output ready

    def stamp(i: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            arrived[i] = time.perf_counter()
        return hook

    for i, y in enumerate(outputs):
        y.register_hook(stamp(i))
    target = x.float().pow(2).mean()
    target.backward()
    done = time.perf_counter()
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    ends = [arrived[i - 1] if i else done for i in range(n)]  # input's gradient (or the end)
    return [(marks[i + 1] - marks[i], max(0.0, ends[i] - arrived[i])) for i in range(n)]


def pass_times(layers: list[nn.Module], sample: torch.Tensor,
               passes: int = PASSES) -> list[tuple[float, float]] | None:
    """Median per layer (forward s, backward s) over ``passes`` whole-model passes, after
    two warm-up passes; None when :func:`one_pass` cannot time the layers."""
    runs = []
    for i in range(passes + 2):
        times = one_pass(layers, sample)
        if times is None:
            return None
        if i >= 2:
            runs.append(times)
    return [(statistics.median(r[i][0] for r in runs), statistics.median(r[i][1] for r in runs))
            for i in range(len(layers))]
