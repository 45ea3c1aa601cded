"""``disttrain bench pipeline``: the measured bubble of GPipe and 1F1B against (p − 1)/(m + p − 1),
and of interleaved 1F1B (``--virtual-stages v``) against (p − 1)/(v·m + p − 1).

For each number of stages p the parent starts p local ranks (:mod:`disttrain.bench.ranks`);
they build a *balanced* synthetic model (the same layers on every stage), run each schedule
with each micro-batch count m. Interleaved, the same model is cut into p·v pieces of
``layers / v`` layers (so ``layers`` must be a multiple of v): each rank computes as much as
without chunks, in v chunks, and sends v times as many messages; rows whose m is not a
multiple of p (which Megatron-LM's order needs) are left out.

Each stage runs ``steps`` consecutive steps as a training loop does (no barrier between
them), takes each step's *period* (from its start to the start of the next: in steady
state every stage's period is the pipeline's step) as ``wall``, and splits it into::

    busy      inside its forwards and backwards (measured by the Stage)
    idle      blocked waiting for a neighbour: in a receive or the end-of-step send wait
              (measured by the StageLink)                            ← the bubble
    overhead  the rest: packing, posting and unpacking messages, Python bookkeeping,
              the loop between steps

and reports ``idle / wall`` per stage against theory, (p − 1)/(v·m + p − 1), as well as
``1 − busy/wall`` (idle and overhead together) and the overhead per micro-batch. Overhead
makes every micro-batch slot longer on every stage alike, so it stretches the step without
changing the idle share; the time messages spend in flight does show up as idle. (Steps
are not timed alone between barriers: the barriers' latency and exit skew would count as
idle time that a training loop does not have.)

What a layer computes (``compute``):

* ``sleep``: each stage's forward and backward of one micro-batch *sleep* for
  ``forward_ms`` / ``backward_ms``. A sleeping stage uses no CPU, so p stages overlap as on
  p separate devices even when p exceeds the cores (on a 2-core machine, p = 4 stages that
  really computed would share 2 cores and the measured idle would reflect the CPU sharing,
  not the schedule). What remains beside the schedule is the real messaging between the
  stages, which adds to the idle time.
* ``matmul``: real compute, ``layers`` Linear + Tanh of ``width`` features per stage. Honest
  only when every stage has a core of its own (p ≤ cores, on an otherwise idle machine).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from disttrain.bench.ranks import RankGroup
from disttrain.bench.transports import check_transport
from disttrain.comm import Communicator
from disttrain.flags import RowWriter, add_alias, add_json_argument

Row = dict[str, Any]
COMPUTES = ("sleep", "matmul")


@dataclass(frozen=True)
class PipelineBenchConfig:
    """What to measure; every (stages, schedule, micro-batches) combination is one row."""

    stages: tuple[int, ...] = (2, 4)
    microbatches: tuple[int, ...] = (1, 2, 4, 8, 16)
    schedules: tuple[str, ...] = ("gpipe", "1f1b")
    virtual_stages: tuple[int, ...] = (1,)  # v: chunks per stage (v > 1: 1f1b interleaved)
    compute: str = "sleep"
    forward_ms: float = 20.0  # sleep: one stage's forward of one micro-batch
    backward_ms: float = 20.0  # sleep: its backward
    layers: int = 2  # per stage
    width: int = 256  # features of every layer's input and output
    rows: int = 32  # samples per micro-batch
    steps: int = 3  # timed consecutive steps per row (medians reported)
    warmup: int = 1  # untimed steps before them
    transport: str = "torch"
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        from disttrain.parallel.pipeline import SCHEDULES

        if not self.stages or min(self.stages) < 2:
            raise ValueError(f"stages must be ≥ 2 (one stage has no bubble), got "
                             f"{list(self.stages)}")
        if not self.microbatches or min(self.microbatches) < 1:
            raise ValueError(f"micro-batch counts must be ≥ 1, got {list(self.microbatches)}")
        bad = [s for s in self.schedules if s not in SCHEDULES]
        if bad or not self.schedules:
            raise ValueError(f"unknown or missing schedules {bad}; choose from "
                             f"{', '.join(sorted(SCHEDULES))}")
        if not self.virtual_stages or min(self.virtual_stages) < 1:
            raise ValueError(f"virtual stage counts must be ≥ 1, got {list(self.virtual_stages)}")
        chunked = [v for v in self.virtual_stages if v > 1]
        if chunked and "1f1b" not in self.schedules:
            raise ValueError(f"--virtual-stages {max(chunked)} interleaves 1f1b; add 1f1b to "
                             f"--schedules")
        uneven = [v for v in chunked if self.layers % v]
        if uneven:
            raise ValueError(f"{self.layers} layers per stage do not cut into {uneven[0]} "
                             f"chunks: use a --layers that is a multiple of every virtual "
                             f"stage count")
        if self.compute not in COMPUTES:
            raise ValueError(f"compute must be one of {', '.join(COMPUTES)}, got "
                             f"{self.compute!r}")
        if min(self.forward_ms, self.backward_ms) < 0 or self.forward_ms + self.backward_ms <= 0:
            raise ValueError("forward_ms and backward_ms must be ≥ 0 and not both 0")
        if min(self.layers, self.width, self.rows, self.steps) < 1 or self.warmup < 0:
            raise ValueError("layers, width, rows and steps must be ≥ 1, warmup ≥ 0")
        if self.timeout_s <= 0:
            raise ValueError("timeout must be > 0 seconds")
        check_transport(self.transport)


def theory(p: int, m: int, v: int = 1) -> float:
    """The bubble: each stage idles (p − 1)/(m + p − 1) of a step (balanced stages, free
    messages; the same for GPipe and 1F1B), (p − 1)/(v·m + p − 1) with v chunks per stage
    (interleaved 1F1B)."""
    return (p - 1) / (v * m + p - 1)


class _Sleep(torch.autograd.Function):
    """Identity that sleeps ``forward_s`` in forward and ``backward_s`` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float,  # type: ignore[override]
                backward_s: float) -> torch.Tensor:
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepLayer(nn.Module):
    """A layer whose "compute" is a fixed sleep: ``x · scale`` (a parameter, so every stage
    has a backward to run), slept over."""

    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.forward_s, self.backward_s = forward_s, backward_s
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _Sleep.apply(x * self.scale, self.forward_s, self.backward_s)
        return out


def synthetic_model(config: PipelineBenchConfig, p: int) -> nn.Sequential:
    """``layers`` identical layers per stage for ``p`` stages: balanced by construction."""
    torch.manual_seed(0)
    n = config.layers * p
    if config.compute == "sleep":
        f, b = config.forward_ms / 1e3 / config.layers, config.backward_ms / 1e3 / config.layers
        return nn.Sequential(*(SleepLayer(f, b) for _ in range(n)))
    layers: list[nn.Module] = []
    for _ in range(n):
        layers += [nn.Sequential(nn.Linear(config.width, config.width), nn.Tanh())]
    return nn.Sequential(*layers)


def measure(comm: Communicator, config: PipelineBenchConfig, schedule: str, v: int,
            m: int) -> Row:
    """One row on this rank: warm up, then ``steps + 1`` consecutive steps, as a training
    loop runs them (no barrier between steps). Each step's interval is this stage's period,
    from the start of the step to the start of the next; the first is left out (it starts
    at the barrier, whose exit is not simultaneous on all ranks)."""
    from disttrain.parallel.pipeline import build_pipeline

    p = comm.world_size
    pipe = build_pipeline(synthetic_model(config, p), comm, schedule=schedule, microbatches=m,
                          partition=[config.layers // v] * (p * v), virtual_stages=v)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m * config.rows, config.width, generator=gen)
    y = torch.randn(m * config.rows, config.width, generator=gen)

    def step() -> None:
        for param in pipe.parameters():
            param.grad = None
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, F.mse_loss)

    for _ in range(config.warmup):
        step()
    totals = pipe.totals
    comm.barrier()
    marks = []
    for _ in range(config.steps + 2):  # marks before each step and after the last
        marks.append((time.perf_counter(), totals.busy_s, totals.wall_s, totals.wait_s))
        if len(marks) < config.steps + 2:
            step()
    comm.barrier()
    samples = [{"wall_s": b[0] - a[0], "busy_s": b[1] - a[1], "inside_s": b[2] - a[2],
                "wait_s": b[3] - a[3], "idle_s": b[3] - a[3]}
               for a, b in pairwise(marks[1:])]
    return {"schedule": schedule, "virtual_stages": v, "microbatches": m,
            "stage": pipe.stage_index, "steps": samples, "peak_stashed": totals.peak_stashed}


def bench_job(comm: Communicator, emit: Callable[[Any], None],
              config: PipelineBenchConfig) -> None:
    """What each rank runs: every (schedule, v, m) case in order, one report each."""
    torch.set_num_threads(1)
    logging.getLogger("disttrain.parallel.pipeline").setLevel(logging.ERROR)  # m < p is meant
    for schedule, v, m in cases(config, comm.world_size):
        emit(measure(comm, config, schedule, v, m))


def cases(config: PipelineBenchConfig, p: int) -> list[tuple[str, int, int]]:
    """(schedule, virtual stages, micro-batches) of every row for p stages: chunks for 1f1b
    only, and only where m is a multiple of p."""
    return [(schedule, v, m) for schedule in config.schedules
            for v in (config.virtual_stages if schedule == "1f1b" else (1,))
            for m in config.microbatches if v == 1 or m % p == 0]


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _per_stage(per_rank: list[Row], share: Callable[[Row], float]) -> list[float]:
    """For each stage, the median over the timed steps of ``share(step)``."""
    return [_median([share(step) for step in rank["steps"]]) for rank in per_rank]


def make_row(p: int, config: PipelineBenchConfig, per_rank: list[Row]) -> Row:
    """One row from every stage's report of one case (medians over the timed steps, which
    keeps a step disturbed by another process on a shared machine out of the figures)."""
    first = per_rank[0]
    m, v = first["microbatches"], first.get("virtual_stages", 1)
    # idle: blocked waiting for a neighbour (in a receive or in the final send wait)
    idle = _per_stage(per_rank, lambda s: s["idle_s"] / s["wall_s"])
    expected = theory(p, m, v)
    mean = sum(idle) / len(idle)
    return {"compute": config.compute, "transport": config.transport, "stages": p,
            "microbatches": m, "virtual_stages": v,
            "schedule": first["schedule"], "theory": expected, "idle_per_stage": idle,
            "idle_mean": mean, "relative_error": (mean - expected) / expected,
            "worst_relative_error": max(abs(i - expected) for i in idle) / expected,
            "not_computing_per_stage": _per_stage(per_rank,
                                                  lambda s: 1 - s["busy_s"] / s["wall_s"]),
            "overhead_per_microbatch_s": _per_stage(
                per_rank, lambda s: (s["wall_s"] - s["idle_s"] - s["busy_s"]) / m),
            "busy_per_microbatch_s": _per_stage(per_rank, lambda s: s["busy_s"] / m),
            "step_s": _median([max(r["steps"][k]["wall_s"] for r in per_rank)
                               for k in range(config.steps)]),
            "peak_stashed": [r["peak_stashed"] for r in per_rank]}


def run(config: PipelineBenchConfig) -> Iterator[Row]:
    """Every row, stage count by stage count, as they are measured."""
    for p in config.stages:
        plan = cases(config, p)
        if not plan:
            continue

        def describe(k: int, plan: list[tuple[str, int, int]] = plan, p: int = p) -> str:
            if k >= len(plan):
                return "shutting down"
            schedule, v, m = plan[k]
            return f"p={p} {schedule} v={v} m={m}"

        with RankGroup(p, bench_job, (config,), transport=config.transport,
                       timeout_s=config.timeout_s, describe=describe) as group:
            for per_rank in group.reports():
                yield make_row(p, config, per_rank)


# ---------------------------------------------------------------------- command line
def format_row(row: Row) -> str:
    """One line of the table: p, m, schedule, theory, idle per stage, their mean, its
    deviation from theory, mean 1 − busy/wall, worst overhead per micro-batch, step time."""
    stages = " ".join(f"{i:5.3f}" for i in row["idle_per_stage"])
    not_computing = sum(row["not_computing_per_stage"]) / row["stages"]
    overhead = max(row["overhead_per_microbatch_s"])
    v = row.get("virtual_stages", 1)
    schedule = row["schedule"] if v == 1 else f"{row['schedule']} v{v}"
    return (f"{row['stages']:>2d} {row['microbatches']:>3d}  {schedule:<7s}  "
            f"{row['theory']:5.3f}  {stages:<23s}  {row['idle_mean']:5.3f}  "
            f"{100 * row['relative_error']:+6.1f}%  {not_computing:5.3f}  "
            f"{overhead * 1e3:5.2f} ms  {row['step_s'] * 1e3:7.1f} ms")


def _title(config: PipelineBenchConfig) -> str:
    if config.compute == "sleep":
        what = (f"sleep {config.forward_ms:g} ms forward + {config.backward_ms:g} ms backward per "
                f"stage and micro-batch (no CPU used: stages overlap as on separate devices)")
    else:
        what = (f"matmul: {config.layers} × Linear({config.width}, {config.width}) + Tanh per "
                f"stage, {config.rows} rows per micro-batch (real compute: needs a core per stage)")
    return (f"disttrain bench pipeline: balanced {what}; messages over transport "
            f"{config.transport}; median of {config.steps} consecutive steps after "
            f"{config.warmup}; idle = waiting for a neighbour / step period, per stage; theory "
            f"(p−1)/(v·m+p−1) (v = 1 but for 1f1b vV: interleaved); 1−busy = idle + "
            f"overhead; overhead per micro-batch, worst stage")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


_OPTIONS: tuple[tuple[tuple[str, ...], str, Callable[[str], Any], str], ...] = (
    (("-p", "--stages"), "stages", _ints, "comma-separated stage counts"),
    (("--microbatches",), "microbatches", _ints, "comma-separated micro-batch counts"),
    (("--schedules",), "schedules", _names, "comma-separated schedules"),
    (("--virtual-stages",), "virtual_stages", _ints, "comma-separated chunks per stage for "
     "1f1b (v > 1: interleaved 1F1B; rows need m a multiple of p)"),
    (("--compute",), "compute", str, "sleep: layers that sleep, using no CPU; matmul: real "
     "Linear layers (use p ≤ cores)"),
    (("--forward-ms",), "forward_ms", float, "sleep: one stage's forward of a micro-batch"),
    (("--backward-ms",), "backward_ms", float, "sleep: one stage's backward of a micro-batch"),
    (("--layers",), "layers", int, "layers per stage"),
    (("--width",), "width", int, "features of every layer"),
    (("--microbatch-size",), "rows", int, "samples per micro-batch"),
    (("--steps",), "steps", int, "timed steps per row (medians reported)"),
    (("--warmup",), "warmup", int, "untimed steps first"),
    (("--transport",), "transport", str, "transport"),
    (("--comm-timeout",), "timeout_s", float, "seconds any rank waits for a peer"),
)


def _dest(flags: tuple[str, ...]) -> str:
    """argparse's destination of a flag: ``--comm-timeout`` → ``comm_timeout``."""
    return flags[-1].lstrip("-").replace("-", "_")


# kept for one release: -m is a module everywhere else (torchrun's -m), --timeout a whole
# run, and a row is a line of the table and of --json
_OLD_SPELLINGS = {"-m": "--microbatches", "--timeout": "--comm-timeout",
                  "--rows": "--microbatch-size"}


def add_parser(inner: Any) -> None:
    """Register ``disttrain bench pipeline`` on the ``bench`` subparsers."""
    d = PipelineBenchConfig()
    parser = inner.add_parser(
        "pipeline", help="measured pipeline bubble against (p−1)/(v·m+p−1)",
        description="Run GPipe and 1F1B (interleaved over --virtual-stages) on a balanced "
        "synthetic model for each number of stages and micro-batches; print each stage's "
        "measured idle fraction next to theory.")
    added = {}
    for flags, field_, parse, help_ in _OPTIONS:
        default = getattr(d, field_)
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        added[flags[-1]] = parser.add_argument(*flags, type=parse, default=default,
                                               help=f"{help_} (default {shown})")
    for old, new in _OLD_SPELLINGS.items():
        add_alias(parser, old, new=added[new])
    add_json_argument(parser, "measured row")
    parser.set_defaults(func=lambda args: _main(args, parser))


def _main(args: Any, parser: Any) -> int:
    import sys

    from disttrain.bench.ranks import BenchError

    try:
        config = PipelineBenchConfig(**{field_: getattr(args, _dest(flags))
                                        for flags, field_, _, _ in _OPTIONS})
    except ValueError as exc:
        parser.error(str(exc))
    print(_title(config), flush=True)
    print(" p   m  sched.   theory  idle per stage (0, 1, …)  mean  vs theory  1−busy  "
          "overhead       step", flush=True)
    try:
        with RowWriter(args.json) as json_rows:
            for row in run(config):
                print(format_row(row), flush=True)
                json_rows.write(row)
    except BenchError as exc:
        print(f"disttrain bench pipeline: {exc}", file=sys.stderr)
        return 1
    return 0
