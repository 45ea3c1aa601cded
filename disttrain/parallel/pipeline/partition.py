"""Split a sequential model into p contiguous stages: by explicit balance, by parameter count,
or by measured time per layer.

A *balance* is the number of consecutive layers each stage gets, e.g. ``(3, 2, 2, 3)`` for
ten layers on four stages. It is chosen

* explicitly (the user knows the model),
* by parameter count (:func:`param_costs`): memory is the usual reason to split, or
* by time (:func:`time_costs`, after torchgpipe's ``balance_by_time``): forward + backward
  of each layer timed on a sample batch, since the slowest stage sets the pipeline's pace.

Given one cost per layer, :func:`balance_by_cost` finds the contiguous split that minimizes
the most expensive stage (the linear-partition problem, solved exactly by dynamic
programming in O(p·n²) for n layers: n is a layer count, small).
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn


class PartitionError(ValueError):
    """A model or balance that cannot be split as asked; the message says what to change."""


def layers_of(model: Any) -> list[nn.Module]:
    """The layers of ``model`` in execution order: an ``nn.Sequential``'s children, an
    ``nn.ModuleList``, or whatever a ``layers()`` method returns."""
    if isinstance(model, (nn.Sequential, nn.ModuleList)):
        layers = list(model)
    elif callable(getattr(model, "layers", None)):
        layers = list(model.layers())
    else:
        raise PartitionError(
            f"{type(model).__name__} cannot be split into pipeline stages: its forward is not "
            f"known to be a chain of layers. Give it as nn.Sequential, or add a `layers()` "
            f"method returning its layers in order (each layer's output is the next one's "
            f"input)")
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise PartitionError(f"layer {i} of {type(model).__name__} is a "
                                 f"{type(layer).__name__}, not an nn.Module")
    if not layers:
        raise PartitionError(f"{type(model).__name__} has no layers to split")
    return layers


def check_balance(balance: Sequence[int], num_layers: int,
                  num_stages: int | None = None) -> tuple[int, ...]:
    """Validate an explicit balance against the model; returns it as a tuple."""
    balance = tuple(balance)
    if num_stages is not None and len(balance) != num_stages:
        raise PartitionError(f"balance {list(balance)} has {len(balance)} stages but the "
                             f"pipeline has {num_stages}: give one layer count per stage")
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in balance):
        raise PartitionError(f"balance {list(balance)}: every stage needs an integer ≥ 1 "
                             f"layers")
    if sum(balance) != num_layers:
        raise PartitionError(f"balance {list(balance)} sums to {sum(balance)} layers but the "
                             f"model has {num_layers}: the counts must add up to the model")
    return balance


def check_stages(num_layers: int, num_stages: int) -> None:
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise PartitionError(f"the number of stages must be an integer ≥ 1, got {num_stages!r}")
    if num_layers < num_stages:
        raise PartitionError(f"cannot split {num_layers} layers into {num_stages} stages: "
                             f"every stage needs at least one layer; use at most {num_layers} "
                             f"pipeline stages or a model with more layers")


def _best_split(n: int, num_stages: int, stage_value: Callable[[int, int], Any],
                combine: Callable[[Any, Any], Any]) -> tuple[Any, tuple[int, ...]]:
    """Dynamic programming over contiguous splits: ``best[k][i]`` is the best value of a
    split of the first ``i`` layers into ``k`` stages, ``min over j`` of
    ``combine(best[k−1][j], stage_value(j, i))`` (earliest ``j`` on ties)."""
    best: list[list[Any]] = [[None] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    for i in range(1, n + 1):
        best[1][i] = stage_value(0, i)
    for k in range(2, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = combine(best[k - 1][j], stage_value(j, i))
                if best[k][i] is None or value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    sizes, i = [], n
    for k in range(num_stages, 1, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return best[num_stages][n], (i, *reversed(sizes))


def balance_by_cost(costs: Sequence[float], num_stages: int) -> tuple[int, ...]:
    """The contiguous split of ``costs`` into ``num_stages`` non-empty parts that minimizes
    the most expensive part (the pipeline runs at the pace of its slowest stage).

    Many splits often share that optimum (layers without parameters cost nothing), so a
    second pass picks, among them, the most even one: least sum of squared stage costs,
    then of squared layer counts. This keeps a stage from getting only free layers.
    """
    costs = [float(c) for c in costs]
    n = len(costs)
    check_stages(n, num_stages)
    if any(not c >= 0 for c in costs):  # also rejects NaN
        raise PartitionError(f"layer costs must be non-negative numbers, got {costs}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(j: int, i: int) -> float:
        return prefix[i] - prefix[j]

    worst, _ = _best_split(n, num_stages, cost, max)
    limit = worst * (1 + 1e-9) + 1e-12

    def evenness(j: int, i: int) -> tuple[float, int]:
        c = cost(j, i)
        return (c * c, (i - j) ** 2) if c <= limit else (math.inf, 0)

    _, balance = _best_split(n, num_stages, evenness,
                             lambda a, b: (a[0] + b[0], a[1] + b[1]))
    return balance


def param_costs(layers: Sequence[nn.Module]) -> list[float]:
    """Parameter count per layer (what a stage must hold in memory, with its optimizer)."""
    return [float(sum(p.numel() for p in layer.parameters())) for layer in layers]


def time_costs(layers: Sequence[nn.Module], sample: torch.Tensor, repeats: int = 3) -> list[float]:
    """Median forward + backward seconds of each layer on ``sample``, layer by layer (after
    torchgpipe's ``balance_by_time``). Gradients, buffers (BatchNorm statistics) and the
    random state are left as found, so the measurement does not change training."""
    if repeats < 1:
        raise ValueError(f"repeats must be ≥ 1, got {repeats}")
    params = [p for layer in layers for p in layer.parameters()]
    saved_grads = [p.grad for p in params]  # backward would add into these in place
    for p in params:
        p.grad = None
    buffers = [b for layer in layers for b in layer.buffers()]  # e.g. BatchNorm statistics
    saved_buffers = [b.clone() for b in buffers]
    samples: list[list[float]] = [[] for _ in layers]
    with torch.random.fork_rng(devices=[]):
        for run in range(repeats + 1):  # the first run warms up allocators and kernels
            x = sample
            for i, layer in enumerate(layers):
                x_in = x.detach().requires_grad_(x.is_floating_point())
                start = time.perf_counter()
                y = layer(x_in)
                if y.requires_grad:
                    y.backward(torch.ones_like(y))
                if run > 0:
                    samples[i].append(time.perf_counter() - start)
                x = y.detach()
    for p, grad in zip(params, saved_grads):
        p.grad = grad
    with torch.no_grad():
        for b, saved in zip(buffers, saved_buffers):
            b.copy_(saved)
    return [statistics.median(s) for s in samples]


def boundaries(balance: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, end)`` layer indices of each stage."""
    bounds, start = [], 0
    for size in balance:
        bounds.append((start, start + size))
        start += size
    return bounds


def check_no_shared_parameters(layers: Sequence[nn.Module], balance: Sequence[int]) -> None:
    """A parameter used by layers on two stages (tied weights) would be updated twice, apart."""
    owner: dict[int, int] = {}
    for stage, (start, end) in enumerate(boundaries(balance)):
        for index in range(start, end):
            for p in layers[index].parameters():
                other = owner.setdefault(id(p), stage)
                if other != stage:
                    raise PartitionError(
                        f"layer {index} on stage {stage} shares a parameter of shape "
                        f"{tuple(p.shape)} with a layer on stage {other}: tied weights cannot "
                        f"be split across stages; put both layers on one stage (explicit "
                        f"balance) or untie them")


def stage_module(layers: Sequence[nn.Module], balance: Sequence[int], stage: int) -> nn.Sequential:
    """Stage ``stage``'s layers as an ``nn.Sequential`` named by their index in the whole
    model, so its ``state_dict`` keys (``"3.weight"``) match the unsplit ``nn.Sequential``."""
    start, end = boundaries(balance)[stage]
    return nn.Sequential(OrderedDict((str(i), layers[i]) for i in range(start, end)))


def layer_names(model: Any, layers: Sequence[nn.Module]) -> list[str]:
    """Each layer's name in ``model`` (``"3"`` in an ``nn.Sequential``, ``"blocks.2"`` for a
    model whose ``layers()`` returns its submodules, or what its ``layer_names()`` says, for
    stage functions that are not the model's own modules: :mod:`.hf`): the prefix of its
    parameters' names in the whole model's ``state_dict``."""
    if isinstance(model, (nn.Sequential, nn.ModuleList)):
        return [str(i) for i in range(len(layers))]
    named = getattr(model, "layer_names", None)
    if callable(named):
        return [str(name) for name in named()]
    by_id = {id(module): name for name, module in model.named_modules() if name}
    return [by_id.get(id(layer), f"layer{i}") for i, layer in enumerate(layers)]


def balance_at(names: Sequence[str], starts: Sequence[str], num_stages: int
               ) -> tuple[int, ...]:
    """The balance that starts stages 1, 2, … at the layers named ``starts`` (split points
    by module name); a one-line error for a name that is no layer, or out of order."""
    if len(starts) != num_stages - 1:
        raise PartitionError(f"split points {list(starts)}: {num_stages} stages start at "
                             f"{num_stages - 1} layer name(s) (stage 0 at the first layer)")
    indices = []
    for name in starts:
        if name not in names:
            raise PartitionError(f"split point {name!r} is not one of the model's layers "
                                 f"({', '.join(names)})")
        indices.append(names.index(name))
    edges = [0, *indices, len(names)]
    balance = tuple(b - a for a, b in itertools.pairwise(edges))
    if any(b < 1 for b in balance):
        raise PartitionError(f"split points {list(starts)} must name layers in model order, "
                             f"after the first layer, each once")
    return balance


def choose_balance(layers: Sequence[nn.Module], num_stages: int,
                   partition: str | Sequence[int] | Sequence[str],
                   sample: torch.Tensor | None = None,
                   agree: Callable[[list[float]], list[float]] | None = None,
                   names: Sequence[str] | None = None) -> tuple[int, ...]:
    """The balance for ``partition``: ``"params"``, ``"time"`` (needs ``sample``), an
    explicit sequence of layer counts, or the layer names where stages 1, 2, … start
    (``names``: every layer's, :func:`layer_names`). Timings differ from rank to rank, so
    ranks that must agree on the split pass ``agree`` (e.g. an average over ranks)."""
    check_stages(len(layers), num_stages)
    if not isinstance(partition, str) and any(isinstance(p, str) for p in partition):
        return balance_at(names or [str(i) for i in range(len(layers))],
                          [str(p) for p in partition], num_stages)
    if isinstance(partition, str):
        if partition == "params":
            return balance_by_cost(param_costs(layers), num_stages)
        if partition == "time":
            if sample is None:
                raise PartitionError("partition='time' times each layer on a sample batch: "
                                     "pass sample=<an input batch>")
            costs = time_costs(layers, sample)
            return balance_by_cost(agree(costs) if agree else costs, num_stages)
        raise PartitionError(f"unknown partition {partition!r}; choose 'params', 'time', a "
                             f"list of layer counts per stage or the layer names where "
                             f"stages start")
    return check_balance([int(p) for p in partition], len(layers), num_stages)
