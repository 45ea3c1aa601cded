"""Files disttrain writes where another user could point it: flight-recorder dumps, error
records, checkpoints, calibration. A link planted at the target, or at the temporary name
the old code used, is replaced or ignored, never written through; a dump with no directory
of its own goes to a private per-user directory that must be this user's and closed to
others. No processes."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest
import torch

from disttrain import private_files
from disttrain.comm.flight_recorder import FlightRecorder
from disttrain.launch import records
from disttrain.parallel import checkpoint_files

OTHER_UID = 54321  # a user that is not this one (the tests that chown need root)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file of this user's that a planted link points to: it must stay as it is."""
    path = tmp_path / "victim"
    path.write_text("precious\n")
    return path


@pytest.fixture
def tmpdir_base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    base = tmp_path / "tmp"
    base.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(base))
    return base


def test_a_dump_under_torchrun_goes_to_a_private_directory(tmpdir_base: Path) -> None:
    path = records.flight_file(3, {})  # no DISTTRAIN_FLIGHT_DIR: torchrun, srun, mpirun
    assert path.parent == tmpdir_base / f"disttrain-{os.getuid()}"
    info = path.parent.stat()
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    FlightRecorder().write(path, rank=3)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@needs_root
def test_a_directory_another_user_made_is_refused(tmpdir_base: Path) -> None:
    squatted = tmpdir_base / f"disttrain-{os.getuid()}"
    squatted.mkdir(mode=0o700)
    os.chown(squatted, OTHER_UID, OTHER_UID)
    with pytest.raises(PermissionError, match=f"{squatted} belongs to uid {OTHER_UID}"):
        records.flight_file(0, {})


@pytest.mark.parametrize("make", ["link", "open"])
def test_a_linked_or_open_private_directory_is_refused(tmpdir_base: Path, tmp_path: Path,
                                                        make: str) -> None:
    path = tmpdir_base / f"disttrain-{os.getuid()}"
    if make == "link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        path.symlink_to(tmp_path / "elsewhere")
        expected = "is not a directory"
    else:
        path.mkdir()
        path.chmod(0o777)
        expected = r"is open to other users \(mode 777\)"
    with pytest.raises(PermissionError, match=expected):
        private_files.private_dir()


def _old_temporary(path: Path, style: str) -> Path:
    """The predictable temporary name the old writers used for ``path``."""
    if style == "records":
        return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@pytest.mark.parametrize("writer", ["flight", "error record", "checkpoint"])
def test_nothing_is_written_through_a_planted_link(tmp_path: Path, victim: Path,
                                                   writer: str) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    target = shared / "out.json"
    target.symlink_to(victim)  # at the target itself
    style = "checkpoint" if writer == "checkpoint" else "records"
    _old_temporary(target, style).symlink_to(victim)  # and at the old temporary name
    if writer == "flight":
        FlightRecorder().write(target, rank=0)
    elif writer == "error record":
        records.write_json(target, {"message": "boom"})
    else:
        checkpoint_files.atomic_save({"x": torch.ones(2)}, str(target))
    assert victim.read_text() == "precious\n"
    assert not target.is_symlink() and target.stat().st_size > 0


def test_a_failed_write_leaves_no_temporary(tmp_path: Path) -> None:
    def fail(_: object) -> None:
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        private_files.atomic_write(tmp_path / "x", fail)
    assert os.listdir(tmp_path) == []
