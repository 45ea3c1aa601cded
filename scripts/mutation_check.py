"""Plant one small fault at a time in a throwaway copy of disttrain and check a test catches it.

    python scripts/mutation_check.py              # every fault; exit 0 when each was caught
    python scripts/mutation_check.py --list       # the faults, without running anything
    python scripts/mutation_check.py --only ps-async-stale-reads,tp-sp-layernorm
    python scripts/mutation_check.py --markdown   # the result table for docs/testing.md

Each fault is an exact text replacement in one file (``old`` must occur there exactly once)
and the fast tests that should catch it. Before anything runs, every fault is checked
against the working tree: one whose ``old`` text no longer occurs exactly once (the code
moved) is named and the script exits 2, so a stale fault never passes silently. Then the
package, its tests and docs are copied to a temporary directory (the working tree is never
touched); first the tests run there unchanged (``--no-baseline`` skips that: a test that
fails anyway would "catch" everything), then for each fault the file is changed, the tests
run against the copy (``PYTHONPATH`` and the working directory point at it) until the first
failure (``pytest -x``), and the file is restored. It prints, per fault, the test that
caught it and how long that took, and exits 1 if any fault survived.

A fault is a one-line slip a reviewer could make, one per strategy at least: a sum left
where an average belongs, a missing collective in a backward, a schedule run out of order,
a worker that computes on other values than it reports, a compressor that forgets its error
feedback or its warm start.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("disttrain", "tests", "docs", "scripts", "pyproject.toml", "README.md")
TEST_TIMEOUT_S = 240  # each test (pytest-timeout): a planted hang fails, it never blocks
RUN_TIMEOUT_S = 600  # one fault's whole pytest run


@dataclass(frozen=True)
class Fault:
    name: str
    strategy: str
    path: str  # relative to the repository root
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids or files, the likeliest catcher first
    what: str


TF64 = "tests/test_train_float64.py"
MESH64 = f"{TF64}::test_tensor_parallel_meshes_in_the_loop_equal_one_process"
PIPE64 = f"{TF64}::test_deep_pipelines_in_the_loop_equal_one_process"
TP64 = "tests/test_tensor_parallel.py::" \
       "test_tensor_parallel_gradients_and_sgd_equal_single_process_in_float64"
COMPRESSION = "tests/test_train_compression.py::" \
              "test_compressed_ddp_in_the_loop_equals_its_single_process_simulation"
REPLAY = "tests/test_ps_replay.py"

FAULTS = (
    Fault("ddp-sum", "ddp", "disttrain/parallel/ddp/reducer.py",
          'self.comm.all_reduce(bucket.flat, "avg", algorithm=self.algorithm)',
          'self.comm.all_reduce(bucket.flat, "sum", algorithm=self.algorithm)',
          ("tests/test_parallel_ddp.py::test_equivalence_with_one_process_on_the_global_batch",),
          "gradients summed over ranks instead of averaged"),
    Fault("dp-tp-sum", "3d (dp × tp)", "disttrain/parallel/ddp/reducer.py",
          'self.comm.all_reduce(bucket.flat, "avg", algorithm=self.algorithm)',
          'self.comm.all_reduce(bucket.flat, "sum", algorithm=self.algorithm)',
          (f"{MESH64}[dp2-tp2]",),
          "the same sum, seen only through the dp × tp mesh"),
    Fault("zero1-sum", "zero1", "disttrain/parallel/zero/stage1.py",
          'self.comm.reduce_scatter(shard, grads, "avg", algorithm=self.config.algorithm)',
          'self.comm.reduce_scatter(shard, grads, "sum", algorithm=self.config.algorithm)',
          ("tests/test_zero_stages.py::test_stage_matches_single_process",),
          "gradient shards summed instead of averaged"),
    Fault("zero2-sum", "zero2", "disttrain/parallel/zero/stage2.py",
          'work = self.comm.reduce_scatter(out, staging, "avg", algorithm=self.algorithm,',
          'work = self.comm.reduce_scatter(out, staging, "sum", algorithm=self.algorithm,',
          ("tests/test_zero_stages.py::test_stage_matches_single_process",),
          "bucketed gradient shards summed instead of averaged"),
    Fault("zero3-first-unit-unreduced", "zero3", "disttrain/parallel/zero/stage3.py",
          "        for u in reversed(self.units):\n            if not u.launched:\n",
          "        for u in reversed(self.units):\n            if not u.launched and u.index:\n",
          ("tests/test_zero_stages.py::test_stage_matches_single_process",),
          "the end of backward skips the first unit, whose inputs need no gradient"),
    Fault("zero3-masters-not-reloaded", "zero3", "disttrain/parallel/zero/stage3.py",
          "                           for u in self.units])\n        self.reload_from_masters()\n",
          "                           for u in self.units])\n",
          ("tests/test_zero_precision.py",),
          "bf16 parameters never receive the fp32 masters' update (fp32 ones share the "
          "masters' memory: nothing to catch there)"),
    Fault("gpipe-backward-order", "gpipe", "disttrain/parallel/pipeline/schedules.py",
          "[Forward(i) for i in range(m)] + [Backward(i) for i in range(m)]",
          "[Forward(i) for i in range(m)] + [Backward(i) for i in reversed(range(m))]",
          ("tests/test_pipeline_schedules.py", f"{PIPE64}[gpipe-3-4]"),
          "GPipe's backwards run last micro-batch first"),
    Fault("pipeline-loss-weight", "gpipe, 1f1b", "disttrain/parallel/pipeline/step.py",
          "weight = len(target) / self.total_rows  # 1/m for equal micro-batches",
          "weight = 1.0",
          (f"{PIPE64}[gpipe-3-4]", "tests/test_pipeline_runtime.py"),
          "micro-batch losses summed, not weighted by their share of the batch"),
    Fault("1f1b-cool-down-reversed", "1f1b", "disttrain/parallel/pipeline/schedules.py",
          "order += [Backward(i) for i in range(m - warmup, m)]",
          "order += [Backward(i) for i in reversed(range(m - warmup, m))]",
          ("tests/test_pipeline_schedules.py", f"{PIPE64}[1f1b-3-4]"),
          "1F1B's cool-down backwards in reverse (invisible at p = 2)"),
    Fault("1f1b-warm-up", "1f1b", "disttrain/parallel/pipeline/schedules.py",
          "warmup = min(num_stages - stage - 1, m)",
          "warmup = min(num_stages - stage, m)",
          ("tests/test_pipeline_schedules.py",),
          "one warm-up forward too many (more activations held)"),
    Fault("tp-f-backward", "tp", "disttrain/parallel/tensor/ops.py",
          "return ctx.group.all_reduce(_contiguous(grad)), None",
          "return _contiguous(grad), None",
          (TP64, "tests/test_tensor_parallel.py"),
          "f's backward forgets its all-reduce over the group"),
    Fault("tp-sp-gather-backward", "tp-sp", "disttrain/parallel/tensor/ops.py",
          "return ctx.group.reduce_scatter(grad), None",
          "return ctx.group.reduce_scatter(grad) / ctx.group.size, None",
          (TP64,),
          "sequence all-gather's backward averages instead of summing (1/tp)"),
    Fault("tp-sp-layernorm", "tp-sp", "disttrain/parallel/tensor/ops.py",
          "    group.all_reduce(flat)\n",
          "    group.all_reduce(flat)\n    flat /= group.size\n",
          (TP64, f"{MESH64}[tp-sp-3]"),
          "LayerNorm gradients under sequence parallelism 1/tp too small"),
    Fault("ps-sync-sum", "ps-sync", "disttrain/parallel/parameter_server/shard.py",
          "self.param.grad = pending.grad / max(1, len(pending.pulled_versions))",
          "self.param.grad = pending.grad",
          ("tests/test_ps_training.py::test_sync_equals_one_process_on_the_global_batch",),
          "a clock's pushes summed instead of averaged"),
    Fault("ps-async-stale-reads", "ps-async", "disttrain/parallel/parameter_server/worker.py",
          "            scatter_flat(self.params, self.partition, offset, values)\n",
          "            if self.config.mode != \"async\" or self.clock % 2 == 0:\n"
          "                scatter_flat(self.params, self.partition, offset, values)\n",
          (REPLAY,),
          "an async worker keeps its old values on every other pull"),
    Fault("ps-async-rate", "ps-async", "disttrain/parallel/parameter_server/config.py",
          "return 1.0 / mean if mean > 1.0 else 1.0",
          "return 1.0 / (mean + 1.0)",
          (REPLAY,),
          "the staleness-aware rate off by one update"),
    Fault("ps-ssp-bound", "ps-ssp", "disttrain/parallel/parameter_server/config.py",
          "return self.bound is None or self.slowest >= clock - self.bound",
          "return self.bound is None or self.slowest >= clock - self.bound - 1",
          ("tests/test_ps_units.py", "tests/test_ps_training.py::"
           "test_ssp_reads_hold_every_update_older_than_the_bound_and_all_that_arrived"),
          "SSP lets a worker run one clock further ahead than its bound"),
    Fault("fp16-sum", "fp16", "disttrain/parallel/ddp/compression.py",
          "return payload.div_(world_size) if world_size > 1 else payload",
          "return payload",
          (f"{COMPRESSION}[fp16]",),
          "16-bit payloads summed, not averaged"),
    Fault("bf16-is-fp16", "bf16", "disttrain/parallel/ddp/compression.py",
          "return CastCompressor(torch.bfloat16)",
          "return CastCompressor(torch.float16)",
          (f"{COMPRESSION}[bf16]",),
          "--compression bf16 sends fp16"),
    Fault("topk-no-error-feedback", "topk", "disttrain/parallel/ddp/compression.py",
          "            flat.add_(residual)  # acc = grad + what earlier steps did not send\n",
          "            pass\n",
          (f"{COMPRESSION}[topk]",),
          "top-k never adds back what it did not send"),
    Fault("powersgd-no-warm-start", "powersgd", "disttrain/parallel/ddp/compression.py",
          "if not self.warm_start:",
          "if True:",
          (f"{COMPRESSION}[powersgd]",),
          "PowerSGD redraws Q every step instead of warm-starting"),
    Fault("shm-all-reduce-drops-a-rank", "shm all-reduce",
          "disttrain/comm/transports/shm/all_reduce.py",
          "        for r in range(2, p):\n            kernel(mine, slots[r][s0:s1], "
          "out=mine)\n",
          "        for r in range(2, p - 1):\n            kernel(mine, slots[r][s0:s1], "
          "out=mine)\n",
          ("tests/test_shm_collectives.py::test_shm_algorithm_matches_torch",),
          "the two-phase all-reduce leaves out the last rank's segment (p ≥ 3)"),
)


@dataclass
class Outcome:
    fault: Fault
    caught_by: str | None
    seconds: float


# ---------------------------------------------------------------- the checks
def stale(faults: list[Fault], root: Path) -> list[str]:
    """One line per fault whose ``old`` text does not occur exactly once in its file."""
    problems = []
    for f in faults:
        path = root / f.path
        count = path.read_text().count(f.old) if path.exists() else -1
        if count != 1:
            where = "the file is gone" if count < 0 else f"its text occurs {count} times"
            problems.append(f"{f.name}: {f.path}: {where} (the code moved: update the fault)")
    return problems


def copy_tree(into: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".mypy_cache", ".ruff_cache")
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, into / name, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, into / name)


def run_tests(copy: Path, tests: tuple[str, ...]) -> tuple[int, str]:
    """pytest on ``tests`` in ``copy`` until the first failure: (exit status, output)."""
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    argv = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
            "-o", "addopts=", "-rfE", f"--timeout={TEST_TIMEOUT_S}", *tests]
    try:
        done = subprocess.run(argv, cwd=copy, env=env, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else ""
        return -1, out + f"\n(no answer in {RUN_TIMEOUT_S} s)"
    return done.returncode, done.stdout + done.stderr


def first_failure(output: str) -> str | None:
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" ", 1)[1].split(" - ", 1)[0]
    return None


def try_fault(copy: Path, fault: Fault) -> Outcome:
    path = copy / fault.path
    original = path.read_text()
    path.write_text(original.replace(fault.old, fault.new, 1))
    begin = time.monotonic()
    try:
        status, output = run_tests(copy, fault.tests)
    finally:
        path.write_text(original)
    seconds = time.monotonic() - begin
    if status == 0:
        return Outcome(fault, None, seconds)
    if status == -1:
        return Outcome(fault, "a hang (the run's time limit)", seconds)
    if status in (4, 5):  # usage error, no test collected: the fault's test list is wrong
        raise SystemExit(f"{fault.name}: pytest could not run {fault.tests} "
                         f"(exit {status}):\n{output[-2000:]}")
    return Outcome(fault, first_failure(output) or f"pytest exit {status}", seconds)


# ---------------------------------------------------------------- output
def table(outcomes: list[Outcome], markdown: bool) -> str:
    """One row per fault: its name, strategy, what it breaks and the test that caught it
    (Markdown, for docs/architecture.md), or name, strategy, seconds and the test (text)."""
    if markdown:
        lines = ["| fault | strategy | what it breaks | caught by |", "|---|---|---|---|"]
        lines += [f"| `{o.fault.name}` | {o.fault.strategy} | {o.fault.what} | "
                  f"{f'`{o.caught_by}`' if o.caught_by else '**SURVIVED**'} |"
                  for o in outcomes]
        return "\n".join(lines)
    return "\n".join(f"{o.fault.name:<28} {o.fault.strategy:<14} {o.seconds:4.0f}s  "
                     f"{o.caught_by or 'SURVIVED'}" for o in outcomes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the faults and exit")
    parser.add_argument("--only", help="comma-separated fault names")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the run of the faults' tests on the unchanged copy")
    parser.add_argument("--markdown", action="store_true", help="the table as Markdown")
    args = parser.parse_args(argv)
    faults = list(FAULTS)
    if args.only:
        names = args.only.split(",")
        unknown = sorted(set(names) - {f.name for f in faults})
        if unknown:
            parser.error(f"unknown faults {unknown}; --list shows them")
        faults = [f for f in faults if f.name in names]
    if args.list:
        for f in faults:
            print(f"{f.name:<28} {f.strategy:<14} {f.path}: {f.what}")
        return 0
    problems = stale(faults, ROOT)
    if problems:
        print("faults that no longer apply:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    begin = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="disttrain-mutants-") as tmp:
        copy = Path(tmp)
        copy_tree(copy)
        if not args.no_baseline:
            tests = tuple(dict.fromkeys(t for f in faults for t in f.tests))
            status, output = run_tests(copy, tests)
            print(f"baseline: the faults' tests on the unchanged copy: "
                  f"{'pass' if status == 0 else 'FAIL'} ({time.monotonic() - begin:.0f} s)",
                  flush=True)
            if status != 0:
                print(output[-3000:], file=sys.stderr)
                return 3
        outcomes = []
        for fault in faults:
            outcome = try_fault(copy, fault)
            outcomes.append(outcome)
            print(f"{fault.name:<28} {outcome.seconds:5.0f}s  "
                  f"{outcome.caught_by or 'SURVIVED'}", flush=True)
    survivors = [o.fault.name for o in outcomes if o.caught_by is None]
    print()
    print(table(outcomes, args.markdown))
    print(f"\n{len(outcomes) - len(survivors)} of {len(outcomes)} faults caught in "
          f"{time.monotonic() - begin:.0f} s" + (f"; SURVIVED: {', '.join(survivors)}"
                                                 if survivors else ""))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
