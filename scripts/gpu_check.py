"""disttrain on one CUDA GPU: every check this machine can make, one PASS/FAIL line each.

    python3 scripts/gpu_check.py                 # on a machine with a CUDA GPU (< 6 minutes)
    python3 scripts/gpu_check.py --cpu-dry-run   # the same checks on the CPU
    python3 scripts/gpu_check.py --cpu-dry-run --quick   # a few of each group (CI)
    python3 scripts/gpu_check.py --only single,nccl --list

What each check proves is in docs/gpu.md. The checks run in groups, each group in a child
process of its own with a time limit, and every check inside it has its own limit too: a
hang is a FAIL line, never a stuck script. Two-rank checks run in one pool of rank processes
per world size (Gloo, both ranks on GPU 0: NCCL refuses two ranks on one GPU), so a check
costs its training, not a process start. Exit status: 0 when every check passed, 1
otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from gpu_check_groups import GROUPS
from gpu_check_lib import GROUP_S, ROOT, Options, check_names, say, time_limit

# ---------------------------------------------------------------- the parent
NEEDED = ("numpy", "torch", "disttrain.cli")  # scikit-learn is not: the data are synthetic


def preflight() -> str | None:
    """One line naming the first module this machine cannot import, or None."""
    import importlib

    for name in NEEDED:
        try:
            importlib.import_module(name)
        except Exception as exc:  # ImportError, or a module that fails while importing
            reason = str(exc).strip().splitlines()
            return (f"gpu_check: cannot import {name} ({type(exc).__name__}: "
                    f"{reason[-1] if reason else ''}); install it beside torch (disttrain "
                    f"from this checkout: pip install --no-deps -e .), then run again")
    return None


def run_group(group: str, opts: Options, flags: list[str]) -> tuple[int, int]:
    """Run ``group`` in a child process; relay its lines; a check that never reported (the
    child crashed or overran) is a FAIL. Returns (passed, failed)."""
    expected = check_names(group, opts)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, os.path.abspath(__file__), "--group", group, *flags]
    seen: dict[str, str] = {}
    start = time.monotonic()
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                          start_new_session=True) as child:
        assert child.stdout is not None
        try:
            with time_limit(GROUP_S[group] * opts.slack):
                for line in child.stdout:
                    print(line, end="", flush=True)
                    fields = line.split()
                    if len(fields) >= 2 and fields[0] in ("PASS", "FAIL"):
                        seen[fields[1]] = fields[0]
                child.wait()
        except TimeoutError:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    for name in expected:
        if name not in seen:
            seen[name] = "FAIL"
            say("FAIL", name, time.monotonic() - start,
                f"never reported: group {group!r} ended (exit {child.returncode}) first")
    failed = sum(1 for v in seen.values() if v == "FAIL")
    return len(seen) - failed, failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="run the same checks on the CPU (Gloo instead of NCCL for the "
                             "one-rank group): to keep this script working without a GPU")
    parser.add_argument("--only", default=None,
                        help=f"comma-separated groups: {', '.join(GROUPS)} (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="a few checks of each group, fewer steps (the CI test)")
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    parser.add_argument("--group", help=argparse.SUPPRESS)  # a child process runs one group
    args = parser.parse_args(argv)
    opts = Options("cpu" if args.cpu_dry_run else "cuda",
                   "gloo" if args.cpu_dry_run else "nccl", args.quick)
    flags = (["--cpu-dry-run"] if args.cpu_dry_run else []) + (["--quick"] if args.quick
                                                               else [])
    if args.group:
        GROUPS[args.group](opts)
        return 0
    groups = list(GROUPS) if args.only is None else [g.strip() for g in args.only.split(",")]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        parser.error(f"unknown group(s) {unknown}; choose from {', '.join(GROUPS)}")
    if args.list:
        for g in groups:
            print(f"{g}: " + ", ".join(check_names(g, opts)))
        return 0
    missing = preflight()
    if missing is not None:
        print(missing, file=sys.stderr)
        return 2
    if not args.cpu_dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: torch finds no CUDA GPU here; run with --cpu-dry-run to check "
                  "the script itself on the CPU", file=sys.stderr)
            return 2
    start = time.monotonic()
    passed = failed = 0
    for group in groups:
        p, f = run_group(group, opts, flags)
        passed, failed = passed + p, failed + f
    print(json.dumps({"passed": passed, "failed": failed,
                      "seconds": round(time.monotonic() - start, 1),
                      "device": opts.device}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
