"""scripts/gpu_check.sh, the check a GPU machine runs, kept working on the CPU: its quick dry
run passes here, and a check that fails or hangs is a FAIL line and a non-zero exit."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _modules():
    """scripts/gpu_check_lib.py and gpu_check_groups.py (the script's own imports)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return importlib.import_module("gpu_check_lib"), importlib.import_module(
            "gpu_check_groups")
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def hiding(tmp_path: Path, module: str) -> dict[str, str]:
    """An environment in which ``import module`` fails, as on a machine without it."""
    fake = tmp_path / module
    fake.mkdir()
    (fake / "__init__.py").write_text(f"raise ImportError('{module} is hidden by the test')\n")
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": path}


def test_the_quick_dry_run_passes_every_check_without_scikit_learn(tmp_path):
    env = hiding(tmp_path, "sklearn")  # the GPU machine has torch, not scikit-learn
    done = subprocess.run([str(SCRIPT), "--cpu-dry-run", "--quick"], capture_output=True,
                          text=True, env=env, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line[:4] in ("PASS", "FAIL")]
    names = [line.split()[1] for line in lines]
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert all(line.startswith("PASS") for line in lines), done.stdout
    lib, groups = _modules()
    options = lib.Options("cpu", "gloo", quick=True)
    assert names == [n for g in groups.GROUPS for n in lib.check_names(g, options)]
    assert '"failed": 0' in done.stdout.splitlines()[-1]


def test_a_missing_import_is_named_in_one_line_before_any_check(tmp_path):
    done = subprocess.run([str(SCRIPT), "--cpu-dry-run"], capture_output=True, text=True,
                          env=hiding(tmp_path, "numpy"), timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot import numpy" in lines[0], done.stderr
    assert "PASS" not in done.stdout and "FAIL" not in done.stdout


def test_the_full_check_covers_every_strategy_at_two_and_three_ranks():
    lib, _ = _modules()
    names = lib.check_names("ranks", lib.Options("cuda", "nccl"))
    for strategy in ("ddp", "zero1", "zero2", "zero3", "gpipe", "1f1b", "model-parallel",
                     "tp", "tp-sp", "3d", "torch-ddp", "torch-zero1", "torch-fsdp",
                     "torch-tp", "torch-tp-sp"):
        assert {f"gloo-2rank:{strategy}", f"gloo-3rank:{strategy}"} <= set(names), strategy
    assert "gloo-2rank:async-avg-side-stream" in names
    assert lib.check_names("cli", lib.Options("cuda", "nccl")) == ["cli:run",
                                                                    "cli:checkpoint-resume"]
    assert all(n.startswith("nccl-smoke:") for n in lib.check_names("nccl",
                                                                   lib.Options("cuda", "nccl")))
    assert sum(lib.GROUP_S.values()) <= 360  # the script bounds itself to the 6 minutes


def test_a_failing_or_hanging_check_is_a_fail_line(capsys):
    lib, _ = _modules()

    def wrong() -> str:
        raise lib.CheckFailed("rank 1 differs from the single process")

    lib.run_check("demo:wrong", wrong, 5)
    start = time.monotonic()
    lib.run_check("demo:hang", lambda: time.sleep(60) or "", 1)
    assert time.monotonic() - start < 10
    lib.run_check("demo:fine", lambda: "ok", 5)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("FAIL  demo:wrong") and "differs" in out[0]
    assert out[1].startswith("FAIL  demo:hang") and "TimeoutError" in out[1]
    assert out[2].startswith("PASS  demo:fine")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is here")
def test_without_a_gpu_the_full_check_says_so_and_exits_2():
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run([str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert "no CUDA GPU" in done.stderr and "--cpu-dry-run" in done.stderr
