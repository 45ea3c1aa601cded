"""Checkpoint files: written atomically and durably, sealed by a checksummed manifest, read as
tensors only.

Every checkpoint directory (a loop checkpoint ``step-*``, a ZeRO ``zero/`` directory) ends with
``manifest.json``, written last: the size and SHA-256 of every file in it. A directory without
one is incomplete or foreign and is refused; a file whose size or digest differs is refused by
name. A nested directory that has its own manifest is listed by that manifest only (its loader
verifies the rest)::

    write files (each: temporary name, fsync, rename) ─▶ barrier
      ─▶ each rank hashes its share of the listing ─▶ barrier ─▶ rank 0 writes manifest.json

Hashing is shared out by rank (rank r of N hashes files r, r+N, …) when sealing and when
verifying, so a job reads its checkpoint back once, not once per rank; every rank still checks
that every file is there with its size, which catches truncation everywhere. Loads use
``torch.load(weights_only=True)``: tensors and plain containers, never arbitrary pickles; any
failure to read becomes one :class:`CheckpointError` line that names the file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from typing import Any

import torch

MANIFEST = "manifest.json"
FORMAT = "disttrain.checkpoint/1"
_PART = ".manifest-part-{:05d}.json"  # dot files are temporary: never listed


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: one line naming the file (``problem``), then what to
    do (``advice``; a caller that knows better, such as the training loop, replaces it)."""

    def __init__(self, problem: str, advice: str = "restore it from a copy or load another "
                                                   "checkpoint") -> None:
        super().__init__(f"{problem}; {advice}")
        self.problem, self.advice = problem, advice

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.problem, self.advice)


# ------------------------------------------------------------------ writing
def atomic_save(obj: Any, path: str) -> None:
    """``torch.save`` to a temporary name in the same directory, fsync, rename, fsync the
    directory: after a crash ``path`` is either the old file or the complete new one."""
    _atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write_text(path: str, text: str) -> None:
    _atomic_write(path, lambda f: f.write(text.encode()))


def _atomic_write(path: str, write: Callable[[Any], object]) -> None:
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_directory(directory)


def fsync_directory(directory: str) -> None:
    """Make renames inside ``directory`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ------------------------------------------------------------------ sealing
def seal(directory: str, rank: int, world_size: int, barrier: Callable[[], object]) -> None:
    """Write ``directory``'s manifest once every rank's files are complete. Every rank calls
    it after writing its files; ``barrier`` waits for all of them (a no-op for one process).
    Returns on every rank once the manifest is written."""
    if rank == 0 and os.path.exists(os.path.join(directory, MANIFEST)):
        os.unlink(os.path.join(directory, MANIFEST))  # stale until this seal completes
    barrier()  # every file written, and no stale manifest listed
    names = _listing(directory)
    mine = {n: _record(directory, n) for n in names[rank::world_size]}
    atomic_write_text(os.path.join(directory, _PART.format(rank)), json.dumps(mine))
    barrier()
    if rank == 0:
        records: dict[str, dict[str, Any]] = {}
        for r in range(world_size):
            part = os.path.join(directory, _PART.format(r))
            with open(part) as f:
                records.update(json.load(f))
            os.unlink(part)
        for name in names:  # a file another rank did not see (a lagging shared filesystem)
            if name not in records:
                records[name] = _record(directory, name)
        manifest = {"format": FORMAT, "files": {n: records[n] for n in sorted(records)}}
        atomic_write_text(os.path.join(directory, MANIFEST), json.dumps(manifest, indent=1))
    barrier()


def _listing(directory: str) -> list[str]:
    """Files under ``directory`` (relative, sorted), but of a subdirectory with its own
    manifest only that manifest; temporary (dot) files and this manifest left out."""
    names: list[str] = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.name.startswith(".") or entry.name == MANIFEST:
            continue
        if entry.is_dir():
            if os.path.exists(os.path.join(entry.path, MANIFEST)):
                names.append(f"{entry.name}/{MANIFEST}")
            else:
                names += [f"{entry.name}/{n}" for n in _listing(entry.path)]
        else:
            names.append(entry.name)
    return names


def _record(directory: str, name: str) -> dict[str, Any]:
    path = os.path.join(directory, name)
    return {"bytes": os.path.getsize(path), "sha256": sha256(path)}


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


# ------------------------------------------------------------------ verifying, reading
def verify(directory: str, rank: int = 0, world_size: int = 1) -> dict[str, dict[str, Any]]:
    """Check ``directory`` against its manifest: every file present with its size; the
    SHA-256 of this rank's share. Returns the manifest's records; raises CheckpointError."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint {directory} does not exist")
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read().decode())
        files = manifest["files"] if manifest.get("format") == FORMAT else None
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {directory} has no {MANIFEST}: its save did not "
                              f"finish, or another program wrote it") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint manifest {path} is damaged "
                              f"({type(exc).__name__})") from None
    if not isinstance(files, dict):
        raise CheckpointError(f"{path} is not a disttrain checkpoint manifest (format "
                              f"{manifest.get('format')!r}, expected {FORMAT!r})")
    if not all(isinstance(r, dict) and isinstance(r.get("bytes"), int)
               and isinstance(r.get("sha256"), str) for r in files.values()):
        raise CheckpointError(f"checkpoint manifest {path} is damaged (a record without "
                              f"size or digest)")
    for name, record in files.items():
        file = os.path.join(directory, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"checkpoint file {file} is missing")
        if os.path.getsize(file) != record["bytes"]:
            raise CheckpointError(f"checkpoint file {file} is damaged: "
                                  f"{os.path.getsize(file)} bytes, {record['bytes']} written")
    for name in sorted(files)[rank::world_size]:
        if sha256(os.path.join(directory, name)) != files[name]["sha256"]:
            raise CheckpointError(f"checkpoint file {os.path.join(directory, name)} is "
                                  f"damaged: its SHA-256 differs from the one written")
    return dict(files)


def load(path: str, mmap: bool = False) -> Any:
    """Tensors and plain containers only (``weights_only=True``); a missing, truncated or
    foreign file raises CheckpointError naming it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except Exception as exc:  # zip, unpickling and storage errors alike
        reason = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ""
        raise CheckpointError(f"checkpoint file {path} cannot be read "
                              f"({type(exc).__name__}: {reason})") from None
