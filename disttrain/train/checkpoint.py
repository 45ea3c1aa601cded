"""Checkpoints that let a run continue exactly where it stopped.

Layout of ``checkpoint_dir`` (which every rank must see: one machine, or a shared filesystem)::

    step-00000040/
        state.pt            model + optimizer (rank 0), or what the strategy writes instead:
                            zero/ (ZeRO's resharding checkpoint: zero.json + a shard per rank),
                            state-stage00001-of-00002.pt (one per pipeline stage)
        rank-00000.pt       each rank's RNG state and sampler position
        meta.pt             step, epoch, world size and the config fields that must not change
    latest                  the name of the newest complete checkpoint

The strategy's part is ``strategy.save_state`` / ``load_state``. Every rank writes its
files, all ranks meet at a barrier, and only then rank 0 replaces
``latest`` (write a temporary file, then rename), so a crash mid-save leaves the previous
checkpoint in charge. Files are read with ``torch.load(weights_only=True)``: tensors and
plain containers only, never arbitrary pickles.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from disttrain.comm import Communicator
from disttrain.train.strategies import Strategy
from disttrain.train.strategies.base import atomic_save, safe_load

log = logging.getLogger(__name__)
LATEST = "latest"


@dataclass(frozen=True)
class Resumed:
    """What the loop needs from a checkpoint after the strategy's state is loaded."""

    step: int
    sampler: dict[str, int] | None  # this rank's position; None if written by other ranks
    path: str


def save(directory: str, step: int, strategy: Strategy, comm: Communicator | None,
         meta: dict[str, Any], sampler: dict[str, int], scaler: Any = None) -> str:
    """Write the checkpoint of ``step`` from every rank; returns its path (``scaler``: fp16's
    loss scaler, whose scale the run continues with)."""
    rank = comm.rank if comm is not None else 0
    path = os.path.join(directory, f"step-{step:08d}")
    os.makedirs(path, exist_ok=True)
    strategy.save_state(path, rank)
    extra = {"loss_scaler": scaler.state_dict()} if scaler is not None else {}
    atomic_save({"rng": torch.get_rng_state(), "sampler": sampler, **extra},
                os.path.join(path, f"rank-{rank:05d}.pt"))
    if rank == 0:
        atomic_save({**meta, "step": step}, os.path.join(path, "meta.pt"))
    if comm is not None and comm.world_size > 1:
        comm.barrier()  # every rank's files are complete before `latest` moves
    if rank == 0:
        tmp = os.path.join(directory, f"{LATEST}.tmp")
        with open(tmp, "w") as f:
            f.write(os.path.basename(path))
        os.replace(tmp, os.path.join(directory, LATEST))
    log.debug("checkpoint of step %d written to %s", step, path)
    return path


def latest(directory: str) -> str | None:
    """The newest complete checkpoint in ``directory``, or None if there is none."""
    try:
        with open(os.path.join(directory, LATEST)) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    return os.path.join(directory, name)


def load(path: str, strategy: Strategy, rank: int, meta: dict[str, Any],
         scaler: Any = None) -> Resumed:
    """Restore ``strategy``, this rank's RNG and fp16's loss ``scaler`` from ``path``; check
    the run is the same one."""
    saved = safe_load(os.path.join(path, "meta.pt"))
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
        return Resumed(int(saved["step"]), None, path)
    rank_state = safe_load(rank_file)
    torch.set_rng_state(rank_state["rng"])
    if scaler is not None and "loss_scaler" in rank_state:
        scaler.load_state_dict(rank_state["loss_scaler"])
    return Resumed(int(saved["step"]), dict(rank_state["sampler"]), path)
