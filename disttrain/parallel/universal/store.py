"""The universal checkpoint on disk: each rank's slices in one tensor file, described in JSON.

::

    universal/
      rank-00000.json   what rank 0 wrote: per tensor name its kind, global shape, dtype and
                        the blocks (offsets, sizes) it holds; the optimizer's class and
                        hyper-parameters per group; the model's config, when it has one
      rank-00000.pt     those blocks, by "<name>|<offsets>": tensors only
      rank-00003.json   … only ranks that hold something nobody else writes have files
      rank-00003.pt

Tensor names are the model's own (``blocks.0.attention.qkv.weight``) under a kind:
``param`` and ``buffer`` (the model's state dict), ``state`` (an optimizer tensor shaped
like its parameter: ``<param>/exp_avg``), ``scalar`` (an optimizer tensor every part of a
parameter shares: ``<param>/step``) and ``number`` (a Python number the optimizer keeps).
A reader merges every rank's JSON into one :class:`Index` and copies, for each block it
needs, the overlap of every block written (:meth:`Reader.fill`): that is the whole of
resharding, whatever cut the writer and the reader made. Tensor files are read with
``torch.load(weights_only=True, mmap=True)``: only the pages a rank's blocks touch load.
The directory is sealed with a SHA-256 manifest by whoever owns it (the loop's checkpoint,
or :func:`disttrain.parallel.zero.save`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from disttrain.parallel.checkpoint_files import (
    MANIFEST,
    CheckpointError,
    atomic_save,
    atomic_write_text,
    verify,
)
from disttrain.parallel.checkpoint_files import load as safe_load
from disttrain.parallel.universal.slices import Box, Region, Shape, row_major_strides

FORMAT = "disttrain.universal/1"
DIRECTORY = "universal"  # inside a loop checkpoint's step directory
KINDS = ("param", "buffer", "state", "scalar", "number")
_RANK_FILE = re.compile(r"rank-(\d{5})\.json")


def is_universal(directory: str) -> bool:
    """Whether ``directory`` holds a universal checkpoint."""
    return os.path.isdir(directory) and any(
        _RANK_FILE.fullmatch(n) for n in os.listdir(directory))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_json_value(name: str, value: Any) -> Any:
    """An optimizer hyper-parameter as JSON (one-element tensors → numbers, tuples →
    lists); a one-line error for anything else."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (tuple, list)):
        return [to_json_value(name, v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"optimizer hyper-parameter {name}={value!r} cannot be saved in the "
                     f"checkpoint's JSON; use numbers, strings or tuples of them")


class Writer:
    """This rank's share of a universal checkpoint: blocks added one by one, written by
    :meth:`close` (nothing at all when the rank adds nothing)."""

    def __init__(self, directory: str, rank: int) -> None:
        self.directory, self.rank = directory, rank
        self.tensors: dict[str, torch.Tensor] = {}
        self.records: dict[str, dict[str, Any]] = {}
        self.header: dict[str, Any] = {}

    def add(self, name: str, kind: str, flat: torch.Tensor, shape: Shape,
            found: Iterable[Region], group: int | None = None) -> None:
        """Blocks ``found`` of tensor ``name`` (global ``shape``), read from ``flat``."""
        record = self._record(name, kind, shape, flat.dtype, group)
        for region in found:
            key = f"{name}|{','.join(map(str, region.box.offsets))}"
            # a copy on the host: files hold CPU tensors whatever device trained them
            self.tensors[key] = region.view(flat).detach().to("cpu", copy=True).contiguous()
            record["chunks"].append([list(region.box.offsets), list(region.box.sizes)])

    def add_chunk(self, name: str, kind: str, shape: Shape, box: Box, tensor: torch.Tensor
                  ) -> None:
        """Block ``box`` of tensor ``name`` (global ``shape``) as it is (an importer's)."""
        if tuple(tensor.shape) != box.sizes:
            raise ValueError(f"block {box} of {name} has shape {tuple(tensor.shape)}")
        record = self._record(name, kind, shape, tensor.dtype, None)
        self.tensors[f"{name}|{','.join(map(str, box.offsets))}"] = (
            tensor.detach().to("cpu").contiguous())
        record["chunks"].append([list(box.offsets), list(box.sizes)])

    def add_group(self, name: str, hyper: dict[str, Any]) -> None:
        """The optimizer hyper-parameters of parameter ``name``'s group (an importer's)."""
        groups = self.header.setdefault("param_groups", [])
        if hyper not in groups:
            groups.append(hyper)
        self.records[name]["group"] = groups.index(hyper)

    def add_scalar(self, name: str, value: torch.Tensor | float) -> None:
        """An optimizer scalar (``step``) or Python number, whole: kept in the JSON (a
        float64 holds every float32 or bfloat16 value exactly), so a reader needs no
        tensor file for it."""
        if isinstance(value, torch.Tensor):
            record = self._record(name, "scalar", (), value.dtype, None)
        else:
            record = self._record(name, "number", (), torch.float64, None)
        record["value"] = float(value.item() if isinstance(value, torch.Tensor) else value)

    def _record(self, name: str, kind: str, shape: Shape, dtype: torch.dtype,
                group: int | None) -> dict[str, Any]:
        record = self.records.setdefault(name, {"kind": kind, "shape": list(shape),
                                                "dtype": dtype_name(dtype), "chunks": []})
        if group is not None:
            record["group"] = group
        return record

    def close(self) -> None:
        if not self.records:
            return
        os.makedirs(self.directory, exist_ok=True)
        atomic_save(self.tensors, os.path.join(self.directory, f"rank-{self.rank:05d}.pt"))
        body = {"format": FORMAT, **self.header, "tensors": self.records}
        atomic_write_text(os.path.join(self.directory, f"rank-{self.rank:05d}.json"),
                          json.dumps(body))


@dataclass
class TensorInfo:
    """One tensor of the checkpoint: kind, global shape, dtype and every block written."""

    name: str
    kind: str
    shape: Shape
    dtype: str
    chunks: list[tuple[int, str, Box]] = field(default_factory=list)  # (rank, key, block)
    group: dict[str, Any] | None = None  # the optimizer hyper-parameters of its group
    value: float | None = None  # a scalar's


@dataclass
class Index:
    """Every rank's JSON merged: the tensors by name, the optimizer and the model config."""

    directory: str
    tensors: dict[str, TensorInfo]
    optimizer: str | None
    model_config: dict[str, Any] | None
    writers: list[int]

    def names(self, kind: str) -> list[str]:
        return [n for n, t in self.tensors.items() if t.kind == kind]

    def get(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            params = self.names("param")
            raise ValueError(f"parameter {name.partition('/')[0]} is not in the checkpoint "
                             f"{self.directory} (it has {len(params)} parameters, e.g. "
                             f"{params[:3]}); is it the same model?") from None


def verified_index(directory: str) -> Index:
    """The index of ``directory`` (a universal checkpoint, or a loop checkpoint holding
    one), after checking every file against the manifest that seals it: its own, or the
    loop checkpoint's around it."""
    if os.path.isdir(os.path.join(directory, DIRECTORY)):
        directory = os.path.join(directory, DIRECTORY)
    parent = os.path.dirname(os.path.abspath(directory))
    sealed = os.path.exists(os.path.join(directory, MANIFEST)) or not os.path.exists(
        os.path.join(parent, MANIFEST))
    verify(directory if sealed else parent)
    return read_index(directory)


def read_index(directory: str) -> Index:
    """Merge the ranks' JSON files of ``directory``; CheckpointError for a damaged one."""
    files = sorted(n for n in os.listdir(directory) if _RANK_FILE.fullmatch(n)) if (
        os.path.isdir(directory)) else []
    if not files:
        raise CheckpointError(f"{directory} is not a universal checkpoint (no rank-*.json)")
    tensors: dict[str, TensorInfo] = {}
    optimizer, config, writers = None, None, []
    for file in files:
        path = os.path.join(directory, file)
        rank = int(_RANK_FILE.fullmatch(file).group(1))  # type: ignore[union-attr]
        try:
            with open(path, "rb") as f:
                body = json.loads(f.read().decode())
            if body.get("format") != FORMAT:
                raise CheckpointError(f"{path} has format {body.get('format')!r}; this "
                                      f"disttrain reads {FORMAT!r}")
            optimizer = body.get("optimizer") or optimizer
            config = body.get("model_config") or config
            for name, record in body["tensors"].items():
                _merge(tensors, name, record, rank, body.get("param_groups", []))
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"{path} is damaged ({type(exc).__name__}: {exc})") from None
        writers.append(rank)
    return Index(directory, tensors, optimizer, config, writers)


def _merge(tensors: dict[str, TensorInfo], name: str, record: dict[str, Any], rank: int,
           groups: list[dict[str, Any]]) -> None:
    shape, kind = tuple(int(s) for s in record["shape"]), str(record["kind"])
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r} of {name}")
    info = tensors.setdefault(name, TensorInfo(name, kind, shape, str(record["dtype"])))
    if (info.kind, info.shape) != (kind, shape):
        raise ValueError(f"{name} is a {kind} of {shape} here, a {info.kind} of {info.shape} "
                         f"in another rank's file")
    if "group" in record:
        info.group = groups[int(record["group"])]
    if kind in ("scalar", "number"):
        info.value = float(record["value"])
        return
    for offsets, sizes in record["chunks"]:
        box = Box(tuple(int(o) for o in offsets), tuple(int(s) for s in sizes))
        if len(box.offsets) != len(shape) or any(
                o < 0 or s < 0 or o + s > d for o, s, d in zip(box.offsets, box.sizes, shape)):
            raise ValueError(f"block {box} of {name} lies outside its shape {shape}")
        info.chunks.append((rank, f"{name}|{','.join(map(str, box.offsets))}", box))


class Reader:
    """Copies blocks out of a universal checkpoint, opening each rank's file on first use."""

    def __init__(self, index: Index) -> None:
        self.index = index
        self._open: dict[int, dict[str, torch.Tensor]] = {}

    @property
    def opened(self) -> list[int]:
        """The ranks whose files this reader opened (a resharding test checks the few)."""
        return sorted(self._open)

    def chunk(self, rank: int, key: str) -> torch.Tensor:
        if rank not in self._open:
            path = os.path.join(self.index.directory, f"rank-{rank:05d}.pt")
            loaded = safe_load(path, mmap=True)
            if not isinstance(loaded, dict):
                raise CheckpointError(f"checkpoint file {path} holds no tensors by name")
            self._open[rank] = loaded
        tensors = self._open[rank]
        if key not in tensors or not isinstance(tensors[key], torch.Tensor):
            raise CheckpointError(f"checkpoint file {self.index.directory}/rank-{rank:05d}.pt "
                                  f"has no tensor {key!r}")
        return tensors[key]

    def fill(self, name: str, flat: torch.Tensor, found: Iterable[Region]) -> None:
        """Copy tensor ``name``'s blocks ``found`` into ``flat`` (their storage), from
        whichever blocks were written; every element must be covered exactly once."""
        info = self.index.get(name)
        for region in found:
            target, covered = region.view(flat), 0
            for rank, key, box in info.chunks:
                common = region.box.intersect(box)
                if common is None:
                    continue
                source = self.chunk(rank, key)
                if tuple(source.shape) != box.sizes:
                    raise CheckpointError(f"{self.index.directory}/rank-{rank:05d}.pt: {key} "
                                          f"has shape {tuple(source.shape)}, its record says "
                                          f"{box.sizes}")
                with torch.no_grad():
                    target[common.within(region.box)].copy_(source[common.within(box)])
                covered += common.numel
            if covered != region.box.numel:
                raise CheckpointError(f"checkpoint {self.index.directory} holds "
                                      f"{covered} of the {region.box.numel} elements of "
                                      f"{name} at {region.box.offsets}+{region.box.sizes}"
                                      f"{' (written twice)' if covered > region.box.numel else ''}"
                                      f"; a rank's file is missing or it is not one save")

    def scalar(self, name: str) -> torch.Tensor | float:
        """An optimizer scalar (a 0-d tensor of its dtype) or Python number (a float)."""
        info = self.index.get(name)
        if info.value is None:
            raise CheckpointError(f"checkpoint {self.index.directory}: {name} is a "
                                  f"{info.kind}, not a scalar")
        if info.kind == "number":
            return info.value
        return torch.tensor(info.value, dtype=getattr(torch, info.dtype))

    def full(self, name: str) -> torch.Tensor:
        """Tensor ``name`` whole, assembled from its blocks (offline tools: it needs the
        tensor's memory on this process)."""
        info = self.index.get(name)
        tensor = torch.empty(info.shape, dtype=getattr(torch, info.dtype))
        flat = tensor.view(-1)
        self.fill(name, flat, [Region(Box(tuple(0 for _ in info.shape), info.shape), 0,
                                      row_major_strides(info.shape))])
        return tensor
