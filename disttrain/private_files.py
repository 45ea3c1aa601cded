"""Writing files where another user could point disttrain: never through their link.

A file is written under a fresh random name in its directory, created with ``O_EXCL`` and
``O_NOFOLLOW`` (so nothing that already exists there, a symbolic link least of all, is
opened), then renamed over the target: a rename replaces a link at the target itself, never
the file it points to, and a reader sees the old file or the complete new one::

    dir/.name.3f9c0a1b.tmp   O_CREAT | O_EXCL | O_NOFOLLOW, written (fsync'd if durable)
    dir/name                 ← rename (atomic; a link named dir/name is replaced, not followed)

Files with no directory of their own (a flight-recorder dump under torchrun, srun or
mpirun) go to :func:`private_dir`: ``$TMPDIR/disttrain-<uid>``, created 0700 and, when it
exists already, used only if it is a real directory (not a link) that this user owns and no
one else may enter. A directory another user made under that name is refused, naming it.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(
    os, "O_CLOEXEC", 0)


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], object], *,
                 mode: int = 0o666, durable: bool = False) -> Path:
    """Write ``path`` through ``write(file)`` as the module docstring says; ``mode`` (before
    the umask) for the new file; ``durable``: fsync the file and its directory (a crash
    then leaves the old file or the new one). Nothing is left behind on an error."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, _FLAGS, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        fsync_directory(str(path.parent))
    return path


def write_text(path: str | os.PathLike[str], text: str, *, mode: int = 0o666) -> Path:
    """:func:`atomic_write` of ``text`` (UTF-8)."""
    return atomic_write(path, lambda f: f.write(text.encode()), mode=mode)


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


def private_dir(base: str | None = None) -> Path:
    """This user's own directory under ``base`` (default: the temp dir), made on first use:
    ``disttrain-<uid>``, mode 0700. PermissionError, naming it and the fix, when it exists
    but is a link, is not a directory, belongs to someone else or is open to others."""
    uid = os.getuid()
    path = Path(base or tempfile.gettempdir()) / f"disttrain-{uid}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    problem = None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory (a symbolic link, or a file)"
    elif info.st_uid != uid:
        problem = f"belongs to uid {info.st_uid}, not to this user (uid {uid})"
    elif info.st_mode & 0o077:
        problem = f"is open to other users (mode {stat.S_IMODE(info.st_mode):o})"
    if problem is not None:
        raise PermissionError(f"{path} {problem}: disttrain writes only into a directory of "
                              f"this user's that no one else may enter; remove it (or chmod "
                              f"700 it, if it is yours) or set DISTTRAIN_FLIGHT_DIR")
    return path
