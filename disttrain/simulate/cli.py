"""``disttrain simulate``: predict every strategy's step time, memory and scaling at any
number of workers, and recommend one.

    disttrain simulate --model lenet --cluster cluster-400g -n 8,64,512,4096
    disttrain simulate --model resnet101 --cluster roce-25g --batch-per-worker 64 --strategies ddp
    disttrain simulate --model gpt-13b --cluster cluster-400g --batch-per-worker 1 -n 8,64
    disttrain simulate --cluster my_cluster.toml --json rows.jsonl --plot scaling.svg
    disttrain simulate --validate -n 2,4 --json validate.jsonl   # predicted vs measured here

Exit codes: 0 done, 2 bad arguments, 1 a --validate run failed or one of its rows is outside
the 20 % band with no reason its runs give (disttrain.probe.validate.verdict).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from disttrain.bench.svg import H, line_plot
from disttrain.flags import add_alias, add_json_argument, write_rows
from disttrain.simulate.base import StepResult
from disttrain.simulate.cluster import PRESETS, Cluster, get_cluster
from disttrain.simulate.profile import ModelProfile
from disttrain.simulate.workload import PARTITIONS, Speeds, Workload

DEFAULT_WORKERS = (8, 64, 512, 4096)
VALIDATE_WORLD_SIZES = (2, 4)  # what --validate measures here unless -n says otherwise


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 8,64,512, got {text!r}") \
            from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers ≥ 1, got {text!r}")
    return values


def _names(text: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    if not names:
        raise argparse.ArgumentTypeError("empty list of strategies")
    return names


def configure(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from disttrain.simulate.strategies import STRATEGIES

    p = subparsers.add_parser(
        "simulate", help="predict step time, memory and scaling of every strategy on a "
        "cluster of any size, and recommend one",
        description="Discrete-event simulation of one training step per strategy, from a "
        "compute profile of the model and the α-β-γ cost model (docs/simulate.md).")
    p.add_argument("--model", default="lenet", help="a registered model (profiled here), "
                   "'resnet101', 'gpt-1.3b', 'gpt-13b' (analytic profiles) or "
                   "package.module:factory")
    p.add_argument("--dataset", default=None, help="dataset whose inputs the profile uses "
                   "(default: synthetic-lm for transformer, digits otherwise)")
    p.add_argument("--cluster", default="local",
                   help=f"a preset ({', '.join(PRESETS)}) or a .toml file")
    p.add_argument("--transport", default="torch", type=_transport,
                   help="this machine's transport (--cluster local and --validate): whose "
                        "calibration the model reads and, with --validate, what the measured "
                        "runs use (default torch: Gloo point-to-point; shm: shared memory)")
    sizes = p.add_argument("-n", "--world-sizes", type=_ints, default=None,
                           help="comma-separated worker counts to simulate (default "
                                "8,64,512,4096) or, with --validate, to run here and compare "
                                "(default 2,4)")
    add_alias(p, "--workers", new=sizes)
    p.add_argument("--strategies", type=_names, default=tuple(STRATEGIES),
                   help=f"comma-separated (default: all of {','.join(STRATEGIES)})")
    _workload_arguments(p)
    add_json_argument(p, "row (strategy × worker count), its settings under 'env'")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.svg",
                   help="write step time, memory and efficiency plots")
    p.add_argument("--validate", action="store_true",
                   help="run each strategy here at -n ranks and print predicted against "
                   "measured step time")
    p.add_argument("--steps", type=int, default=30, help="--validate: steps per run")
    p.add_argument("--repeat", type=int, default=3,
                   help="--validate: fresh runs of each strategy and world size; the median "
                   "run is compared (default 3: a run's step time moves 20-35%% from run to "
                   "run on a shared machine)")
    p.add_argument("--bind-cores", action=argparse.BooleanOptionalAction, default=True,
                   help="--validate: pin each rank of a run to a core of its own when there "
                   "are enough, or as many ranks to every core when the ranks are a multiple "
                   "of the cores, as the model shares them, and the profile's probes likewise "
                   "(all but the parameter server's, whose runs are never bound) (default); "
                   "--no-bind-cores leaves the placement to the kernel, which may keep two "
                   "ranks on one core for a whole run")
    p.set_defaults(func=lambda args: run(args, p))


def _workload_arguments(p: argparse.ArgumentParser) -> None:
    batch = p.add_argument("--batch-per-worker", type=int, default=32,
                           help="samples per step on each worker (default 32)")
    add_alias(p, "--batch", new=batch)
    p.add_argument("--global-batch", type=int, default=None,
                   help="fix the global batch instead (strong scaling)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"))
    p.add_argument("--algorithm", default="auto",
                   help="collective algorithm: auto, ring, tree, halving_doubling, hierarchical")
    bucket = p.add_argument("--bucket-cap-mb", type=float, default=25.0,
                            help="DDP/ZeRO-2 bucket size in MB (default 25)")
    add_alias(p, "--bucket-mb", new=bucket)
    p.add_argument("--microbatches", type=int, default=8, help="pipeline micro-batches")
    pp = p.add_argument("--pp", type=int, default=None, dest="pp_size",
                        help="pipeline stages (default: min(workers, layers, 8))")
    add_alias(p, "--pp-size", new=pp)
    p.add_argument("--dp-shard", type=int, default=None,
                   help="ZeRO rows: hybrid sharding, shard groups of this many ranks (a "
                        "node's) replicated across the groups (default: shard over all)")
    p.add_argument("--partition", default="params", choices=PARTITIONS,
                   help="how pipeline stages are cut: params (disttrain's default) or time "
                        "(balance the profiled compute)")
    p.add_argument("--servers", type=int, default=None,
                   help="parameter servers (default: workers // 8)")
    p.add_argument("--staleness", type=int, default=2, help="ps-ssp bound")
    p.add_argument("--worker-speeds", type=_speeds, default=Speeds(),
                   help="none, lognormal:SIGMA or straggler:FRACTION:FACTOR")


def _speeds(text: str) -> Speeds:
    """``--worker-speeds``; argparse shows the message (it hides a plain ValueError's)."""
    try:
        return Speeds.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"--worker-speeds {text!r}: ")
                                         + f" (got {text!r})") from None


def _transport(name: str) -> str:
    from disttrain.bench.transports import check_transport

    try:
        return check_transport(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def load_profile(model: str, dataset: str | None, cluster: Cluster,
                 transport: str = "torch") -> ModelProfile:
    """The analytic profile for a model we have one for, else measured here."""
    from disttrain.probe.profiler import measure_registered
    from disttrain.simulate.analytic import ANALYTIC

    if model in ANALYTIC:
        return ANALYTIC[model](cluster.device_flops or 4e12)
    return measure_registered(model, dataset or ("synthetic-lm" if model == "transformer"
                                                 else "digits"), transport=transport)


def workload(args: argparse.Namespace) -> Workload:
    return Workload(batch_per_worker=args.batch_per_worker, global_batch=args.global_batch,
                    precision=args.precision, optimizer=args.optimizer,
                    algorithm=args.algorithm, bucket_mb=args.bucket_cap_mb,
                    microbatches=args.microbatches, pp_size=args.pp_size,
                    dp_shard=args.dp_shard,
                    partition=args.partition,
                    servers=args.servers, staleness=args.staleness, speeds=args.worker_speeds)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from disttrain.simulate.collectives import ALGORITHMS
    from disttrain.simulate.strategies import check_names

    if args.world_sizes is None:  # one flag for both: what is simulated, or measured
        args.world_sizes = VALIDATE_WORLD_SIZES if args.validate else DEFAULT_WORKERS
    try:
        if args.algorithm not in ALGORITHMS:
            raise ValueError(f"--algorithm must be one of {', '.join(ALGORITHMS)}")
        check_names(args.strategies)
        wl = workload(args)
        cluster = get_cluster(args.cluster, args.transport) if not args.validate else None
        if args.validate:
            from disttrain.probe.validate import check_arguments

            check_arguments(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.validate:
        from disttrain.probe.validate import run_validation

        return run_validation(args)
    assert cluster is not None
    return _simulate(args, cluster, wl)


def _simulate(args: argparse.Namespace, cluster: Cluster, wl: Workload) -> int:
    from disttrain.simulate.recommend import recommend
    from disttrain.simulate.report import text_table
    from disttrain.simulate.strategies import sweep

    try:
        profile = load_profile(args.model, args.dataset, cluster, args.transport)
    except ValueError as exc:
        print(f"disttrain simulate: {exc}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    rows = sweep(profile, cluster, wl, args.strategies, args.world_sizes)
    took = time.perf_counter() - start
    print(f"disttrain simulate: model {profile.name} ({profile.params / 1e6:.3g}M parameters, "
          f"{len(profile.layers)} layers, profile {profile.source}); cluster {cluster.name}: "
          f"{cluster.nodes} × {cluster.devices_per_node} devices, {cluster.description}; "
          f"{wl.precision}, {wl.optimizer}, " + (
              f"{wl.batch_per_worker} samples/worker" if wl.global_batch is None
              else f"global batch {wl.global_batch}"))
    if profile.overheads.measured:
        print(f"per-step costs besides the layers (measured here; host-side ones are carried "
              f"to other clusters unscaled):\n{profile.overheads.text()}")
    print(text_table(rows))
    print("\n# recommendation")
    for workers in args.world_sizes:
        print(recommend(rows, workers).text())
    print(f"\n(simulated {len(rows)} cases in {took:.2f} s)")
    env: dict[str, Any] = {"model": profile.name, "params": profile.params,
                           "cluster": cluster.name, "workload": repr(wl),
                           "command": " ".join(sys.argv)}
    if args.json:  # JSON Lines, each row with the run's settings, as bench --json writes
        write_rows(args.json, ({**row.as_dict(), "env": env} for row in rows))
    if args.plot:
        args.plot.write_text(svg(rows, f"{profile.name} on {cluster.name}"))
    return 0


def _series(rows: list[StepResult], value: Callable[[StepResult], float]
            ) -> list[tuple[str, list[tuple[float, float]]]]:
    names = list(dict.fromkeys(r.strategy for r in rows))
    series = []
    for name in names:
        pts = [(math.log2(r.workers), value(r)) for r in rows
               if r.strategy == name and r.error is None]
        series.append((name, [p for p in pts if math.isfinite(p[1])]))
    return series


def svg(rows: list[StepResult], title: str) -> str:
    """Three plots against log₂ workers (step time, memory per device, scaling efficiency),
    drawn with the benchmark's dependency-free plotting code (one SVG, nothing fetched)."""
    device = rows[0].device_memory if rows else 0.0
    plots = [
        line_plot("step", f"{title}: step time", "log2(workers)", "seconds per step",
                  _series(rows, lambda r: r.step_s)),
        line_plot("memory", f"memory per device (a device holds {device / 1e9:.0f} GB)",
                  "log2(workers)", "GB", _series(rows, lambda r: r.memory_bytes / 1e9)),
        line_plot("efficiency", "scaling efficiency", "log2(workers)", "efficiency",
                  _series(rows, lambda r: r.efficiency)),
    ]
    body = "".join(p.replace("<svg id=", f'<svg y="{i * H}" id=', 1)
                   for i, p in enumerate(plots))
    width = 760
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{3 * H}" '
            f'viewBox="0 0 {width} {3 * H}">{body}</svg>\n')
