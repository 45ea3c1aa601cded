"""Checkpoint files: written atomically and durably, sealed by a checksummed manifest, read as
tensors only.

Every checkpoint directory (a loop checkpoint ``step-*``, a ZeRO ``zero/`` directory) ends with
``manifest.json``, written last: the size and SHA-256 of every file in it. A directory without
one is incomplete or foreign and is refused; a file whose size or digest differs is refused by
name. The manifest must cover the directory exactly: a file it does not list (added later, or
a partial manifest), an empty manifest, a name that leaves the directory (``../x``, ``/x``)
and a symbolic link anywhere inside (file or directory: disttrain never writes one) are each
refused in one line naming the file. Temporary (dot) files are neither listed nor read. A
nested directory that has its own manifest is listed by that manifest only (its loader
verifies the rest)::

    write files (each: temporary name, fsync, rename) ─▶ barrier
      ─▶ each rank hashes its share of the listing ─▶ barrier ─▶ rank 0 writes manifest.json

Hashing is shared out by rank (rank r of N hashes files r, r+N, …) when sealing and when
verifying, so a job reads its checkpoint back once, not once per rank; every rank still checks
that every file is there with its size, which catches truncation everywhere. Loads use
``torch.load(weights_only=True)``: tensors and plain containers, never arbitrary pickles; any
failure to read becomes one :class:`CheckpointError` line that names the file. That loader
is only as safe as torch's: below 2.6 it runs code from the file (CVE-2025-32434), below 2.10
memory-corruption advisories remain, so :func:`load` refuses torch older than
:data:`SAFE_TORCH` in one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Callable
from typing import Any

import torch

from disttrain import private_files

MANIFEST = "manifest.json"
FORMAT = "disttrain.checkpoint/1"
SAFE_TORCH = (2, 10)  # the first torch whose weights_only loader has no known advisory
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
    # a fresh O_EXCL | O_NOFOLLOW name, fsync, rename, fsync the directory: never written
    # through a link planted in a shared checkpoint directory (disttrain.private_files)
    private_files.atomic_write(os.path.abspath(path), write, durable=True)


fsync_directory = private_files.fsync_directory  # make renames in a directory durable


# ------------------------------------------------------------------ sealing
def seal(directory: str, rank: int, world_size: int, barrier: Callable[[], object]) -> None:
    """Write ``directory``'s manifest once every rank's files are complete. Every rank calls
    it after writing its files; ``barrier`` waits for all of them (a no-op for one process).
    Returns on every rank once the manifest is written."""
    if rank == 0 and os.path.exists(os.path.join(directory, MANIFEST)):
        os.unlink(os.path.join(directory, MANIFEST))  # stale until this seal completes
    barrier()  # every file written, and no stale manifest listed
    names = _listing(directory)
    for name in names:  # every rank lists the same names: all refuse alike
        if os.path.islink(os.path.join(directory, name)):
            raise CheckpointError(f"checkpoint file {os.path.join(directory, name)} is a "
                                  f"symbolic link, which a checkpoint may not hold",
                                  "write the file itself into the checkpoint directory")
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
    manifest only that manifest; temporary (dot) files and this manifest left out. A
    symbolic link is listed as a name, never followed."""
    names: list[str] = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.name.startswith(".") or entry.name == MANIFEST:
            continue
        if entry.is_dir(follow_symlinks=False):
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
    if not files:
        raise CheckpointError(f"checkpoint manifest {path} lists no files")
    if os.path.islink(path):
        raise CheckpointError(f"checkpoint manifest {path} is a symbolic link")
    for name, record in files.items():
        file = _inside(directory, name, path)
        if os.path.getsize(file) != record["bytes"]:
            raise CheckpointError(f"checkpoint file {file} is damaged: "
                                  f"{os.path.getsize(file)} bytes, {record['bytes']} written")
    unlisted = sorted(set(_listing(directory)) - set(files))
    if unlisted:
        file = os.path.join(directory, unlisted[0])
        kind = "symbolic link" if os.path.islink(file) else "file"
        raise CheckpointError(f"checkpoint {kind} {file} is not listed in {path} (added "
                              f"after the save, or the manifest is partial)")
    for name in sorted(files)[rank::world_size]:
        if sha256(os.path.join(directory, name)) != files[name]["sha256"]:
            raise CheckpointError(f"checkpoint file {os.path.join(directory, name)} is "
                                  f"damaged: its SHA-256 differs from the one written")
    return dict(files)


def _inside(directory: str, name: str, manifest: str) -> str:
    """The path of manifest entry ``name``: a regular file inside ``directory``, reached
    without a symbolic link; CheckpointError naming it otherwise."""
    parts = name.split("/")
    if not name or "\\" in name or "\0" in name or any(p in ("", ".", "..") for p in parts):
        raise CheckpointError(f"checkpoint manifest {manifest} names {name!r}, which is not a "
                              f"file inside {directory}")
    file = directory
    for part in parts:
        file = os.path.join(file, part)
        try:
            mode = os.lstat(file).st_mode
        except OSError:
            raise CheckpointError(f"checkpoint file {os.path.join(directory, name)} is "
                                  f"missing") from None
        if stat.S_ISLNK(mode):
            raise CheckpointError(f"checkpoint file {file} is a symbolic link, which a "
                                  f"checkpoint may not hold")
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"checkpoint file {file} is missing (not a regular file)")
    return file


def require_safe_torch(version: str | None = None) -> None:
    """Refuse a torch older than :data:`SAFE_TORCH` (``version``: torch's own by default),
    whose ``weights_only`` loader has known advisories, in one CheckpointError line."""
    version = str(torch.__version__ if version is None else version)
    match = re.match(r"(\d+)\.(\d+)", version)
    release = (int(match.group(1)), int(match.group(2))) if match else (0, 0)
    if release < SAFE_TORCH:
        why = ("runs code from the file (CVE-2025-32434)" if release < (2, 6) else
               "has memory-corruption advisories")
        raise CheckpointError(f"torch {version} cannot load checkpoints safely: its "
                              f"weights_only loader {why}",
                              f"upgrade to torch>={'.'.join(map(str, SAFE_TORCH))}")


def load(path: str, mmap: bool = False) -> Any:
    """Tensors and plain containers only (``weights_only=True``); a missing, truncated or
    foreign file, a symbolic link, or a torch older than :data:`SAFE_TORCH` raises
    CheckpointError naming it."""
    require_safe_torch()
    if os.path.islink(path):
        raise CheckpointError(f"checkpoint file {path} is a symbolic link, which a checkpoint "
                              f"may not hold")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except Exception as exc:  # zip, unpickling and storage errors alike
        reason = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ""
        raise CheckpointError(f"checkpoint file {path} cannot be read "
                              f"({type(exc).__name__}: {reason})") from None
