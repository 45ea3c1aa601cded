"""The README's commands and Python snippet stay true (a snippet that rots is a defect)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_opens_with_exactly_the_two_commands():
    first = _blocks("sh")[0].strip().splitlines()
    assert len(first) == 2
    assert first[0].endswith("disttrain bench") and "pip install" in first[0]
    assert "pytest" in first[1] and "pip install" in first[1]
    assert "torch==2.13.0" in first[0] and "torch==2.13.0" in first[1]


def test_python_snippet_runs_as_a_world_of_one(tmp_path):
    (snippet,) = _blocks("python")
    script = tmp_path / "snippet.py"
    script.write_text(snippet)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "'calls': 2" in done.stdout  # the stats line reports both all-reduces


def test_python_snippet_runs_on_two_ranks_under_disttrain_launch(tmp_path):
    (snippet,) = _blocks("python")
    script = tmp_path / "snippet.py"
    script.write_text(snippet)
    done = subprocess.run([sys.executable, "-m", "disttrain", "launch", "-n", "2", str(script)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert done.stdout.count("'calls': 2") == 2, done.stdout[-2000:]
