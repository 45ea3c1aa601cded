"""Sharded checkpoints that resume on any world size (and any stage), never gathered on a rank.

Each rank writes only its own shard (master parameters and shard-shaped optimizer state),
and rank 0 writes the layout (the format is below). To
resume on M ranks, each new rank computes with :func:`~disttrain.parallel.zero.sharding.
read_plan` which slices of which old shard files cover its new shard, and copies just those
from memory-mapped files::

    saved on 4:   | r0 | r1 | r2 | r3 |       the same flat vector, cut twice
    loaded on 3:  |  r0   |  r1  |  r2   |    new r1 reads the end of old r1 and old r2

No rank ever holds more than its own shard (the DeepSpeed and torch complaints this answers:
checkpoints tied to the GPU count, DeepSpeed#2898; consolidating optimizer state on one rank
running out of memory, pytorch#68181). Groups are matched by parameter *name*, so a
checkpoint from stage 1 loads into stage 3 and vice versa. A hybrid run (:mod:`.hybrid`)
saves once, from its first replica (the others hold the same shards): a checkpoint of
shard groups of S ranks is the checkpoint of plain ZeRO on S, and loads on any layout.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from disttrain.parallel.checkpoint_files import (
    MANIFEST,
    CheckpointError,
    atomic_save,
    atomic_write_text,
    seal,
    verify,
)
from disttrain.parallel.checkpoint_files import load as safe_load
from disttrain.parallel.zero.sharding import (
    ShardGroup,
    ShardLayout,
    ZeroWrapper,
    read_plan,
    shard_layout,
)

log = logging.getLogger(__name__)


def save(zero: ZeroWrapper, directory: str | Path) -> None:
    """Write this rank's shard; rank 0 also writes buffers and the layout. Every rank of
    ``zero.comm`` (and of ``zero.replicate``) must call it; it returns once the checkpoint
    is complete. Of a hybrid run's replicas only the first writes."""
    replicate = zero.replicate
    if replicate is None:
        _save(zero, Path(directory))
        return
    failure: Exception | None = None
    if replicate.rank == 0:
        try:
            _save(zero, Path(directory))
        except Exception as exc:  # the other replicas must hear of it, not wait forever
            failure = exc
    failed = torch.tensor([0.0 if failure is None else 1.0])
    replicate.all_reduce(failed, "max")  # the others return once the first one's is sealed
    if failure is not None:
        raise failure
    if failed.item():
        raise CheckpointError(f"the first replica could not save {directory} (its rank "
                              f"reports why)", "see the error of replicate rank 0")


def _save(zero: ZeroWrapper, directory: Path) -> None:
    comm, optimizer = zero.comm, zero.optimizer
    if comm.rank == 0:  # an older checkpoint here stops being one until this save completes
        directory.mkdir(parents=True, exist_ok=True)
        (directory / MANIFEST).unlink(missing_ok=True)
        (directory / METADATA).unlink(missing_ok=True)
    comm.barrier()
    groups: list[ShardGroup] = zero.shard_groups()
    tensors: dict[str, torch.Tensor] = {}
    saved: list[SavedGroup] = []
    state_keys: set[str] = set()
    for g, group in enumerate(groups):
        tensors[f"{g}.master"] = group.master
        sharded, scalars = _split_state(optimizer.state.get(group.master, {}), group.master)
        for key, value in sharded.items():
            tensors[f"{g}.state.{key}"] = value
        state_keys.update(sharded)
        saved.append(SavedGroup(group.names, group.shapes, group.layout.shard_size, scalars))
    buffers = dict(zero.module.named_buffers())
    if comm.rank == 0:
        tensors.update({f"buffer.{name}": b for name, b in buffers.items()})
    write_shard(directory, comm.rank, tensors)
    comm.barrier()
    if comm.rank == 0:
        hyper = tuple({k: to_json_value(k, v) for k, v in pg.items() if k != "params"}
                      for pg in optimizer.param_groups)
        write_metadata(directory, Metadata(comm.world_size, zero.stage, type(optimizer).__name__,
                                           tuple(saved), tuple(sorted(state_keys)), hyper,
                                           tuple(buffers)))
    seal(str(directory), comm.rank, comm.world_size, comm.barrier)  # starts with a barrier
    log.info("saved ZeRO-%d shard %d/%d to %s", zero.stage, comm.rank, comm.world_size, directory)


def _split_state(state: dict[str, Any], master: torch.Tensor
                 ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[float, str]]]:
    """Optimizer state of one master: shard-shaped tensors vs replicated scalars (step)."""
    sharded, scalars = {}, {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.shape == master.shape:
            sharded[key] = value
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            scalars[key] = (float(value.item()), str(value.dtype).removeprefix("torch."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            scalars[key] = (float(value), "python")
        else:
            raise ValueError(f"optimizer state {key!r} ({type(value).__name__}) is neither "
                             f"shard-shaped nor a scalar; this optimizer cannot be sharded")
    return sharded, scalars


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
        state[index[id(group.master)]] = {**fresh, **_scalars(meta, where)}
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


# ----------------------------------------------------------------------
# The on-disk form of a sharded ZeRO checkpoint: one tensor file per rank, one JSON layout.
#
# ::
#
#     checkpoint/
#       zero.json        layout: world size, per flat group the parameter names, shapes and
#                        shard size; optimizer class, hyper-parameters, replicated scalars
#       rank00000.pt     rank 0's shard of every group: "<g>.master", "<g>.state.exp_avg", …
#       rank00001.pt     (+ the model's buffers, in rank 0's file only: "buffer.<name>")
#       …
#
# Shard files hold tensors only and are read with ``torch.load(weights_only=True,
# mmap=True)``: nothing but tensors is unpickled, and slicing a memory-mapped tensor reads
# just the pages a new rank needs. ``zero.json`` is written after every rank's file is complete,
# then ``manifest.json`` (sizes and SHA-256 of every file,
# :mod:`disttrain.parallel.checkpoint_files`): a directory without both is not a checkpoint.

FORMAT = "disttrain.zero.checkpoint/1"
METADATA = "zero.json"


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

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "world_size": self.world_size, "stage": self.stage,
            "optimizer": self.optimizer, "state_keys": list(self.state_keys),
            "param_groups": list(self.param_groups), "buffers": list(self.buffers),
            "groups": [{"names": list(g.names), "shapes": [list(s) for s in g.shapes],
                        "shard_size": g.shard_size,
                        "scalars": {k: list(v) for k, v in g.scalars.items()}}
                       for g in self.groups],
        }


def write_metadata(directory: str | Path, meta: Metadata) -> None:
    atomic_write_text(str(Path(directory) / METADATA), json.dumps(meta.to_json(), indent=1))


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


def write_shard(directory: str | Path, rank: int, tensors: dict[str, torch.Tensor]) -> None:
    """Save tensors (views are copied, so a shard never drags its whole base buffer along)."""
    compact = {k: (t.detach().clone() if _is_partial_view(t) else t.detach())
               for k, t in tensors.items()}
    atomic_save(compact, str(shard_file(directory, rank)))


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


def to_json_value(name: str, value: Any) -> Any:
    """A hyper-parameter as JSON (tensors → numbers, tuples → lists)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (tuple, list)):
        return [to_json_value(name, v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"optimizer hyper-parameter {name}={value!r} cannot be saved in the "
                     f"checkpoint's JSON; use numbers, strings or tuples of them")


def _is_partial_view(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() != t.numel() * t.element_size()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
