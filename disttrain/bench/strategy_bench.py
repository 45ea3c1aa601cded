"""Run the strategy table: every experiment in fresh local processes, one row per run.

Each (experiment, world size) runs ``repeat`` times, each time in new processes, the
repeats spread over the table (all runs once, then all again: :func:`run_table`)
(:class:`~disttrain.bench.ranks.RankGroup`: a rank that raises, dies or stays silent is named
and stopped). Each rank calls :func:`disttrain.train.train` with the same config and sends
its :class:`~disttrain.train.TrainResult` back, plus, with ``trace``, its step spans, its
compute phases (a :class:`~disttrain.train.strategies.base.PhaseRecorder`) and the
collectives from the flight recorder of every communicator the strategy sends through. The
row takes the median samples/s over the repeats (and their spread), the maximum peak memory
over ranks, and the maximum over ranks of the bytes each sent per step next to the
strategy's theoretical figure.

A failing run becomes a row with ``error`` set (the rank and its exception) and the table
goes on; Ctrl-C stops the current run and returns the rows of the runs with at least one
finished repeat.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from disttrain.bench.experiments import REFERENCE, BenchConfig, Run, plan
from disttrain.bench.ranks import BenchError, Heartbeat, RankGroup
from disttrain.comm import Communicator
from disttrain.parallel.presets import zero_presets
from disttrain.train import (
    STRATEGIES,
    ParallelOptions,
    StepRecord,
    TrainConfig,
    TrainResult,
    train,
)
from disttrain.train.device import local_backend, uses_cuda
from disttrain.train.loop import checked_setup
from disttrain.train.strategies.base import PhaseRecorder

Row = dict[str, Any]
HEARTBEAT_STEPS = 10  # each rank reports progress this often, so only silence is a hang


@dataclass
class Outcome:
    """The rows finished so far and whether Ctrl-C cut the run short."""

    rows: list[Row] = field(default_factory=list)
    traces: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # label → events
    interrupted: bool = False


def train_config(config: BenchConfig, run: Run) -> TrainConfig:
    """The TrainConfig of one run: the same model, data, batch and length for every row."""
    exp = run.experiment
    parallel = ParallelOptions(algorithm=config.algorithm) if exp.takes_algorithm else (
        ParallelOptions())
    if exp.parameter_server:
        parallel = ParallelOptions(servers=run.servers, straggler=config.straggler,
                                   straggler_every=config.straggler_every,
                                   staleness=config.staleness if exp.takes_staleness else None,
                                   staleness_lr=config.staleness_lr
                                   if "staleness_lr" in STRATEGIES[exp.name].options else None)
    if exp.name == "3d":
        parallel = ParallelOptions(algorithm=config.algorithm, tp_size=config.tp_size,
                                   pp_size=config.pp_size)
    if exp.name in zero_presets():
        parallel = ParallelOptions(algorithm=config.algorithm, dp_shard=config.dp_shard,
                                   meta_init=run.meta_init)
    epochs, steps = config.length
    return TrainConfig(model=config.model, model_config=config.model_config,
                       dataset=config.dataset, data=config.data,
                       strategy=exp.name, parallel=parallel, epochs=epochs, steps=steps,
                       global_batch=config.global_batch, optimizer=config.optimizer,
                       lr=config.lr, momentum=config.momentum, seed=config.seed,
                       untimed_steps=config.untimed_steps, eval_every=config.eval_every,
                       log_every=0, progress=False, device=config.device,
                       peak_tflops=config.peak_tflops,
                       activation_checkpointing=config.activation_checkpointing
                       if run.variant == "ac" else "none",
                       compile=run.variant == "compile",
                       compile_backend=config.compile_backend)


def transport_of(config: BenchConfig, run: Run) -> str:
    """``torch`` for the baselines and the reference; on GPUs ``auto`` is ``torch`` too
    (NCCL moves CUDA tensors where shared memory would stage them through host memory)."""
    if run.experiment.is_baseline or run.experiment.name == REFERENCE:
        return "torch"
    if config.transport == "auto" and uses_cuda(config.device):
        return "torch"
    return config.transport


def backend_of(config: BenchConfig, run: Run) -> str:
    """The run's torch.distributed backend (raises ValueError when it cannot run here)."""
    return local_backend(config.backend, config.device, transport_of(config, run), run.ranks)


def algorithm_of(config: BenchConfig, run: Run) -> str | None:
    exp = run.experiment
    if exp.takes_algorithm:
        return config.algorithm
    if exp.is_baseline:
        return "deepspeed" if exp.name.startswith("deepspeed-") else "torch"
    return None


# ---------------------------------------------------------------------------- on each rank
def _train_job(comm: Communicator, emit: Callable[[Any], None], config: TrainConfig,
               trace: bool) -> None:
    """One rank: train, then report the result (and the trace events when asked)."""
    steps: list[tuple[int, float, float]] = []  # (step, start, end), wall clock like the
    collectives: dict[tuple[int, int], dict[str, Any]] = {}  # flight recorder's times
    phases = PhaseRecorder() if trace else None
    spans: list[tuple[str, float, float]] = []  # compute phases (forward, backward, ...)

    def drain() -> None:  # drained each step: the flight recorders are rings
        if phases is None:
            return
        spans.extend(phases.drain())
        for index, sub in enumerate(phases.communicators):
            label = "world" if sub is comm else "ranks " + ",".join(map(str, sub.global_ranks))
            for entry in sub.flight_recorder.dump():
                collectives.setdefault((index, entry["seq"]), {**entry, "comm": label})

    def hook(record: StepRecord) -> None:
        if record.step % HEARTBEAT_STEPS == 0:  # the parent's silence backstop resets
            emit(Heartbeat(record.step))
        if trace:
            end = time.time()
            steps.append((record.step, end - record.seconds, end))
            drain()

    result = train(config, comm, hooks=[hook], phases=phases)
    drain()
    emit({"result": result.without_model(), "steps": steps, "phases": spans,
          "collectives": [collectives[k] for k in sorted(collectives)]})


# ---------------------------------------------------------------------------- in the parent
Progress = Callable[[Run, int], None]  # (run, steps done) every HEARTBEAT_STEPS steps


def run_once(config: BenchConfig, run: Run, trace: bool,
             on_progress: Progress | None = None) -> list[dict[str, Any]]:
    """One run in fresh processes; every rank's report (rank order). Raises BenchError.
    ``on_progress`` hears rank 0's steps done every ``HEARTBEAT_STEPS`` steps."""
    tconfig = train_config(config, run)

    def heard(rank: int, step: int) -> None:  # rank 0's steps (a parameter server takes none)
        if rank == 0 and on_progress is not None:
            on_progress(run, step)

    with RankGroup(run.ranks, _train_job, (tconfig, trace),
                   transport=transport_of(config, run), timeout_s=config.timeout_s,
                   describe=lambda _: f"{run.label}: training",
                   bind_cores=config.bind_cores, threads=config.threads_of(run),
                   backend=backend_of(config, run), device=config.device,
                   on_heartbeat=heard) as group:
        final = None
        for reports in group.reports():  # to the end: the ranks then exit on their own
            final = list(reports)
    if final is None:
        raise BenchError(f"{run.label}: the ranks finished without a result")
    return final


def _error_text(exc: BaseException) -> str:
    """The first line (which rank, how) and the exception line of a rank's traceback."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else type(exc).__name__
    tail = [line.strip() for line in lines[1:] if not line.startswith((" ", "Traceback"))
            and not line.startswith("(while")]
    return f"{lines[0]} {tail[-1] if tail else ''}".strip()


def base_row(config: BenchConfig, run: Run) -> Row:
    return {"strategy": run.name, "world_size": run.world_size,
            "servers": run.servers, "threads": config.threads_of(run),
            "global_batch": config.global_batch,
            "transport": transport_of(config, run),
            "algorithm": algorithm_of(config, run), "compare_to": run.experiment.compare_to,
            "compare_to_deepspeed": run.experiment.compare_to_deepspeed,
            "error": None}


def _median_step(config: BenchConfig, results: list[TrainResult]) -> float | None:
    """The slowest rank's median step time after the warm-up steps (None without steps).

    Not the median of each step's maximum over ranks: the ranks of a synchronous job run
    at one period, but each starts and ends its steps at its own offset around the
    collectives, so one step takes longer on one rank and the next on another. The
    maximum of p such times is biased upwards: disttrain DDP on 4 ranks of 2 cores had
    per-rank medians of 14.5-15.4 ms, 14.7-15.4 ms means, and a median per-step maximum of
    19.1 ms (docs/benchmarks.md)."""
    medians = [statistics.median(r.step_times[config.untimed_steps:] or r.step_times)
               for r in results if r.step_times]
    return max(medians) if medians else None


def make_row(config: BenchConfig, run: Run, repeats: list[list[dict[str, Any]]]) -> Row:
    """The row of a run from every repeat's reports (each: one report per rank)."""
    speeds = [samples_per_s(reports[0]["result"]) for reports in repeats]
    median = statistics.median(speeds)
    chosen = min(repeats, key=lambda r: abs(samples_per_s(r[0]["result"]) - median))
    results: list[TrainResult] = [report["result"] for report in chosen]
    first = results[0]
    row = base_row(config, run)
    row.update({
        "dp_size": first.dp_size, "steps": first.steps, "repeats": len(repeats),
        "samples_per_s": median, "samples_per_s_runs": speeds,
        **token_columns(first, median),
        "spread": (max(speeds) - min(speeds)) / median if median > 0 else 0.0,
        "step_time_s": _median_step(config, results),
        "step_time_s_runs": [_median_step(config, [report["result"] for report in reports])
                             for reports in repeats],
        "peak_mem_bytes": max(r.peak_mem_bytes for r in results),
        "peak_mem_bytes_per_rank": [r.peak_mem_bytes for r in results],
        **memory_columns(results),
        "bytes_sent_per_rank_per_step": first.bytes_sent_per_step_max,
        "theory_bytes_per_rank_per_step": first.theory_bytes_per_step_max,
        "bytes_unobserved": max(r.bytes_unobserved for r in results),
        "accuracy": first.accuracy, "eval_loss": first.eval_loss, "final_loss": first.final_loss,
        "evaluations": [[e.step, e.accuracy, e.loss] for e in first.evaluations],
        "losses": first.losses, "extras": first.extras,
    })
    return row


def token_columns(result: TrainResult, samples_per_s: float) -> Row:
    """tokens/s and MFU at the row's samples/s (None where they do not apply: a model
    without attention, data that are not token sequences, no --peak-tflops)."""
    speed = dataclasses.replace(result, samples_per_s=samples_per_s, extras={})
    return {"tokens_per_s": speed.tokens_per_s, "mfu": speed.mfu,
            "model_flops_per_token": result.model_flops_per_token, "devices": result.devices}


def memory_columns(results: list[TrainResult]) -> Row:
    """Model-state and activation bytes: the busiest rank's, each rank's, and the busiest
    rank's breakdown and formula (docs/benchmarks.md, "Memory")."""
    states = [r.model_state_bytes for r in results if r.model_state_bytes is not None]
    busiest = max(states, key=lambda d: d["total"]) if states else None
    formulas = [r.model_state_formula_bytes for r in results if r.model_state_formula_bytes]
    activations = [r.activation_peak_bytes for r in results
                   if r.activation_peak_bytes is not None]
    return {"model_state_bytes": busiest["total"] if busiest else None,
            "model_state_bytes_per_rank": [d["total"] for d in states],
            "model_state_breakdown": busiest,
            "model_state_formula_bytes": max(f["total"] for f in formulas) if formulas
            else None,
            "activation_peak_bytes": max(activations) if activations else None}


def samples_per_s(result: TrainResult) -> float:
    """A run's samples/s: rank 0's, unless the strategy reports an aggregate in ``extras``
    (parameter-server workers step at their own pace: the sum of their rates)."""
    return float(result.extras.get("samples_per_s", result.samples_per_s))


def add_comparisons(row: Row, rows: list[Row]) -> None:
    """Speed-up over the reference, scaling efficiency, the ratio against torch's
    implementation of the same idea, and the reference's accuracy and loss."""
    def find(name: str | None, n: int | None = None) -> Row | None:
        for other in rows:
            if other["strategy"] == name and other.get("error") is None and (
                    n is None or other["world_size"] == n):
                return other
        return None

    ref, torch_row = find(REFERENCE), find(row.get("compare_to"), row["world_size"])
    ds_row = find(row.get("compare_to_deepspeed"), row["world_size"])
    speed = row.get("samples_per_s")
    ok = row.get("error") is None and speed
    row["speedup"] = speed / ref["samples_per_s"] if ok and ref and ref["samples_per_s"] else None
    row["efficiency"] = row["speedup"] / row["world_size"] if row["speedup"] else None
    row["vs_torch"] = (speed / torch_row["samples_per_s"]
                       if ok and torch_row and torch_row["samples_per_s"] else None)
    row["vs_deepspeed"] = (speed / ds_row["samples_per_s"]
                           if ok and ds_row and ds_row["samples_per_s"] else None)
    row["reference_accuracy"] = ref["accuracy"] if ref else None
    row["reference_final_loss"] = ref["final_loss"] if ref else None


def _refusal(config: BenchConfig, run: Run) -> Row | None:
    """The error row of a run that cannot run here (checked before any process starts)."""
    try:
        checked_setup(train_config(config, run), run.ranks)
    except ValueError as exc:
        return {**base_row(config, run), "error": f"not runnable here: {exc}"}
    return None


def run_table(config: BenchConfig, on_row: Callable[[Row], None] | None = None,
              on_start: Callable[[int, int, Run], None] | None = None,
              trace: bool = False, on_progress: Progress | None = None) -> Outcome:
    """Run the whole plan; Ctrl-C ends it early with the rows of the runs finished so far.

    With ``repeat`` > 1 the table is run ``repeat`` times over (run 1, run 2, …, run 1,
    run 2, …), not each run ``repeat`` times in a row: a machine whose speed drifts for tens
    of seconds (a virtual machine's slow spells) then slows one repeat of many rows instead
    of every repeat of one row, and the medians over repeats compare the rows under the
    same conditions. ``on_start(i, n, run)`` hears each of the n fresh runs as it begins,
    ``on_progress`` its steps done every ``HEARTBEAT_STEPS`` steps, ``on_row`` each row
    when its last repeat is done (rows come in plan order)."""
    outcome = Outcome()
    runs = plan(config)
    rows: list[Row | None] = [_refusal(config, run) for run in runs]  # set: failed
    refused = {i for i, row in enumerate(rows) if row is not None}  # announced once, at the end
    repeats: list[list[list[dict[str, Any]]]] = [[] for _ in runs]
    finished: set[int] = set()
    total = len(refused) + (len(runs) - len(refused)) * config.repeat
    started = 0
    try:
        for k in range(config.repeat):
            last = k == config.repeat - 1
            for i, run in enumerate(runs):
                if rows[i] is None or (last and i in refused):
                    if on_start is not None:
                        on_start(started, total, run)
                    started += 1
                if rows[i] is None:
                    try:
                        repeats[i].append(run_once(config, run, trace, on_progress))
                    except (BenchError, ValueError) as exc:
                        rows[i] = {**base_row(config, run), "error": _error_text(exc)}
                if last:
                    _finish(config, outcome, run, rows[i], repeats[i], trace, on_row)
                    finished.add(i)
    except KeyboardInterrupt:  # keep every run with a finished repeat (or an error)
        outcome.interrupted = True
        for i, run in enumerate(runs):
            if i not in finished and (rows[i] is not None or repeats[i]):
                _finish(config, outcome, run, rows[i], repeats[i], trace, None)
    return outcome


def _finish(config: BenchConfig, outcome: Outcome, run: Run, row: Row | None,
            repeats: list[list[dict[str, Any]]], trace: bool,
            on_row: Callable[[Row], None] | None) -> None:
    """Make the row of ``run`` (``row`` when it already failed) and add it to ``outcome``."""
    if row is None:
        row = make_row(config, run, repeats)
    add_comparisons(row, [*outcome.rows, row])
    outcome.rows.append(row)
    if trace and repeats and row.get("error") is None:
        from disttrain.bench.trace import chrome_trace

        outcome.traces[f"{run.experiment.name}-n{run.world_size}"] = chrome_trace(repeats[-1])
    if on_row is not None:
        on_row(row)
