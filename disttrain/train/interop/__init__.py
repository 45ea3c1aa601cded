"""Checkpoints in the ecosystem's formats: torch.distributed.checkpoint (what torch's FSDP2
loads and writes) and Hugging Face safetensors (what ``transformers`` loads), exported from a
disttrain checkpoint and imported into a universal one.

::

    disttrain checkpoint export --format dcp|safetensors CHECKPOINT OUT
    disttrain checkpoint import --format dcp|safetensors SOURCE OUT

    from disttrain.train.interop import export_checkpoint, import_checkpoint, load_weights
    export_checkpoint("ckpt", "ckpt-dcp", "dcp")      # ckpt: a --checkpoint-dir, a step-*
    import_checkpoint("torch-dcp", "imported", "dcp")  # directory, or a universal one
    load_weights(model, "imported")                   # into a plain module, by name

:mod:`.dcp` converts block by block (never gathering a tensor); :mod:`.hf` writes each
tensor whole, as safetensors holds them. Every directory written is sealed with a SHA-256
manifest; every directory read is verified against its manifest when it has one, and is
read without unpickling anything but tensors and plain containers. A ZeRO wrapper loads an
imported checkpoint on any number of ranks with :func:`disttrain.parallel.zero.load`, any
rank's layout with :func:`disttrain.parallel.universal.load`, a whole module with
:func:`load_weights`.
"""

from __future__ import annotations

import os

from torch import nn

from disttrain.parallel import universal
from disttrain.parallel.checkpoint_files import CheckpointError
from disttrain.parallel.universal.store import Index, verified_index

FORMATS = ("dcp", "safetensors")


def resolve(path: str) -> str:
    """The universal checkpoint in ``path``: a ``--checkpoint-dir`` (its ``latest``), a
    ``step-*`` directory (its ``universal/``), or a universal directory itself."""
    from disttrain.train import checkpoint

    if os.path.isfile(os.path.join(path, checkpoint.LATEST)):
        latest = checkpoint.latest(path)
        assert latest is not None
        path = latest
    if os.path.isdir(os.path.join(path, universal.DIRECTORY)):
        return os.path.join(path, universal.DIRECTORY)
    if universal.is_universal(path):
        return path
    raise CheckpointError(f"{path} holds no universal checkpoint (a checkpoint directory "
                          f"with 'latest', a step-* directory, or one with rank-*.json)",
                          "give a checkpoint disttrain wrote, or import the files first")


def source_index(path: str) -> Index:
    """The verified index of the universal checkpoint :func:`resolve` finds in ``path``."""
    return verified_index(resolve(path))


def export_checkpoint(path: str, out: str, fmt: str,
                      config: dict[str, object] | None = None) -> None:
    """Write the checkpoint in ``path`` into ``out`` as ``fmt`` (``"dcp"`` or
    ``"safetensors"``; ``config``: the transformers config for ``config.json``)."""
    _check_format(fmt)
    index = source_index(path)
    if fmt == "dcp":
        from disttrain.train.interop.dcp import export_dcp

        export_dcp(index, out)
    else:
        from disttrain.train.interop.hf import export_safetensors

        export_safetensors(index, out, config)


def import_checkpoint(source: str, out: str, fmt: str) -> None:
    """Write the ``fmt`` checkpoint in ``source`` as a universal checkpoint ``out``."""
    _check_format(fmt)
    if fmt == "dcp":
        from disttrain.train.interop.dcp import import_dcp

        import_dcp(source, out)
    else:
        from disttrain.train.interop.hf import import_safetensors

        import_safetensors(source, out)


def load_weights(module: nn.Module, path: str) -> None:
    """Fill ``module``'s parameters and buffers, by name, from the checkpoint in ``path``
    (one process: the whole module is here)."""
    layout = universal.module_layout(module.named_parameters(), None,
                                     buffers=universal.persistent_buffers(module))
    universal.load(source_index(path).directory, layout, load_optimizer=False)


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown checkpoint format {fmt!r}; choose one of "
                         f"{', '.join(FORMATS)}")


__all__ = ["FORMATS", "export_checkpoint", "import_checkpoint", "load_weights", "resolve",
           "source_index"]
