"""A rank's model state as the universal checkpoint sees it, and the save and load of it.

What a strategy describes (:class:`Layout`): the tensors its optimizer updates
(:class:`Unit`: a parameter, or ZeRO's flat master shard), each with the model
parameters it holds part of (:class:`Entry`: name, placement in the whole tensor, the
regions of the unit's memory they occupy), whether this rank is the one that writes them
(a replica, or a tp rank holding a replicated LayerNorm, does not), and the buffers. The
optimizer's state follows its unit: a moment shaped like the unit has the unit's regions;
a scalar (Adam's ``step``) is written once per parameter, by the rank holding its first
element::

    DDP rank 0        Unit(param w)          Entry(w, replicated, whole)
    tp rank 1         Unit(param w[:, 3:])   Entry(w, split cols, the right half)
    ZeRO rank 1 of 3  Unit(flat master)      Entry(w, …, w's tail), Entry(b, …, all of b)

Saving writes each written unit's regions (:class:`~.store.Writer`); loading fills each
unit's regions from whatever blocks were written (:class:`~.store.Reader`) and rebuilds
the optimizer's state for the unit, so a checkpoint written under any of these loads under
any other.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from disttrain.parallel.universal.slices import (
    Placement,
    Region,
    Split,
    holds_first,
    regions,
    replicated,
)
from disttrain.parallel.universal.store import (
    Index,
    Reader,
    Writer,
    read_index,
    to_json_value,
)


@dataclass(frozen=True)
class Entry:
    """Model parameter ``name`` (of global ``placement.shape``): this rank's part of it
    lies at ``regions`` of its unit's flat memory."""

    name: str
    placement: Placement
    regions: tuple[Region, ...]
    writes: bool = True  # this rank writes it (False: another rank holds the same part)


@dataclass
class Unit:
    """A tensor the optimizer updates and the parameters it holds (part of)."""

    tensor: torch.Tensor
    entries: list[Entry]


@dataclass
class Layout:
    """Everything of the model's state one rank holds, and which of it this rank writes."""

    units: list[Unit]
    optimizer: torch.optim.Optimizer | None
    buffers: list[tuple[str, torch.Tensor, bool]] = field(default_factory=list)
    model_config: dict[str, Any] | None = None  # a Hugging Face model's, for export


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """The 1-D view of a contiguous tensor's memory (writes through it reach the tensor)."""
    if not tensor.is_contiguous():
        raise ValueError(f"a checkpoint reads and writes contiguous tensors; got one of shape "
                         f"{tuple(tensor.shape)} with strides {tensor.stride()}")
    return tensor.detach().view(-1)


def param_unit(name: str, param: torch.Tensor, placement: Placement | None = None,
               writes: bool = True) -> Unit:
    """A parameter updated by its own optimizer entry (not ZeRO's flat shard)."""
    placement = placement or replicated(tuple(param.shape))
    if placement.local_shape != tuple(param.shape):
        raise ValueError(f"parameter {name} has shape {tuple(param.shape)}, its placement "
                         f"{placement.local_shape}")
    return Unit(param, [Entry(name, placement, tuple(regions(placement)), writes)])


def tensor_parallel_splits(module: nn.Module, rank: int, size: int) -> dict[int, Split]:
    """``id(parameter)`` → how it is split, for every parameter a tensor-parallel layer of
    ``module`` splits (its ``tp_split``: :mod:`disttrain.parallel.tensor.layers`); the
    others are held whole. By identity, so a pipeline stage's or ZeRO's own names for the
    same parameters find them too."""
    from disttrain.parallel.tensor.layers import parse_split

    found: dict[int, Split] = {}
    for sub in module.modules():
        how: dict[str, str] = getattr(sub, "tp_split", {})
        for name, param in sub.named_parameters(recurse=False):
            if name in how and size > 1:
                dim, parts = parse_split(how[name])
                found[id(param)] = Split(dim, parts, rank, size)
    return found


def module_layout(named: Iterable[tuple[str, torch.Tensor]],
                  optimizer: torch.optim.Optimizer | None, *,
                  buffers: Iterable[tuple[str, torch.Tensor]] = (),
                  splits: Mapping[int, Split] | None = None,
                  writes: Callable[[str, Split | None], bool] = lambda n, s: True,
                  model_config: dict[str, Any] | None = None) -> Layout:
    """The layout of a module whose optimizer updates its parameters directly (single, DDP,
    a pipeline stage, a tensor-parallel shard): ``named`` are its parameters under the
    whole model's names, ``splits`` the tensor-parallel ones by identity
    (:func:`tensor_parallel_splits`), ``writes(name, split)`` whether this rank writes one
    (``split`` None: held whole, as the buffers are)."""
    splits = splits or {}
    units, seen = [], set()
    for name, param in named:
        if id(param) in seen:  # a tied parameter: under its first name
            continue
        seen.add(id(param))
        how = splits.get(id(param))
        placement = how.placement(tuple(param.shape)) if how is not None else None
        units.append(param_unit(name, param, placement, writes(name, how)))
    held = [(n, b, writes(n, None)) for n, b in buffers]
    return Layout(units, optimizer, held, model_config)


def persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers a state dict holds (not the non-persistent ones)."""
    keys = set(module.state_dict())
    return [(n, b) for n, b in module.named_buffers() if n in keys]


def model_config(module: torch.nn.Module) -> dict[str, object] | None:
    """A Hugging Face model's config as JSON data (kept for export), else None."""
    config = getattr(module, "config", None)
    to_json = getattr(config, "to_json_string", None)
    if not callable(to_json):
        return None
    loaded = json.loads(to_json())
    return loaded if isinstance(loaded, dict) else None


# ------------------------------------------------------------------ saving
def save(directory: str, layout: Layout, rank: int) -> None:
    """Write this rank's share of ``layout`` into the universal checkpoint ``directory``
    (files named by ``rank``; nothing when the rank writes nothing)."""
    writer = Writer(directory, rank)
    optimizer = layout.optimizer
    groups = _group_of(optimizer)
    hyper = [{k: to_json_value(k, v) for k, v in g.items() if k != "params"}
             for g in (optimizer.param_groups if optimizer is not None else [])]
    for unit in layout.units:
        data, group = flat(unit.tensor), groups.get(id(unit.tensor))
        state = optimizer.state.get(unit.tensor, {}) if optimizer is not None else {}
        for entry in (e for e in unit.entries if e.writes):
            shape = entry.placement.shape
            writer.add(entry.name, "param", data, shape, entry.regions, group)
            for key, value in state.items():
                _save_state(writer, f"{entry.name}/{key}", value, unit, entry)
    for name, buffer in ((n, b) for n, b, w in layout.buffers if w):
        writer.add(name, "buffer", flat(buffer.contiguous()), tuple(buffer.shape),
                   regions(replicated(tuple(buffer.shape))))
    if writer.records:
        writer.header = {"optimizer": type(optimizer).__name__ if optimizer else None,
                         "param_groups": hyper, "model_config": layout.model_config}
    writer.close()


def _save_state(writer: Writer, name: str, value: Any, unit: Unit, entry: Entry) -> None:
    """One optimizer entry of ``entry``'s parameter: shaped like its unit (a moment; a 0-d
    parameter's too, but for its step), by the entry's regions; else a scalar every part
    of the parameter shares, written once, by the holder of its first element."""
    moment = isinstance(value, torch.Tensor) and value.shape == unit.tensor.shape and (
        value.dim() > 0 or not name.endswith("/step"))
    if moment:
        writer.add(name, "state", flat(value.contiguous()), entry.placement.shape,
                   entry.regions)
    elif (isinstance(value, torch.Tensor) and value.numel() == 1) or (
            isinstance(value, (int, float)) and not isinstance(value, bool)):
        if holds_first(entry.regions):
            writer.add_scalar(name, value)
    else:
        raise ValueError(f"optimizer state {name} ({type(value).__name__}) is neither shaped "
                         f"like its parameter nor a scalar: this optimizer cannot be saved")


def _group_of(optimizer: torch.optim.Optimizer | None) -> dict[int, int]:
    if optimizer is None:
        return {}
    return {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}


# ------------------------------------------------------------------ loading
def load(directory: str, layout: Layout, *, load_optimizer: bool = True) -> Reader:
    """Fill ``layout``'s units, buffers and optimizer state from the universal checkpoint
    in ``directory``, written under any strategy and world size. Returns the reader (its
    index, and which ranks' files it opened)."""
    index = read_index(directory)
    optimizer = layout.optimizer if load_optimizer else None
    if optimizer is not None and index.optimizer not in (None, type(optimizer).__name__):
        raise ValueError(f"checkpoint {directory} holds {index.optimizer} state, this run uses "
                         f"{type(optimizer).__name__}; use the same optimizer, or "
                         f"load_optimizer=False for the weights alone")
    reader = Reader(index)
    state: dict[int, dict[str, Any]] = {}
    for unit in layout.units:
        data = flat(unit.tensor)
        check_shapes(index, ((e.name, e.placement.shape) for e in unit.entries))
        for entry in unit.entries:
            reader.fill(entry.name, data, entry.regions)
        if optimizer is not None:
            state[id(unit.tensor)] = _unit_state(reader, unit)
    for name, buffer, _ in layout.buffers:
        if name in index.tensors:
            buffer.copy_(reader.full(name))
    if optimizer is not None:
        _load_optimizer(optimizer, index, layout, state)
    return reader


def check_shapes(index: Index, shapes: Iterable[tuple[str, tuple[int, ...]]]) -> None:
    """Refuse, naming it, the first parameter whose global shape differs from the
    checkpoint's (or that it lacks): another model."""
    for name, shape in shapes:
        saved = index.get(name).shape
        if saved != tuple(shape):
            raise ValueError(f"parameter {name} has shape {tuple(shape)} here but {saved} in "
                             f"the checkpoint {index.directory}; is it the same model?")


def _unit_state(reader: Reader, unit: Unit) -> dict[str, Any]:
    """The optimizer state of one unit: moments filled region by region (ZeRO's padding
    stays 0), scalars from its parameters, which must agree."""
    index = reader.index
    keys: dict[str, str] = {}
    for entry in unit.entries:
        prefix = f"{entry.name}/"
        for name, info in index.tensors.items():
            if name.startswith(prefix) and info.kind in ("state", "scalar", "number"):
                keys.setdefault(name.removeprefix(prefix), info.kind)
    state: dict[str, Any] = {}
    for key, kind in keys.items():
        if kind == "state":
            moment = torch.zeros_like(unit.tensor)
            for entry in unit.entries:
                reader.fill(f"{entry.name}/{key}", flat(moment), entry.regions)
            state[key] = moment
            continue
        values = [reader.scalar(f"{entry.name}/{key}") for entry in unit.entries]
        if any(_differ(values[0], v) for v in values[1:]):
            raise ValueError(f"optimizer state {key!r} differs between the parameters of one "
                             f"flat group ({unit.entries[0].name}: {values[0]}); they cannot "
                             f"share one optimizer entry")
        state[key] = values[0]
    return state


def _differ(a: torch.Tensor | float, b: torch.Tensor | float) -> bool:
    return bool(torch.as_tensor(a).ne(torch.as_tensor(b)).any())


def _load_optimizer(optimizer: torch.optim.Optimizer, index: Index, layout: Layout,
                    state: dict[int, dict[str, Any]]) -> None:
    """The optimizer's state by its own parameter order; each group takes the saved
    hyper-parameters of its first parameter's group (a learning-rate schedule sets the
    rate of the next step itself)."""
    first: dict[int, str] = {id(u.tensor): u.entries[0].name for u in layout.units if u.entries}
    current = optimizer.state_dict()
    groups, by_index = [], {}
    i = 0
    for group, saved_group in zip(optimizer.param_groups, current["param_groups"]):
        hyper: dict[str, Any] = {}
        for param in group["params"]:
            by_index[i] = state.get(id(param), {})
            i += 1
            if not hyper and id(param) in first:
                hyper = index.get(first[id(param)]).group or {}
        restored = {k: (tuple(v) if isinstance(v, list) else v) for k, v in hyper.items()
                    if k in saved_group}
        groups.append({**saved_group, **restored})
    optimizer.load_state_dict({"state": {k: v for k, v in by_index.items() if v},
                               "param_groups": groups})
