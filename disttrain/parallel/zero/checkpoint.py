"""ZeRO's checkpoints: each rank writes the slices it holds, never gathering the model.

A ZeRO rank's optimizer updates one flat master shard per group; its pieces
(:class:`~disttrain.parallel.zero.sharding.Piece`) are ranges of the flattened parameters,
which the universal checkpoint (:mod:`disttrain.parallel.universal`) stores as blocks of
each parameter under its name::

    saved on 4:   | r0 | r1 | r2 | r3 |       the same flat vector, cut twice
    loaded on 3:  |  r0   |  r1  |  r2   |    new r1 reads the end of old r1 and old r2

No rank ever holds more than its own shard (the DeepSpeed and torch complaints this answers:
checkpoints tied to the GPU count, DeepSpeed#2898; consolidating optimizer state on one rank
running out of memory, pytorch#68181). Blocks are addressed by parameter name and global
offsets, so a checkpoint from stage 1 loads into stage 3, into DDP, a pipeline or a
tensor-parallel run, and the other way round. A hybrid run (:mod:`.hybrid`) saves once,
from its first replica (the others hold the same shards). Inside a tensor-parallel mesh
the wrapped module is a shard: ``splits`` says how each parameter was cut, and ``writes``
leaves a LayerNorm that every tp rank holds to one of them. Directories written in the
format before this one (``zero.json``) still load (:mod:`.legacy_checkpoint`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from disttrain.parallel.checkpoint_files import CheckpointError, seal, verify
from disttrain.parallel.universal import state as universal
from disttrain.parallel.universal.slices import Split, regions, replicated
from disttrain.parallel.universal.store import Index, Reader, read_index, verified_index
from disttrain.parallel.zero import legacy_checkpoint
from disttrain.parallel.zero.sharding import ZeroWrapper

log = logging.getLogger(__name__)
Writes = Callable[[str, Split | None], bool]


def layout(zero: ZeroWrapper, splits: Mapping[int, Split] | None = None,
           writes: Writes | None = None) -> universal.Layout:
    """What this rank of ``zero`` holds: one unit per tensor its optimizer updates (a
    master shard, or each slice of one under parameter groups), one entry per parameter
    piece in it. ``splits``: tensor-parallel cuts by ``id(param)``; ``writes(name,
    split)``: whether this rank writes that parameter (by default every rank its own
    pieces; a hybrid run's later replicas nothing)."""
    splits = splits or {}
    params = dict(zero.module.named_parameters(remove_duplicate=False))
    first_replica = zero.replicate is None or zero.replicate.rank == 0
    units = []
    for group in zero.shard_groups():
        slices = getattr(group, "slices", ())  # parameter groups cut a shard into slices
        for tensor, start in [(s.tensor, s.start) for s in slices] or [(group.master, 0)]:
            end, entries = start + tensor.numel(), []
            for piece in group.layout.pieces[zero.comm.rank]:
                lo, hi = max(piece.shard_offset, start), min(piece.shard_offset + piece.length,
                                                             end)
                if lo >= hi:
                    continue
                name, shape = group.names[piece.param], group.shapes[piece.param]
                how = splits.get(id(params[name])) if name in params else None
                placement = how.placement(shape) if how is not None else replicated(shape)
                first = piece.param_offset + lo - piece.shard_offset
                found = regions(placement, first, first + hi - lo, base=lo - start)
                mine = first_replica and (writes is None or writes(name, how))
                entries.append(universal.Entry(name, placement, tuple(found), mine))
            units.append(universal.Unit(tensor, entries))
    lead = first_replica and zero.comm.rank == 0
    buffers = [(n, b, lead and (writes is None or writes(n, None)))
               for n, b in universal.persistent_buffers(zero.module)]
    return universal.Layout(units, zero.optimizer, buffers,
                            universal.model_config(zero.module))


def save(zero: ZeroWrapper, directory: str | Path) -> None:
    """Write this rank's pieces into the universal checkpoint ``directory`` and seal it.
    Every rank of ``zero.comm`` (and of ``zero.replicate``) must call it; it returns once
    the checkpoint is complete. Of a hybrid run's replicas only the first writes."""
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
    comm = zero.comm
    if comm.rank == 0:  # an older checkpoint here stops being one until this save completes
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.iterdir():
            if stale.is_file():
                stale.unlink()
    comm.barrier()
    write_shard(zero, directory)
    seal(str(directory), comm.rank, comm.world_size, comm.barrier)  # starts with a barrier
    log.info("saved ZeRO-%d shard %d/%d to %s", zero.stage, comm.rank, comm.world_size, directory)


def write_shard(zero: ZeroWrapper, directory: str | Path, writes: Writes | None = None,
                splits: Mapping[int, Split] | None = None) -> None:
    """This rank's files of the universal checkpoint in ``directory`` (no seal)."""
    universal.save(str(directory), layout(zero, splits, writes), zero.comm.rank)


def load(zero: ZeroWrapper, directory: str | Path, *, load_optimizer: bool = True,
         splits: Mapping[int, Split] | None = None) -> Reader | legacy_checkpoint.ShardReader:
    """Fill ``zero``'s shards (and its optimizer state) from a checkpoint written under any
    strategy and number of ranks; returns the reader (which ranks' files it opened). The
    files are checked against the checkpoint's manifest first (this rank hashes its share)."""
    if legacy_checkpoint.is_legacy(directory):
        return legacy_checkpoint.load(zero, directory, load_optimizer=load_optimizer)
    verify(str(directory), zero.comm.rank, zero.comm.world_size)
    reader = read_into(zero, str(directory), load_optimizer=load_optimizer, splits=splits)
    log.info("rank %d loaded ZeRO shards from the files of ranks %s", zero.comm.rank,
             reader.opened)
    return reader


def read_into(zero: ZeroWrapper, directory: str, *, load_optimizer: bool = True,
              splits: Mapping[int, Split] | None = None) -> Reader:
    """:func:`load` without the manifest check (the caller verified the directory)."""
    universal.check_shapes(read_index(directory), global_shapes(zero, splits or {}))
    reader = universal.load(directory, layout(zero, splits), load_optimizer=load_optimizer)
    zero.reload_from_masters()
    return reader


def global_shapes(zero: ZeroWrapper, splits: Mapping[int, Split]
                  ) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter ZeRO shards, with its shape in the whole model (on every rank, so
    another model is refused alike everywhere, not only where a piece differs)."""
    params = dict(zero.module.named_parameters(remove_duplicate=False))
    found = []
    for group in zero.shard_groups():
        for name, shape in zip(group.names, group.shapes):
            how = splits.get(id(params[name])) if name in params else None
            found.append((name, how.placement(shape).shape if how is not None else shape))
    return found


def consolidate(directory: str | Path) -> tuple[dict[str, torch.Tensor],
                                                dict[str, dict[str, torch.Tensor]]]:
    """Offline: every parameter and its optimizer state (scalars such as ``step`` included)
    as full tensors, by name, for export or inspection, from a ZeRO checkpoint or any
    universal one (a loop checkpoint's ``universal/`` too). It needs the whole model's memory,
    so it is a tool for after training, never a step inside it."""
    if legacy_checkpoint.is_legacy(directory):
        return legacy_checkpoint.consolidate(directory)
    return consolidate_index(verified_index(str(directory)))


def consolidate_index(index: Index) -> tuple[dict[str, torch.Tensor],
                                             dict[str, dict[str, torch.Tensor]]]:
    """:func:`consolidate` of a universal checkpoint's index (verified by the caller)."""
    reader = Reader(index)
    params = {name: reader.full(name) for name in index.names("param")}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for name, info in index.tensors.items():
        param, _, key = name.partition("/")
        if info.kind == "state":
            state.setdefault(param, {})[key] = reader.full(name)
        elif info.kind in ("scalar", "number"):
            state.setdefault(param, {})[key] = torch.as_tensor(reader.scalar(name))
    return params, state
