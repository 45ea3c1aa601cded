"""torch.distributed.checkpoint (DCP) directories: written from a universal checkpoint for torch's
FSDP2 to load, and read into one from what torch wrote, block by block (never gathered).

Both formats address blocks of named tensors by global offsets, so the conversion is a
renaming. The names are those torch's ``get_state_dict(model, optimizer)`` gives, saved
as ``dcp.save({"model": ..., "optim": ...})``::

    universal                         DCP key
    blocks.0.fc.weight                model.blocks.0.fc.weight
    blocks.0.fc.weight/exp_avg        optim.state.blocks.0.fc.weight.exp_avg
    blocks.0.fc.weight/step           optim.state.blocks.0.fc.weight.step      (0-d tensor)
    (the group's hyper-parameters)    optim.param_groups.0.lr, …, optim.param_groups.0.params

so ``dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=DIR)`` followed by
``set_state_dict`` fills a ``fully_shard`` model and its optimizer on any number of ranks.
Writing goes through torch's own ``FileSystemWriter`` (a planner that hands it the blocks),
so the files are torch's format. Reading never unpickles freely: DCP's ``.metadata`` is a
pickle, read by an unpickler that admits only DCP's metadata classes, and each item is read
with ``torch.load(weights_only=True)``; an item outside its file, a damaged item or a
foreign class is refused in one line naming the file. An exported directory also gets a
SHA-256 ``manifest.json`` (torch ignores it), which an import verifies.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from disttrain.parallel.checkpoint_files import (
    MANIFEST,
    CheckpointError,
    require_safe_torch,
    seal,
    verify,
)
from disttrain.parallel.universal.slices import Box
from disttrain.parallel.universal.store import Index, Reader, Writer, to_json_value

log = logging.getLogger(__name__)
METADATA = ".metadata"


# ------------------------------------------------------------------ export
def export_dcp(index: Index, out: str) -> None:
    """Write the universal checkpoint ``index`` as a DCP directory ``out`` (one process,
    block by block: no tensor is gathered)."""
    items, mappings = _write_items(index)
    os.makedirs(out, exist_ok=True)
    with warnings.catch_warnings():  # torch warns that it saves in one process: it does
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save({}, storage_writer=FileSystemWriter(out),
                 planner=_BlockPlanner(items, mappings), no_dist=True)
    seal(out, 0, 1, lambda: None)
    log.info("exported %s as a torch.distributed.checkpoint to %s", index.directory, out)


def _write_items(index: Index) -> tuple[list[tuple[WriteItem, Any]], dict[str, tuple[Any, ...]]]:
    """(WriteItem, the block or object it writes) for every block; flat key → path."""
    reader = Reader(index)
    items: list[tuple[WriteItem, Any]] = []
    mappings: dict[str, tuple[Any, ...]] = {}
    for name, info in index.tensors.items():
        key = ".".join(_dcp_path(name, info.kind))
        mappings[key] = _dcp_path(name, info.kind)
        blocks: Iterator[tuple[Box, torch.Tensor]]
        if info.kind in ("scalar", "number"):
            blocks = iter([(Box((), ()), torch.as_tensor(reader.scalar(name)))])
        else:
            blocks = ((box, reader.chunk(rank, k)) for rank, k, box in info.chunks)
        for box, tensor in blocks:
            offsets = torch.Size(box.offsets)
            data = TensorWriteData(ChunkStorageMetadata(offsets, torch.Size(box.sizes)),
                                   TensorProperties(dtype=tensor.dtype), torch.Size(info.shape))
            items.append((WriteItem(MetadataIndex(key, offsets), WriteItemType.SHARD,
                                    tensor_data=data), tensor.contiguous()))
    for g, (hyper, params) in enumerate(_groups(index)):
        for field_name, value in [*hyper.items(), ("params", params)]:
            key = f"optim.param_groups.{g}.{field_name}"
            mappings[key] = ("optim", "param_groups", g, field_name)
            stored = tuple(value) if isinstance(value, list) and field_name != "params" else value
            items.append((WriteItem(MetadataIndex(key), WriteItemType.BYTE_IO), stored))
    return items, mappings


def _dcp_path(name: str, kind: str) -> tuple[str, ...]:
    if kind in ("param", "buffer"):
        return ("model", name)
    param, _, key = name.partition("/")
    return ("optim", "state", param, key)


def _groups(index: Index) -> list[tuple[dict[str, Any], list[str]]]:
    """Each distinct group's hyper-parameters and its parameters, in first-seen order."""
    groups: list[tuple[dict[str, Any], list[str]]] = []
    for name in index.names("param"):
        hyper = index.tensors[name].group
        if hyper is None:
            continue
        found = next((g for g in groups if g[0] == hyper), None)
        if found is None:
            found = (hyper, [])
            groups.append(found)
        found[1].append(name)
    return groups


class _BlockPlanner(DefaultSavePlanner):
    """torch's planner, handed blocks and objects by key instead of a state dict."""

    def __init__(self, items: list[tuple[WriteItem, Any]], mappings: dict[str, Any]) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=False)
        self._items, self._mappings = items, mappings
        self._objects = {item.index: obj for item, obj in items}

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        self.state_dict, self.is_coordinator = {}, is_coordinator
        self.mappings = self._mappings

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan([item for item, _ in self._items], planner_data=self._mappings)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self._objects[index]


# ------------------------------------------------------------------ import
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
     ("pathlib", "WindowsPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata classes, torch.Size and dtypes: nothing that runs code."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata class")


def read_metadata(directory: str) -> Any:
    """The ``.metadata`` of a DCP directory, unpickled with DCP's classes only."""
    path = os.path.join(directory, METADATA)
    try:
        with open(path, "rb") as f:
            meta = _MetadataUnpickler(f).load()
        meta.state_dict_metadata.items()
        meta.storage_data.items()
    except FileNotFoundError:
        raise CheckpointError(f"{directory} is not a torch.distributed.checkpoint (no "
                              f"{METADATA})") from None
    except Exception as exc:  # any unpickling or shape failure: one line naming the file
        reason = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ""
        raise CheckpointError(f"DCP metadata {path} cannot be read ({type(exc).__name__}: "
                              f"{reason})") from None
    return meta


def import_dcp(directory: str, out: str) -> None:
    """Write the DCP checkpoint in ``directory`` (torch's, or :func:`export_dcp`'s) as a
    universal checkpoint ``out``, sealed with its manifest. Keys are read as torch's
    ``{"model": …, "optim": …}`` (or a bare model state dict); others are skipped."""
    if os.path.exists(os.path.join(directory, MANIFEST)):
        verify(directory)
    meta = read_metadata(directory)
    paths: dict[str, tuple[Any, ...]] = dict(meta.planner_data or {})
    for key in meta.state_dict_metadata:  # written without torch's flattening: guess
        if key not in paths and key.startswith("model."):
            paths[key] = ("model", key.removeprefix("model."))
    writer, groups = Writer(out, 0), dict[int, dict[str, Any]]()
    for key, stored in meta.state_dict_metadata.items():
        path = tuple(paths.get(key, (key,)))
        if path[:2] == ("optim", "param_groups") and len(path) == 4:
            groups.setdefault(int(path[2]), {})[str(path[3])] = _item(directory, meta, key)
        elif not hasattr(stored, "chunks"):
            log.warning("%s: skipping %s, which is not a tensor", directory, key)
        elif (path[0] == "model" and len(path) == 2) or len(path) == 1:
            _import_tensor(writer, directory, meta, key, str(path[-1]), "param", stored)
        elif path[:2] == ("optim", "state") and len(path) == 4:
            kind = "state" if len(stored.size) else "scalar"  # step: a 0-d tensor
            _import_tensor(writer, directory, meta, key, f"{path[2]}/{path[3]}", kind, stored)
        else:
            log.warning("%s: skipping %s (neither model nor optim state)", directory, key)
    for group in groups.values():
        hyper = {k: to_json_value(k, v) for k, v in group.items() if k != "params"}
        for param in group.get("params", []):
            if param in writer.records:
                writer.add_group(param, hyper)
    writer.header.update(optimizer=None, model_config=None)
    writer.close()
    seal(out, 0, 1, lambda: None)
    log.info("imported the torch.distributed.checkpoint %s into %s", directory, out)


def _import_tensor(writer: Writer, directory: str, meta: Any, key: str, name: str,
                   kind: str, stored: Any) -> None:
    shape = tuple(stored.size)
    for chunk in stored.chunks:
        box = Box(tuple(chunk.offsets), tuple(chunk.sizes))
        tensor = _item(directory, meta, key, chunk.offsets)
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != box.sizes:
            raise CheckpointError(f"{directory}: item {key} at {box.offsets} is not a tensor "
                                  f"of {box.sizes}")
        if kind == "scalar":
            writer.add_scalar(name, tensor)
        else:
            writer.add_chunk(name, kind, shape, box, tensor)


def _item(directory: str, meta: Any, key: str, offsets: Any = None) -> Any:
    """One stored item (a tensor block or a small object), read as tensors and plain
    containers only; one line naming the file if it lies outside it or cannot be read."""
    info = meta.storage_data.get(MetadataIndex(key, offsets))
    if info is None:
        raise CheckpointError(f"{directory}: {METADATA} lists {key} but no file holds it")
    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(f"{directory}: {key} is stored transformed "
                              f"({info.transform_descriptors}); export it uncompressed")
    relative = str(info.relative_path)
    file = os.path.join(directory, relative)
    if os.path.isabs(relative) or ".." in relative.split("/") or os.path.islink(file):
        raise CheckpointError(f"{directory}: {key} is stored in {relative!r}, which is not a "
                              f"file inside it")
    require_safe_torch()
    try:
        with open(file, "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.length)
        if len(raw) != info.length:
            raise ValueError(f"{len(raw)} of {info.length} bytes")
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"DCP file {file} is missing") from None
    except Exception as exc:  # zip, unpickling and storage errors alike
        reason = str(exc).strip().splitlines()[0][:80] if str(exc).strip() else ""
        raise CheckpointError(f"DCP file {file} is damaged: item {key} cannot be read "
                              f"({type(exc).__name__}: {reason})") from None
