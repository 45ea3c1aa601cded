"""Checkpoints that let a run continue exactly where it stopped, under any strategy.

Layout of ``checkpoint_dir`` (which every rank must see: one machine, or a shared filesystem)::

    step-00000040/
        universal/          the model and optimizer state: each rank writes the slices it
                            holds, by parameter name and global offsets, and any strategy on
                            any number of ranks reads the slices it needs
                            (:mod:`disttrain.parallel.universal`); a baseline of torch's or
                            DeepSpeed's writes state.pt instead
        rank-00000.pt       each rank's RNG state, sampler position and loss scale
        meta.pt             step, world size, the loss scale and the config fields that must
                            not change
        manifest.json       size and SHA-256 of every file above, written last
    latest                  the name of the newest complete checkpoint

The strategy's part is ``strategy.save_state`` / ``load_state``. Every file is written under a
temporary name, fsynced and renamed; the ranks then seal the directory with its manifest
(:mod:`disttrain.parallel.checkpoint_files`), and only then rank 0 replaces ``latest`` the
same way, so a crash at any moment of a save leaves ``latest`` naming a complete checkpoint.
Loading verifies the manifest (sizes everywhere, digests shared out over the ranks) and reads
with ``torch.load(weights_only=True)``; anything unusable is refused in one line that names
the file and says what to do. On another world size the random-number streams start afresh
(a warning says so); the step, and with it the sampler's position and the learning rate, the
optimizer's state and fp16's loss scale continue.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from disttrain.comm import Communicator
from disttrain.parallel import checkpoint_files
from disttrain.parallel.checkpoint_files import CheckpointError, atomic_save, atomic_write_text

log = logging.getLogger(__name__)
LATEST = "latest"
_STEP = re.compile(r"step-\d+")


class Strategy(Protocol):
    """What a checkpoint needs of a strategy: its own files, written and read per rank.
    (A protocol, not the class: the strategies import this module, for the parameter
    server's resume, so importing theirs back would close a circle.)"""

    def save_state(self, path: str, rank: int) -> None: ...

    def load_state(self, path: str, rank: int) -> None: ...


@dataclass(frozen=True)
class Resumed:
    """What the loop needs from a checkpoint after the strategy's state is loaded."""

    step: int
    sampler: dict[str, int] | None  # this rank's position; None if written by other ranks
    path: str


def save(directory: str, step: int, strategy: Strategy, comm: Communicator | None,
         meta: dict[str, Any], sampler: dict[str, int], scaler: Any = None, *,
         rank: int | None = None) -> str:
    """Write the checkpoint of ``step`` from every rank of ``comm``; returns its path
    (``scaler``: fp16's loss scaler, whose scale the run continues with). ``rank``: this
    rank's number in the run, which names its files (default: its rank in ``comm``; they
    differ when ``comm`` holds only the ranks that finish a run that lost some); the first
    rank of ``comm`` writes ``meta.pt`` and ``latest``."""
    me = comm.rank if comm is not None else 0
    rank = me if rank is None else rank
    world_size = comm.world_size if comm is not None else 1
    path = os.path.join(directory, f"step-{step:08d}")
    barrier = comm.barrier if comm is not None and world_size > 1 else _no_barrier
    if me == 0:
        _clear(path)  # an earlier attempt's files at this step (other ranks, strategy)
    barrier()
    strategy.save_state(path, rank)
    extra = {"loss_scaler": scaler.state_dict()} if scaler is not None else {}
    atomic_save({"rng": torch.get_rng_state(), "sampler": sampler, **extra},
                os.path.join(path, f"rank-{rank:05d}.pt"))
    if me == 0:  # the scale is the same on every rank: a resume on other ranks reads it here
        atomic_save({**meta, **extra, "step": step}, os.path.join(path, "meta.pt"))
    checkpoint_files.seal(path, me, world_size, barrier)
    if me == 0:  # every rank's files are sealed: `latest` may move
        atomic_write_text(os.path.join(directory, LATEST), os.path.basename(path))
    log.debug("checkpoint of step %d written to %s", step, path)
    return path


def _no_barrier() -> object:
    return None


def _clear(path: str) -> None:
    """An empty ``path``: the manifest goes first (a half-cleared directory is no
    checkpoint), then every file and directory in it (links removed, never followed)."""
    os.makedirs(path, exist_ok=True)
    manifest = os.path.join(path, checkpoint_files.MANIFEST)
    if os.path.lexists(manifest):
        os.unlink(manifest)
    for entry in os.scandir(path):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)


def latest(directory: str) -> str | None:
    """The newest complete checkpoint in ``directory``, or None if there is none yet; a
    ``latest`` that names no checkpoint here raises CheckpointError."""
    file = os.path.join(directory, LATEST)
    try:
        with open(file, "rb") as f:
            raw = f.read(256)
    except FileNotFoundError:
        return None
    try:
        name = raw.decode().strip()
    except UnicodeDecodeError:
        name = ""
    if not _STEP.fullmatch(name):
        raise CheckpointError(f"{file} does not name a checkpoint (it holds {raw[:40]!r})",
                              advice(directory))
    path = os.path.join(directory, name)
    if not os.path.isdir(path):
        raise CheckpointError(f"{file} names {name}, which is not in {directory}",
                              advice(directory, name))
    return path


def complete(directory: str) -> list[str]:
    """The sealed checkpoints in ``directory`` (names), newest first."""
    try:
        names = [e.name for e in os.scandir(directory) if e.is_dir() and _STEP.fullmatch(e.name)]
    except FileNotFoundError:
        return []
    sealed = [n for n in names
              if os.path.exists(os.path.join(directory, n, checkpoint_files.MANIFEST))]
    return sorted(sealed, key=lambda n: int(n.removeprefix("step-")), reverse=True)


def advice(directory: str, unusable: str | None = None) -> str:
    """What to do about an unusable checkpoint in ``directory``."""
    others = [n for n in complete(directory) if n != unusable][:3]
    earlier = (f"to resume from an earlier checkpoint write its name ({', '.join(others)}) "
               f"into {os.path.join(directory, LATEST)}, or " if others else "")
    return f"{earlier}start afresh in another --checkpoint-dir"


def load(path: str, strategy: Strategy, rank: int, meta: dict[str, Any],
         scaler: Any = None) -> Resumed:
    """Restore ``strategy``, this rank's RNG and fp16's loss ``scaler`` from ``path``; check
    the run is the same one."""
    try:
        return _load(path, strategy, rank, meta, scaler)
    except CheckpointError as exc:
        raise CheckpointError(exc.problem, advice(os.path.dirname(path),
                                                  os.path.basename(path))) from None


def _load(path: str, strategy: Strategy, rank: int, meta: dict[str, Any],
          scaler: Any) -> Resumed:
    checkpoint_files.verify(path, rank, int(meta.get("world_size", 1)))
    saved = checkpoint_files.load(os.path.join(path, "meta.pt"))
    if not isinstance(saved, dict) or not isinstance(saved.get("step"), int):
        raise CheckpointError(f"{os.path.join(path, 'meta.pt')} is not a disttrain "
                              f"checkpoint's meta.pt")
    for key, value in meta.items():
        if key != "world_size" and saved.get(key) != value:
            raise ValueError(f"checkpoint {path} was written with {key}={saved.get(key)!r} but "
                             f"this run has {key}={value!r}; use the same {key} or another "
                             f"checkpoint_dir")
    strategy.load_state(path, rank)
    rank_file = os.path.join(path, f"rank-{rank:05d}.pt")
    same_world = saved.get("world_size") == meta.get("world_size")
    if not (same_world and os.path.exists(rank_file)):
        log.warning("checkpoint %s was written by %s rank(s), this run has %s: the data order "
                    "continues, but random number streams start afresh", path,
                    saved.get("world_size"), meta.get("world_size"))
        if scaler is not None and "loss_scaler" in saved:
            scaler.load_state_dict(saved["loss_scaler"])
        return Resumed(saved["step"], None, path)
    rank_state = checkpoint_files.load(rank_file)
    torch.set_rng_state(rank_state["rng"])
    if scaler is not None and "loss_scaler" in rank_state:
        scaler.load_state_dict(rank_state["loss_scaler"])
    return Resumed(saved["step"], dict(rank_state["sampler"]), path)
