"""ZeRO checkpoints in the format before the universal one: read, never written.

A directory with ``zero.json`` (format ``disttrain.zero.checkpoint/1``) holds one tensor
file per rank of the saving run and a JSON layout::

    checkpoint/
      zero.json        world size, per flat group the parameter names, shapes and shard
                       size; optimizer class, hyper-parameters, replicated scalars
      rank00000.pt     rank 0's shard of every group: "<g>.master", "<g>.state.exp_avg", …
      rank00001.pt     (+ the model's buffers, in rank 0's file only: "buffer.<name>")

:func:`load` fills a wrapper on any world size and stage from it (each new rank reads, by
:func:`~disttrain.parallel.zero.sharding.read_plan`, just the slices of the old shards that
cover its own), and :func:`consolidate` rebuilds full tensors offline, so checkpoints
written before the universal format keep resuming.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from disttrain.parallel.checkpoint_files import CheckpointError, verify
from disttrain.parallel.checkpoint_files import load as safe_load
from disttrain.parallel.zero.sharding import ShardLayout, ZeroWrapper, read_plan, shard_layout

log = logging.getLogger(__name__)
FORMAT = "disttrain.zero.checkpoint/1"
METADATA = "zero.json"


def is_legacy(directory: str | Path) -> bool:
    """Whether ``directory`` holds a checkpoint in this format."""
    return (Path(directory) / METADATA).exists()


def load(zero: ZeroWrapper, directory: str | Path, *, load_optimizer: bool = True) -> ShardReader:
    """Fill ``zero``'s shards (and its optimizer state) from a checkpoint saved on any
    number of ranks; returns the reader (which old files were opened). The files are checked
    against the checkpoint's manifest first (this rank hashes its share of them)."""
    verify(str(directory), zero.comm.rank, zero.comm.world_size)
    meta = read_metadata(directory)
    if load_optimizer and meta.optimizer != type(zero.optimizer).__name__:
        raise ValueError(f"checkpoint optimizer state is for {meta.optimizer}, this run uses "
                         f"{type(zero.optimizer).__name__}; use the same optimizer or pass "
                         f"load_optimizer=False")
    sources = [g.layout(meta.world_size) for g in meta.groups]
    located = meta.locate()
    reader = ShardReader(directory)
    state: dict[int, dict[str, Any]] = {}
    index = {id(p): i for i, p in enumerate(_optimizer_params(zero.optimizer))}
    for group in zero.shard_groups():
        where = [_where(located, meta, name, shape)
                 for name, shape in zip(group.names, group.shapes)]
        plan = read_plan(sources, where, group.layout, zero.comm.rank)
        with torch.no_grad():
            _fill(group.master, plan, reader, "master")
        fresh = {key: _fill(torch.zeros_like(group.master), plan, reader, f"state.{key}")
                 for key in meta.state_keys}
        whole = {**fresh, **_scalars(meta, where)}
        for tensor, part in _per_slice(group.master, getattr(group, "slices", ()), whole):
            state[index[id(tensor)]] = part
    if load_optimizer:
        _load_optimizer(zero.optimizer, meta, state)
    _load_buffers(zero.module, meta, reader)
    zero.reload_from_masters()
    log.info("rank %d loaded ZeRO shards from old ranks %s of %d", zero.comm.rank,
             reader.opened, meta.world_size)
    return reader


def _where(located: dict[str, tuple[int, int]], meta: Metadata, name: str,
           shape: tuple[int, ...]) -> tuple[int, int]:
    if name not in located:
        raise ValueError(f"parameter {name} is not in the checkpoint (it has "
                         f"{len(located)} parameters, e.g. {sorted(located)[:3]}); is it the "
                         f"same model?")
    g, i = located[name]
    saved = meta.groups[g].shapes[i]
    if tuple(saved) != tuple(shape):
        raise ValueError(f"parameter {name} has shape {tuple(shape)} here but "
                         f"{tuple(saved)} in the checkpoint")
    return g, i


def _fill(target: torch.Tensor, plan: list[Any], reader: ShardReader, key: str) -> torch.Tensor:
    """Zero ``target`` (padding stays 0) and copy every planned slice into it."""
    target.zero_()
    for read in plan:
        src = reader.tensor(read.src_rank, f"{read.src_group}.{key}")
        target[read.dst_offset:read.dst_offset + read.length].copy_(
            src[read.src_offset:read.src_offset + read.length])
    return target


def _scalars(meta: Metadata, where: list[tuple[int, int]]) -> dict[str, torch.Tensor | float]:
    """Replicated optimizer scalars (e.g. Adam's step) of the source groups involved; they
    must agree when a new group draws on several old ones."""
    values: dict[str, tuple[float, str]] = {}
    for g in sorted({g for g, _ in where}):
        for key, value in meta.groups[g].scalars.items():
            if key in values and values[key][0] != value[0]:
                raise ValueError(f"optimizer state {key!r} differs between merged parameter "
                                 f"groups ({values[key][0]} vs {value[0]}); cannot merge them")
            values[key] = value
    return {k: (v if dtype == "python" else torch.tensor(v, dtype=getattr(torch, dtype)))
            for k, (v, dtype) in values.items()}


def _per_slice(master: torch.Tensor, slices: Any, state: dict[str, Any]
               ) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    """A master shard's state cut for the slices its optimizer updates under parameter
    groups (shard-shaped tensors cut, scalars shared); the master's own without them."""
    if not slices:
        return [(master, state)]
    return [(s.tensor, {k: (v[s.start:s.start + s.tensor.numel()].clone()
                            if isinstance(v, torch.Tensor) and v.shape == master.shape else v)
                        for k, v in state.items()}) for s in slices]


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _load_optimizer(optimizer: torch.optim.Optimizer, meta: Metadata,
                    state: dict[int, dict[str, Any]]) -> None:
    current = optimizer.state_dict()["param_groups"]
    groups = []
    for i, pg in enumerate(current):
        saved = meta.param_groups[i] if len(meta.param_groups) == len(current) else {}
        restored = {k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items()}
        groups.append({**pg, **restored, "params": pg["params"]})
    optimizer.load_state_dict({"state": {i: s for i, s in state.items() if s},
                               "param_groups": groups})


def _load_buffers(module: torch.nn.Module, meta: Metadata, reader: ShardReader) -> None:
    buffers = dict(module.named_buffers())
    with torch.no_grad():
        for name in meta.buffers:
            if name in buffers:
                buffers[name].copy_(reader.tensor(0, f"buffer.{name}"))


def consolidate(directory: str | Path) -> tuple[dict[str, torch.Tensor],
                                                dict[str, dict[str, torch.Tensor]]]:
    """Offline: every parameter and its optimizer state (scalars such as ``step`` included)
    as full tensors, by name, for export or inspection. It needs the whole model's memory,
    so it is a tool for after training, never a step inside it."""
    verify(str(directory))
    meta = read_metadata(directory)
    reader = ShardReader(directory)
    params: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for g, group in enumerate(meta.groups):
        layout = group.layout(meta.world_size)
        for key in ("master", *(f"state.{k}" for k in meta.state_keys)):
            dtype = reader.tensor(0, f"{g}.{key}").dtype
            full = [torch.empty(n, dtype=dtype) for n in layout.numels]
            for rank, pieces in enumerate(layout.pieces):
                for pc in pieces:
                    src = reader.tensor(rank, f"{g}.{key}")
                    full[pc.param][pc.param_offset:pc.param_offset + pc.length].copy_(
                        src[pc.shard_offset:pc.shard_offset + pc.length])
            for name, shape, tensor in zip(group.names, group.shapes, full):
                if key == "master":
                    params[name] = tensor.view(shape)
                else:
                    state.setdefault(name, {})[key.removeprefix("state.")] = tensor.view(shape)
        for name in group.names:
            for key, value in _scalars(meta, [(g, 0)]).items():
                state.setdefault(name, {})[key] = torch.as_tensor(value)
    return params, state



def shard_file(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank:05d}.pt"


@dataclass(frozen=True)
class SavedGroup:
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    shard_size: int
    scalars: dict[str, tuple[float, str]]  # replicated optimizer state: value, dtype

    def layout(self, world_size: int) -> ShardLayout:
        numels = [_numel(s) for s in self.shapes]
        layout = shard_layout(numels, world_size)
        if layout.shard_size != self.shard_size:
            raise ValueError(f"checkpoint group with {sum(numels)} elements on {world_size} "
                             f"ranks should have shards of {layout.shard_size}, metadata says "
                             f"{self.shard_size}: the checkpoint is corrupt")
        return layout


@dataclass(frozen=True)
class Metadata:
    world_size: int
    stage: int
    optimizer: str
    groups: tuple[SavedGroup, ...]
    state_keys: tuple[str, ...]  # shard-shaped optimizer state tensors
    param_groups: tuple[dict[str, Any], ...]  # hyper-parameters, without "params"
    buffers: tuple[str, ...]

    def locate(self) -> dict[str, tuple[int, int]]:
        """Parameter name → (group, index in the group)."""
        return {name: (g, i) for g, group in enumerate(self.groups)
                for i, name in enumerate(group.names)}


def read_metadata(directory: str | Path) -> Metadata:
    path = Path(directory) / METADATA
    if not path.exists():
        raise ValueError(f"{directory} is not a complete ZeRO checkpoint: {METADATA} is "
                         f"missing (it is written last, after every rank's shard)")
    try:
        raw = json.loads(path.read_bytes().decode())
        if raw.get("format") != FORMAT:
            raise CheckpointError(f"{path} has format {raw.get('format')!r}; this disttrain "
                                  f"reads {FORMAT!r}")
        groups = tuple(
            SavedGroup(tuple(g["names"]), tuple(tuple(s) for s in g["shapes"]), g["shard_size"],
                       {k: (float(v[0]), str(v[1])) for k, v in g["scalars"].items()})
            for g in raw["groups"])
        return Metadata(raw["world_size"], raw["stage"], raw["optimizer"], groups,
                        tuple(raw["state_keys"]), tuple(raw["param_groups"]),
                        tuple(raw["buffers"]))
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{path} is damaged ({type(exc).__name__})") from None


class ShardReader:
    """Opens old ranks' shard files on first use, memory-mapped (only touched pages load)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._open: dict[int, dict[str, torch.Tensor]] = {}

    def tensor(self, rank: int, key: str) -> torch.Tensor:
        if rank not in self._open:
            path = shard_file(self.directory, rank)
            if not path.exists():
                raise ValueError(f"checkpoint shard {path} is missing")
            self._open[rank] = safe_load(str(path), mmap=True)
        tensors = self._open[rank]
        if key not in tensors:
            raise ValueError(f"{shard_file(self.directory, rank)} has no tensor {key!r}")
        return tensors[key]

    @property
    def opened(self) -> list[int]:
        """Old ranks whose files this reader opened (a resharding test checks the few)."""
        return sorted(self._open)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
