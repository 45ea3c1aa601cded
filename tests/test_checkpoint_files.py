"""Corrupt, incomplete and foreign checkpoints are refused in one line that names the file and
says what to do (exit 2 from ``disttrain run --resume``, nothing written); writes are atomic.

Each case damages a copy of one small checkpoint the way a full disk, a crash or a bad copy
would, then resumes from it through the CLI.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from disttrain.cli import main
from disttrain.parallel import checkpoint_files
from disttrain.parallel.checkpoint_files import CheckpointError
from disttrain.train import TrainConfig
from tests.test_train_cli import disttrain
from tests.test_train_loop import rank_train

RUN = ["run", "--strategy", "single", "--model", "mlp", "--dataset", "digits",
       "--global-batch", "64", "--log-every", "0", "--no-progress", "--eval-every", "0"]


def snapshot(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("saved")
    assert main([*RUN, "--steps", "2", "--checkpoint-dir", str(directory)]) == 0
    assert (directory / "latest").read_text() == "step-00000002"
    return directory


def resume_fails(directory: Path, capfd: pytest.CaptureFixture[str]) -> str:
    """Resume from ``directory``: exit 2, nothing written; returns the one error line."""
    before = snapshot(directory)
    capfd.readouterr()
    assert main([*RUN, "--steps", "4", "--checkpoint-dir", str(directory), "--resume"]) == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and lines[0].startswith("disttrain run: error: "), err
    assert snapshot(directory) == before
    return lines[0]


def damaged_copy(saved: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(saved, copy)
    return copy


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def tensor_offset(path: Path) -> int:
    """Where the bytes of the file's largest tensor start (stored uncompressed)."""
    state = torch.load(path, weights_only=True)
    tensors = [t for t in _tensors(state) if t.numel() > 8]
    raw = max(tensors, key=lambda t: t.numel()).contiguous().numpy().tobytes()
    offset = path.read_bytes().find(raw)
    assert offset > 0
    return offset + len(raw) // 2


def _tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


STEP = "step-00000002"


@pytest.mark.parametrize("name", ["universal/rank-00000.pt", "universal/rank-00000.json",
                                  "meta.pt", "rank-00000.pt"])
def test_truncated_file_is_named(saved, tmp_path, capfd, name):
    directory = damaged_copy(saved, tmp_path)
    truncate(directory / STEP / name)
    line = resume_fails(directory, capfd)
    assert f"checkpoint file {directory / STEP / name} is damaged" in line
    assert "start afresh in another --checkpoint-dir" in line


@pytest.mark.parametrize("where", ["header", "tensor"])
def test_flipped_bytes_are_detected(saved, tmp_path, capfd, where):
    directory = damaged_copy(saved, tmp_path)
    state = directory / STEP / "universal" / "rank-00000.pt"
    flip(state, 0 if where == "header" else tensor_offset(state))
    line = resume_fails(directory, capfd)
    assert f"checkpoint file {state} is damaged: its SHA-256 differs" in line


def test_an_earlier_checkpoint_is_suggested(saved, tmp_path, capfd):
    directory = damaged_copy(saved, tmp_path)
    shutil.copytree(directory / STEP, directory / "step-00000001")
    truncate(directory / STEP / "meta.pt")
    line = resume_fails(directory, capfd)
    assert (f"to resume from an earlier checkpoint write its name (step-00000001) into "
            f"{directory / 'latest'}") in line


@pytest.mark.parametrize(("content", "expected"), [
    (b"step-00000099", "names step-00000099, which is not in"),
    (b"\xff\xfe\x00garbage\n", "does not name a checkpoint (it holds b'\\xff\\xfe"),
    (b"../elsewhere", "does not name a checkpoint"),
])
def test_latest_that_names_no_checkpoint(saved, tmp_path, capfd, content, expected):
    directory = damaged_copy(saved, tmp_path)
    (directory / "latest").write_bytes(content)
    line = resume_fails(directory, capfd)
    assert f"{directory / 'latest'} " in line and expected in line


@pytest.mark.parametrize("damage", ["no manifest", "garbage manifest", "foreign manifest",
                                    "missing file"])
def test_incomplete_or_foreign_checkpoint_is_refused(saved, tmp_path, capfd, damage):
    directory = damaged_copy(saved, tmp_path)
    manifest = directory / STEP / "manifest.json"
    if damage == "no manifest":
        manifest.unlink()
        expected = f"checkpoint {directory / STEP} has no manifest.json"
    elif damage == "garbage manifest":
        manifest.write_bytes(b"\x00\x01{")
        expected = f"checkpoint manifest {manifest} is damaged"
    elif damage == "foreign manifest":
        manifest.write_text('{"format": "other/1", "files": {}}')
        expected = "is not a disttrain checkpoint manifest (format 'other/1'"
    else:
        (directory / STEP / "rank-00000.pt").unlink()
        expected = f"checkpoint file {directory / STEP / 'rank-00000.pt'} is missing"
    assert expected in resume_fails(directory, capfd)


def rewrite_manifest(step: Path, change: Any) -> None:
    """Apply ``change(files)`` to ``step``'s manifest records (name → record)."""
    manifest = step / "manifest.json"
    data = json.loads(manifest.read_text())
    change(data["files"])
    manifest.write_text(json.dumps(data))


def _unlisted(step: Path, outside: Path) -> str:
    shutil.copy(step / "meta.pt", step / "extra.pt")
    return f"checkpoint file {step / 'extra.pt'} is not listed in {step / 'manifest.json'}"


def _partial(step: Path, outside: Path) -> str:
    rewrite_manifest(step, lambda files: files.pop("rank-00000.pt"))
    return f"checkpoint file {step / 'rank-00000.pt'} is not listed in"


def _empty(step: Path, outside: Path) -> str:
    rewrite_manifest(step, lambda files: files.clear())
    return f"checkpoint manifest {step / 'manifest.json'} lists no files"


def _escaping(step: Path, outside: Path) -> str:
    shutil.copy(step / "meta.pt", outside / "meta.pt")  # listed as ../outside/meta.pt
    rewrite_manifest(step, lambda files: files.update({"../outside/meta.pt": files["meta.pt"]}))
    return f"names '../{outside.name}/meta.pt', which is not a file inside {step}"


def _linked_file(step: Path, outside: Path) -> str:
    shard = step / "universal" / "rank-00000.pt"
    shutil.move(shard, outside / "state.pt")
    shard.symlink_to(outside / "state.pt")  # the same bytes, through a link
    return f"checkpoint file {shard} is a symbolic link"


def _linked_directory(step: Path, outside: Path) -> str:
    shutil.copy(step / "meta.pt", outside / "meta.pt")
    (step / "sub").symlink_to(outside, target_is_directory=True)
    rewrite_manifest(step, lambda files: files.update({"sub/meta.pt": files["meta.pt"]}))
    return f"checkpoint file {step / 'sub'} is a symbolic link"


@pytest.mark.parametrize("damage", [_unlisted, _partial, _empty, _escaping, _linked_file,
                                    _linked_directory])
def test_a_manifest_must_cover_the_checkpoint_exactly(saved, tmp_path, capfd, damage):
    """Each case resumed before: the files the loader reads are intact, but one was not
    listed, listed outside the checkpoint, or read through a link."""
    directory = damaged_copy(saved, tmp_path)
    outside = directory / "outside"  # ../outside from the step directory
    outside.mkdir()
    expected = damage(directory / STEP, outside)
    assert expected in resume_fails(directory, capfd)


@pytest.mark.parametrize(("version", "refused"), [
    ("2.4.0", "runs code from the file (CVE-2025-32434)"), ("2.5.1", "CVE-2025-32434"),
    ("2.9.1", "memory-corruption advisories"), ("2.10.0", None), ("2.13.0+cpu", None),
    ("3.0.0", None), ("2.10.0a0+git1234", None),
])
def test_a_torch_with_an_unsafe_loader_is_refused(tmp_path, monkeypatch, version, refused):
    path = tmp_path / "state.pt"
    checkpoint_files.atomic_save({"x": torch.ones(3)}, str(path))
    monkeypatch.setattr(torch, "__version__", version)
    if refused is None:
        assert torch.equal(checkpoint_files.load(str(path))["x"], torch.ones(3))
        return
    with pytest.raises(CheckpointError) as err:
        checkpoint_files.load(str(path))
    assert str(err.value) == (f"torch {version} cannot load checkpoints safely: its "
                              f"weights_only loader {refused}; upgrade to torch>=2.10") \
        or refused in str(err.value)
    assert "\n" not in str(err.value) and f"torch {version} " in str(err.value)
    assert str(err.value).endswith("; upgrade to torch>=2.10")


def test_a_pickle_is_never_executed(tmp_path):
    """A file that needs arbitrary unpickling is refused by name, never run."""
    path = tmp_path / "evil.pt"
    torch.save({"x": Path("/")}, path)  # a class torch's weights-only loader does not allow
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint file {path} cannot be read")):
        checkpoint_files.load(str(path))


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "state.pt"
    checkpoint_files.atomic_save({"x": torch.ones(3)}, str(path))

    class Unsaveable:
        def __reduce__(self) -> tuple[object, ...]:
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        checkpoint_files.atomic_save({"x": Unsaveable()}, str(path))
    assert os.listdir(tmp_path) == ["state.pt"]
    assert torch.equal(checkpoint_files.load(str(path))["x"], torch.ones(3))


def test_zero_shard_damaged_on_two_ranks_is_refused(pools, tmp_path):
    """Rank 1's slices are verified inside the ranks (each hashes its share of the
    files): the parent reports the rank's one line and exits 2."""
    config = TrainConfig(model="mlp", strategy="zero2", global_batch=64, steps=1, log_every=0,
                         progress=False, eval_every=0, checkpoint_dir=str(tmp_path))
    pools(2).run(rank_train, config)
    shard = tmp_path / "step-00000001" / "universal" / "rank-00001.pt"
    flip(shard, tensor_offset(shard))
    before = snapshot(tmp_path)
    proc = disttrain("run", "--strategy", "zero2", "-n", "2", "--model", "mlp",
                     "--global-batch", "64", "--log-every", "0", "--no-progress",
                     "--eval-every", "0", "--checkpoint-dir", str(tmp_path), "--steps", "2",
                     "--resume")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"disttrain run: error: checkpoint file {shard} is damaged: its SHA-256 differs")
    assert "Traceback" not in proc.stderr
    assert snapshot(tmp_path) == before


def test_a_crash_while_saving_leaves_latest_loadable(tmp_path, monkeypatch):
    """The run dies after writing step 4's files but before sealing them: ``latest`` still
    names step 2, which resumes; step 4's directory is refused as incomplete."""
    from disttrain.train import checkpoint, train

    config = TrainConfig(model="mlp", global_batch=64, steps=4, checkpoint_every=2,
                         log_every=0, progress=False, eval_every=0,
                         checkpoint_dir=str(tmp_path))
    real_seal, calls = checkpoint_files.seal, []

    def crash_on_second(*args: object) -> None:
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed while saving")
        real_seal(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(checkpoint_files, "seal", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        train(config)
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text() == "step-00000002"
    assert (tmp_path / "step-00000004" / "universal" / "rank-00000.pt").exists()
    with pytest.raises(CheckpointError, match=r"step-00000004 has no manifest\.json"):
        checkpoint_files.verify(str(tmp_path / "step-00000004"))
    assert checkpoint.latest(str(tmp_path)) == str(tmp_path / "step-00000002")
    resumed = train(dataclasses.replace(config, resume=True))
    assert resumed.start_step == 2 and resumed.steps == 4
    assert (tmp_path / "latest").read_text() == "step-00000004"
    checkpoint_files.verify(str(tmp_path / "step-00000004"))
