"""``disttrain simulate --validate``: predicted against measured step time on this machine.

For each strategy that ``disttrain bench`` can run here (a name the training registry does
not have is skipped, saying so) and each world size, it

1. profiles the model here (:mod:`~disttrain.probe.profiler`, one thread, as ranks run),
   and times its layers again before every run of step 3, and its overheads before every
   round of the table and after the last (the profile's layer times are then those of the
   median round, each overhead the median of its measurements: a profile of the minutes
   the runs ran in, not of the seconds before them; see
   :class:`~disttrain.probe.profiler.LayerRounds`),
2. simulates the step on the ``local`` cluster (calibrated costs, ranks sharing the cores)
   with the configuration the benchmark uses: the global batch fixed, the ``ring``
   algorithm, every rank a pipeline stage, 8 micro-batches (the only count the benchmark
   runs: another ``--microbatches`` is rejected);
   including what the step pays besides its layers, measured in the profile
   (:class:`~disttrain.simulate.overheads.Overheads`: the loop, the optimizer, collective
   calls, DDP's hooks, ZeRO's own work, the wake-up of a collective after compute, the
   slowdown of ranks computing at once) and ranks beyond this machine's cores sharing them,
3. runs the strategy with the benchmark's machinery
   (:func:`disttrain.bench.strategy_bench.run_table`: fresh processes, median step time of
   the slowest rank after warm-up), ``--repeat`` times (default 3; the table goes round
   that many times, so the runs of a row are minutes apart), and takes the median run
   (one run's step time moves by 20-35 % from run to run on this machine: the single
   process measured 2.35 and 3.13 ms back to back; see :func:`measured_step`), each rank
   bound to a core of its own where there are enough cores, and as many ranks to every
   core where the ranks are a multiple of the cores (``--bind-cores``, the default: the
   model shares cores evenly, while the kernel may keep two ranks on one core for a whole
   run; DDP on 2 Gloo ranks measured 2.27-2.34 ms bound in four runs, 2.53-3.95 ms
   unbound, fast and slow runs alternating, and 4 ranks 5.0-5.3 ms bound two to a core
   against 5.5-7.7 ms; docs/benchmarks.md, "Binding cores"; the parameter
   servers' 3 and 5 processes stay unbound),

and prints both with their ratio, and a verdict per row (:func:`verdict`): within the 20 %
band, *not predicted here* with the reason the row's own runs give, or outside the band
with none (the model is wrong there, and the exit status is 1). The single-process
reference the benchmark runs anyway is printed as a check of the profile alone (no
communication, no sharing). ``--json FILE`` writes one object per row with ``strategy,
world_size, processes, predicted_step_s, measured_step_s, verdict, reason`` (and
``ratio``, each run's time, and ``predicted_before_runs_s``: the prediction from the
profile's own rounds, made before anything ran). ``--transport`` (default ``torch``) is the
transport of both sides: the calibration the model reads, the profile's wake-up probe and
the benchmark's runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

from disttrain.bench.experiments import BenchConfig
from disttrain.bench.strategy_bench import run_table
from disttrain.comm.cost_model import LinkCosts, load_costs
from disttrain.flags import write_rows
from disttrain.probe.profiler import LayerRounds, registered_rounds
from disttrain.probe.wrappers import GLOBAL_BATCH
from disttrain.probe.wrappers import VALIDATE_PRESET as PRESET  # one thread, as profiled
from disttrain.simulate.cluster import local
from disttrain.simulate.profile import ModelProfile
from disttrain.simulate.strategies import simulate
from disttrain.simulate.workload import Workload
from disttrain.train.strategies import STRATEGIES as RUNNABLE
from disttrain.train.strategies.pipeline import DEFAULT_MICROBATCHES


def _plan(names: tuple[str, ...], model: str = "transformer") -> tuple[list[str], list[str]]:
    """(runnable here, skipped): strategies of the training registry; the tensor-parallel
    ones only on the transformer they split."""
    runnable = [n for n in names if n in RUNNABLE and (
        RUNNABLE[n].layout != "mesh" or model == "transformer")]
    skipped = [n for n in names if n not in runnable]
    return runnable, skipped


def check_arguments(args: argparse.Namespace) -> None:
    """ValueError for a setting the benchmark cannot measure: it runs pipelines with
    :data:`DEFAULT_MICROBATCHES` micro-batches (``disttrain bench`` has no option for it),
    so a prediction for another count would be compared with the wrong measurement."""
    repeat, partition = args.repeat, args.partition
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"--repeat must be an integer ≥ 1 (fresh runs per strategy and "
                         f"world size), got {repeat!r}")
    if partition != "params":
        raise ValueError(f"--validate measures pipelines as disttrain bench splits them "
                         f"(--partition params), so --partition {partition} cannot be "
                         f"validated; drop --partition")
    if args.microbatches != DEFAULT_MICROBATCHES:
        raise ValueError(f"--validate measures pipelines with {DEFAULT_MICROBATCHES} "
                         f"micro-batches (disttrain bench has no --microbatches), so "
                         f"--microbatches {args.microbatches} cannot be validated; drop "
                         f"--microbatches or use --microbatches {DEFAULT_MICROBATCHES}")


def predicted(profile: ModelProfile, strategy: str, world_size: int, global_batch: int,
              microbatches: int, transport: str = "torch") -> float:
    """The simulated step on the local cluster with ``transport``'s calibration (NaN when
    the strategy cannot run it)."""
    wl = Workload(global_batch=global_batch, algorithm="ring", pp_size=world_size,
                  microbatches=microbatches)
    row = simulate(profile, local(transport), wl, strategy, world_size)
    return float("nan") if row.error is not None else row.step_s


def single_step(profile: ModelProfile, global_batch: int) -> float:
    """One process, no communication: the loop, forward, backward, the optimizer."""
    return profile.overheads.step_s + profile.compute(global_batch) + profile.optimizer(
        profile.params, "sgd", profile.tensors)


def measured_step(row: dict[str, Any]) -> float | None:
    """The median over the row's fresh runs of each run's median step time (the lower of
    the middle two for an even count), or None without one. The median, as the profile's
    rounds: the machine's usual state over the minutes of the runs. (The least, with a
    profile's least round, would compare two snapshots of the machine's fastest moments: a
    fast spell during the profile alone put the single process's prediction 10-26 % below
    each of its runs.)"""
    runs = _runs(row.get("step_time_s_runs"))
    if runs:
        return statistics.median_low(runs)
    return row.get("step_time_s") or None


def _runs(times: list[float | None] | None) -> list[float]:
    """The runs that measured a step time."""
    return [t for t in times or [] if t]


def runs_text(times: list[float | None] | None) -> str:
    """``; runs a, b, c ms`` for more than one run, else nothing."""
    runs = _runs(times)
    return f"; runs {', '.join(f'{t * 1e3:.2f}' for t in runs)} ms" if len(runs) > 1 else ""


BAND = 0.20  # the goal: every prediction within 20 % of the measured step
WITHIN, NOT_PREDICTED, OUTSIDE, FAILED = "within", "not predicted here", "outside", "failed"


def machine_cores() -> int:
    """The cores this process may run on (the runs' ranks share them)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def verdict(row: dict[str, Any], cores: int, band: float = BAND) -> tuple[str, str]:
    """What a row of the validation says: ``(WITHIN, "")`` when the prediction is within
    ``band`` of the measured step; for a row outside it, ``(NOT_PREDICTED, reason)`` when
    its own runs show what the model leaves out there:

    * its runs spread wider than the band among themselves while the prediction is within
      the band of one of them (the machine does not reproduce the row's time), or
    * its processes outnumber the cores (the model shares cores evenly between ranks; the
      measured step says by how much the real sharing costs more or less);

    ``(OUTSIDE, reason)`` otherwise: reproducible runs, a core per process, and still off,
    which is the model's error. A run that failed is ``(FAILED, error)``."""
    if row.get("error") or not row.get("measured_step_s"):
        return FAILED, str(row.get("error") or "no step time measured")
    pred, measured = row["predicted_step_s"], row["measured_step_s"]
    ratio = pred / measured
    if abs(ratio - 1) <= band:
        return WITHIN, ""
    runs = _runs(row.get("measured_step_s_runs")) or [measured]
    low, high = min(runs), max(runs)
    off = f"predicted {pred * 1e3:.2f} ms, measured {measured * 1e3:.2f} ms ({ratio:.2f})"
    if high / low > 1 + band and any(abs(pred / t - 1) <= band for t in runs):
        return NOT_PREDICTED, (f"{off}: its {len(runs)} runs spread {low * 1e3:.2f}-"
                               f"{high * 1e3:.2f} ms (+{high / low - 1:.0%}), wider than the "
                               f"band, and the prediction is within it of one of them")
    processes = row.get("processes") or row["world_size"]
    if processes > cores:
        gap = measured - pred
        return NOT_PREDICTED, (f"{off}: its {processes} processes share {cores} cores, which "
                               f"the model shares evenly between ranks; here the sharing costs "
                               f"{abs(gap) * 1e3:.2f} ms a step {'more' if gap > 0 else 'less'} "
                               f"than that (runs {low * 1e3:.2f}-{high * 1e3:.2f} ms)")
    return OUTSIDE, (f"{off}, runs {low * 1e3:.2f}-{high * 1e3:.2f} ms, a core per process: "
                     f"the model is wrong here")


def rows_for(args: argparse.Namespace) -> list[dict[str, Any]]:
    names, skipped = _plan(tuple(args.strategies), args.model)
    for name in skipped:
        why = ("it splits a transformer (--model transformer)" if name in RUNNABLE else
               "not in the training strategy registry")
        print(f"skipping {name}: not runnable by disttrain bench here ({why})", file=sys.stderr)
    dataset = args.dataset or ("synthetic-lm" if args.model == "transformer" else "digits")
    costs = load_costs(args.transport)
    if costs.source == LinkCosts().source:
        print(f"warning: no calibration stored for transport {args.transport}: the model uses "
              f"default costs; run disttrain bench comm --calibrate --transport "
              f"{args.transport} -n {','.join(map(str, args.world_sizes))} first",
              file=sys.stderr)
    profile, rounds = registered_rounds(args.model, dataset, transport=args.transport,
                                        bind_cores=args.bind_cores)
    try:
        return _validate(args, names, dataset, profile, rounds)
    finally:
        rounds.close()


def _validate(args: argparse.Namespace, names: list[str], dataset: str,
              profile: ModelProfile, rounds: LayerRounds) -> list[dict[str, Any]]:
    config = BenchConfig.from_preset(
        PRESET, strategies=tuple(names), world_sizes=tuple(args.world_sizes),
        transport=args.transport, model=args.model, dataset=dataset, steps=args.steps,
        global_batch=args.global_batch or GLOBAL_BATCH, algorithm="ring", eval_every=10**6,
        repeat=args.repeat, bind_cores=args.bind_cores, reference_threads=1)

    def predict(name: str, world_size: int, prof: ModelProfile = profile) -> float:
        return predicted(prof, name, world_size, config.global_batch, args.microbatches,
                         args.transport)

    # every prediction before the minutes of runs: one the model cannot make fails now
    before = {(name, n): predict(name, n) for name in names for n in args.world_sizes}

    def start(i: int, n: int, run: Any) -> None:
        if i and i % max(1, n // config.repeat) == 0:  # the table starts another round
            print("measuring the overheads again", file=sys.stderr, flush=True)
            rounds.sample_overheads()
        print(f"[{i + 1}/{n}] measuring {run.label}", file=sys.stderr, flush=True)
        rounds.sample()  # the layers' times as this run will find the machine

    outcome = run_table(config, on_start=start)
    rounds.sample()
    rounds.sample_overheads()
    own = profile.compute(config.global_batch)
    profile = rounds.profile(profile)
    predictions = {key: predict(*key, prof=profile) for key in before}
    totals, large = rounds.totals(), len(rounds.inputs[1])
    fwd_bwd = profile.compute(config.global_batch)
    print(f"profile of {profile.name}: forward+backward {fwd_bwd * 1e3:.2f} ms at batch "
          f"{config.global_batch} ({own * 1e3:.2f} ms before the runs); at batch {large} the "
          f"median of {len(totals)} rounds, {min(totals) * 1e3:.2f}-{max(totals) * 1e3:.2f} "
          f"ms; per-step overheads, the median of {len(rounds.overheads) + 1} measurements:\n"
          f"{profile.overheads.text()}", file=sys.stderr)
    single = next((r for r in outcome.rows if r["strategy"] == "single"), {})
    took = measured_step(single)
    if took:
        pred = single_step(profile, config.global_batch)
        print(f"single process: predicted {pred * 1e3:.2f} ms, measured {took * 1e3:.2f} ms "
              f"({pred / took:.2f}){runs_text(single.get('step_time_s_runs'))}", file=sys.stderr)
    rows = []
    for row in outcome.rows:
        if row["strategy"] == "single":
            continue
        key = (row["strategy"], row["world_size"])
        pred = predictions[key] if key in predictions else predict(*key, prof=profile)
        measured = measured_step(row) if row.get("error") is None else None
        rows.append({"strategy": row["strategy"], "world_size": row["world_size"],
                     "processes": row["world_size"] + (row.get("servers") or 0),
                     "predicted_step_s": pred, "measured_step_s": measured,
                     "predicted_before_runs_s": before.get(key),
                     "measured_step_s_runs": row.get("step_time_s_runs"),
                     "ratio": pred / measured if measured else None, "error": row.get("error")})
    return rows


def report(rows: list[dict[str, Any]], cores: int | None = None) -> int:
    """Print the rows, a verdict for each row outside the band and a summary; fill each
    row's ``verdict`` and ``reason``. Returns the exit status: 1 when a run failed or a row
    is outside the band without a reason its runs give (:func:`verdict`), else 0."""
    cores = machine_cores() if cores is None else cores
    print(f"{'strategy':15s} {'n':>3s} {'predicted':>10s} {'measured':>10s} {'ratio':>6s}")
    for r in rows:
        r["verdict"], r["reason"] = verdict(r, cores)
        measured = f"{r['measured_step_s'] * 1e3:.2f} ms" if r["measured_step_s"] else "-"
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else (r["error"] or "-")
        runs = runs_text(r.get("measured_step_s_runs"))
        print(f"{r['strategy']:15s} {r['world_size']:>3d} {r['predicted_step_s'] * 1e3:7.2f} ms "
              f"{measured:>10s} {ratio:>6s}{runs}")
    for r in rows:
        if r["verdict"] != WITHIN:
            print(f"{r['verdict']}: {r['strategy']} n={r['world_size']}: {r['reason']}")
    count = {v: sum(r["verdict"] == v for r in rows) for v in (WITHIN, NOT_PREDICTED,
                                                                OUTSIDE, FAILED)}
    print(f"within {BAND * 100:.0f} %: {count[WITHIN]} of {len(rows)} rows; not predicted here "
          f"(with the reason above): {count[NOT_PREDICTED]}; outside with no reason: "
          f"{count[OUTSIDE]}; failed: {count[FAILED]}")
    return 1 if count[OUTSIDE] or count[FAILED] else 0


def run_validation(args: argparse.Namespace) -> int:
    rows = rows_for(args)
    status = report(rows)
    write_rows(args.json, rows)
    return status
