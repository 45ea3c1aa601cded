"""The on-disk form of a sharded ZeRO checkpoint: one tensor file per rank, one JSON layout.

::

    checkpoint/
      zero.json        layout: world size, per flat group the parameter names, shapes and
                       shard size; optimizer class, hyper-parameters, replicated scalars
      rank00000.pt     rank 0's shard of every group: "<g>.master", "<g>.state.exp_avg", …
      rank00001.pt     (+ the model's buffers, in rank 0's file only: "buffer.<name>")
      …

Shard files hold tensors only and are read with ``torch.load(weights_only=True,
mmap=True)``: nothing but tensors is unpickled, and slicing a memory-mapped tensor reads
just the pages a new rank needs. ``zero.json`` is written after every rank's file is complete,
then ``manifest.json`` (sizes and SHA-256 of every file,
:mod:`disttrain.parallel.checkpoint_files`): a directory without both is not a checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from disttrain.parallel.checkpoint_files import (
    CheckpointError,
    atomic_save,
    atomic_write_text,
    load,
)
from disttrain.parallel.zero.sharding import ShardLayout, shard_layout

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
            self._open[rank] = load(str(path), mmap=True)
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
