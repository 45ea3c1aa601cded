"""Hugging Face safetensors: a checkpoint's weights whole, under the model's own names, for
``transformers``' ``from_pretrained``; and such a directory read back into a universal one.

::

    OUT/
      config.json                         the model's transformers config (when it has one)
      model.safetensors                   every parameter and buffer, whole, by name
      (or model-00001-of-00002.safetensors … and model.safetensors.index.json)
      manifest.json                       SHA-256 of the files above (transformers ignores it)

Exporting assembles each tensor from its blocks one shard file at a time (at most
``max_shard_bytes`` of tensors in memory, as ``save_pretrained`` shards). Parameters a
model ties (GPT-2's head and token embedding) are stored once, under the first name, as
``save_pretrained`` does; ``from_pretrained`` ties them again. safetensors holds raw tensors
and a JSON header: reading it runs nothing, and an import verifies a manifest when there
is one.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch

from disttrain.parallel.checkpoint_files import (
    MANIFEST,
    CheckpointError,
    atomic_write_text,
    seal,
    verify,
)
from disttrain.parallel.universal.slices import whole
from disttrain.parallel.universal.store import Index, Reader, Writer

log = logging.getLogger(__name__)
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
CONFIG = "config.json"


def export_safetensors(index: Index, out: str, config: dict[str, Any] | None = None,
                       max_shard_bytes: int = 5 << 30) -> list[str]:
    """Write the model state of ``index`` into ``out`` as safetensors (and ``config.json``
    from ``config``, else the checkpoint's own); returns the weight files written."""
    from safetensors.torch import save_file

    reader, names = Reader(index), [n for n in index.tensors
                                    if index.tensors[n].kind in ("param", "buffer")]
    if not names:
        raise CheckpointError(f"checkpoint {index.directory} holds no model tensors")
    shards = _shards(index, names, max_shard_bytes)
    os.makedirs(out, exist_ok=True)
    files, where = [], {}
    for i, shard in enumerate(shards):
        file = WEIGHTS if len(shards) == 1 else (
            f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
        save_file({n: reader.full(n).contiguous() for n in shard}, os.path.join(out, file),
                  metadata={"format": "pt"})
        files.append(file)
        where.update({n: file for n in shard})
    if len(shards) > 1:
        total = sum(_nbytes(index, n) for n in names)
        atomic_write_text(os.path.join(out, WEIGHTS_INDEX), json.dumps(
            {"metadata": {"total_size": total}, "weight_map": where}, indent=1))
    config = config if config is not None else index.model_config
    if config is not None:
        atomic_write_text(os.path.join(out, CONFIG), json.dumps(config, indent=1))
    seal(out, 0, 1, lambda: None)
    log.info("exported %d tensors of %s as safetensors to %s", len(names), index.directory, out)
    return files


def _nbytes(index: Index, name: str) -> int:
    info = index.tensors[name]
    n = 1
    for s in info.shape:
        n *= s
    return n * torch.empty(0, dtype=getattr(torch, info.dtype)).element_size()


def _shards(index: Index, names: list[str], limit: int) -> list[list[str]]:
    """Consecutive names in files of at most ``limit`` bytes (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        n = _nbytes(index, name)
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def import_safetensors(directory: str, out: str) -> None:
    """Write the safetensors weights in ``directory`` (a ``save_pretrained`` directory, or
    :func:`export_safetensors`'s) as a universal checkpoint ``out``, sealed; its
    ``config.json``, when present, is kept for a later export."""
    from safetensors import SafetensorError, safe_open

    if os.path.exists(os.path.join(directory, MANIFEST)):
        verify(directory)
    writer = Writer(out, 0)
    for file in weight_files(directory):
        path = os.path.join(directory, file)
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    tensor = f.get_tensor(name)
                    writer.add_chunk(name, "param", tuple(tensor.shape),
                                     whole(tuple(tensor.shape)), tensor)
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"safetensors file {path} cannot be read "
                                  f"({type(exc).__name__}: {str(exc)[:100]})") from None
    writer.header.update(optimizer=None, model_config=_config(directory))
    writer.close()
    seal(out, 0, 1, lambda: None)
    log.info("imported %d tensors from %s into %s", len(writer.records), directory, out)


def weight_files(directory: str) -> list[str]:
    """The weight files of a safetensors directory (one, or those its index lists)."""
    index = os.path.join(directory, WEIGHTS_INDEX)
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                return sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index} is damaged ({type(exc).__name__})") from None
    if not os.path.exists(os.path.join(directory, WEIGHTS)):
        raise CheckpointError(f"{directory} holds no {WEIGHTS} (nor {WEIGHTS_INDEX})")
    return [WEIGHTS]


def _config(directory: str) -> dict[str, Any] | None:
    path = os.path.join(directory, CONFIG)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except ValueError as exc:
        raise CheckpointError(f"{path} is not JSON ({exc})") from None
    return config if isinstance(config, dict) else None
