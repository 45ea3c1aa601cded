"""``disttrain bench``: benchmark subcommands (``comm`` for collectives).

``disttrain bench comm`` maps its flags onto :class:`~disttrain.bench.comm.CommBenchConfig`,
prints a table as rows are measured, optionally writes them as JSON Lines
(``--json``), and ends with ``auto`` against the best algorithm at each size.
``--calibrate`` measures this machine's costs for the cost model instead.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, TextIO

from disttrain.bench import comm as comm_bench
from disttrain.bench import pipeline_bench, strategy_cli
from disttrain.bench.ranks import BenchError
from disttrain.bench.table import TableWriter, auto_versus_best, format_time
from disttrain.bench.transports import TRANSPORTS
from disttrain.bench.units import format_size, parse_sizes
from disttrain.comm.transports import gloo_threads
from disttrain.flags import RowWriter, add_alias, add_json_argument


def _csv(parse: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    def read(text: str) -> tuple[Any, ...]:
        try:
            items = tuple(parse(p.strip()) for p in text.split(",") if p.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        return items

    return read


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(parse_sizes(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_comm_parser(inner: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    defaults = comm_bench.CommBenchConfig()
    parser = inner.add_parser(
        "comm", help="collectives benchmark (nccl-tests style)",
        description="Time every collective × algorithm × size × world size on local ranks, "
        "check every result, and compare bytes sent with theory and times with the cost model.")
    parser.add_argument("--ops", type=_csv(str), default=defaults.ops,
                        help=f"comma-separated collectives (default: {','.join(defaults.ops)})")
    parser.add_argument("--algorithms", type=_csv(str), default=None,
                        help="comma-separated algorithms (default: every registered one for "
                        "each op, plus auto)")
    parser.add_argument("--sizes", type=_sizes, default=defaults.sizes,
                        help="comma-separated sizes, e.g. 4KiB,16MiB (nccl-tests convention: "
                        "the whole buffer; default: 4KiB,64KiB,1MiB,16MiB,64MiB)")
    parser.add_argument("-n", "--world-sizes", type=_csv(int), default=defaults.world_sizes,
                        help="comma-separated numbers of ranks (default: 2,4)")
    parser.add_argument("--transport", default=defaults.transport,
                        help=f"transport to measure (known: {', '.join(TRANSPORTS)})")
    parser.add_argument("--iters", type=int, default=defaults.iters,
                        help=f"timed iterations per row, at most (default {defaults.iters})")
    parser.add_argument("--warmup", type=int, default=defaults.warmup,
                        help="untimed calls after the first (checked) one "
                        f"(default {defaults.warmup})")
    parser.add_argument("--budget", type=float, default=defaults.budget_s,
                        help="seconds per row: fewer iterations when --iters would take longer; "
                        f"0 always runs --iters (default {defaults.budget_s:g})")
    timeout = parser.add_argument(
        "--comm-timeout", type=float, default=defaults.timeout_s,
        help=f"seconds any rank waits for a peer (default {defaults.timeout_s:g})")
    add_alias(parser, "--timeout", new=timeout)
    add_json_argument(parser, "measured row, as it is measured")
    parser.add_argument("--shared-buffers", action="store_true",
                        help="all_reduce, broadcast and reduce work on tensors from "
                        "Communicator.shared_zeros: on the shm transport a large all_reduce "
                        "then reads the other ranks' tensors in place, with no copy in "
                        "(like nccl-tests -R); other transports see ordinary tensors")
    parser.add_argument("--interleave", action="store_true",
                        help="time the algorithms of each size call by call in shuffled "
                        "order instead of one block each, so that all see the same load "
                        "(fairer ratios on a busy or oversubscribed machine)")
    parser.add_argument("--bind-cores", action="store_true",
                        help="pin each rank to a core of its own when there are enough cores "
                        "(as many ranks on every core when the ranks are a multiple of them)")
    parser.add_argument("--calibrate", action="store_true",
                        help="instead of benchmarking, measure this machine's α, β, γ and "
                        "native costs at each world size of -n and store them for the cost "
                        "model that algorithm='auto' uses")
    parser.set_defaults(func=lambda args: _run_comm(args, parser))


def configure(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bench = subparsers.add_parser(
        "bench", help="run benchmarks (no subcommand: the strategy comparison table)",
        description="`disttrain bench` trains every registered strategy on the same model and "
        "prints them side by side (throughput, memory, bytes on the wire, accuracy); "
        "`disttrain bench comm` times the collectives.")
    strategy_cli.add_arguments(bench)
    inner = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    _add_comm_parser(inner)
    pipeline_bench.add_parser(inner)
    bench.set_defaults(func=lambda args: strategy_cli.run(args, bench))


def _run_comm(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        config = comm_bench.CommBenchConfig(
            ops=args.ops, algorithms=args.algorithms, sizes=args.sizes,
            world_sizes=args.world_sizes, transport=args.transport, iters=args.iters,
            warmup=args.warmup, budget_s=args.budget, timeout_s=args.comm_timeout,
            shared_buffers=args.shared_buffers, interleave=args.interleave,
            bind_cores=args.bind_cores)
        gloo_io = gloo_threads.policy_from_env()  # a typo in the variable: said here, once
    except ValueError as exc:
        parser.error(str(exc))
    if args.calibrate:
        return _calibrate(config)
    out = sys.stdout
    print(f"disttrain bench comm: ops {','.join(config.ops)}; sizes "
          f"{','.join(format_size(s) for s in config.sizes)}; world sizes "
          f"{','.join(map(str, config.world_sizes))}; transport {config.transport}"
          + ("; shared buffers" if config.shared_buffers else "")
          + ("; algorithms interleaved call by call" if config.interleave else "")
          + ("; ranks bound to cores" if config.bind_cores else "")
          + f"; Gloo I/O threads {gloo_io}", file=out)
    skipped: list[str] = []
    try:
        with RowWriter(args.json) as json_rows:
            rows = comm_bench.run(config, _on_row(TableWriter(out), json_rows), skipped.append)
    except BenchError as exc:
        print(f"disttrain bench comm: {exc}", file=sys.stderr)
        return 1
    _summary(rows, skipped, out)
    if not rows:
        print("disttrain bench comm: nothing could run; see the skipped cases above",
              file=sys.stderr)
        return 1
    return 0 if all(r["correct"] for r in rows) else 1


def _on_row(table: TableWriter, json_rows: RowWriter) -> Callable[[dict[str, Any]], None]:
    def on_row(row: dict[str, Any]) -> None:
        table.row(row)
        json_rows.write(row)

    return on_row


def _summary(rows: list[dict[str, Any]], skipped: list[str], out: TextIO) -> None:
    if skipped:
        print("\n# skipped (cannot run on this transport)", file=out)
        print("\n".join(sorted(set(skipped))), file=out)
    lines = auto_versus_best(rows)
    if lines:
        print("\n# auto against the fastest algorithm it chooses from (p50) at each size",
              file=out)
        print("\n".join(lines), file=out)
    wrong = [r for r in rows if not r["correct"]]
    if wrong:
        print(f"\n{len(wrong)} row(s) gave WRONG results: "
              + "; ".join(f"{r['op']}/{r['algorithm']} p={r['world_size']} {r['bytes']} B"
                          for r in wrong), file=out)


def _calibrate(config: comm_bench.CommBenchConfig) -> int:
    from disttrain.bench.calibrate import calibrate

    print(f"calibrating transport {config.transport!r} on {','.join(map(str, config.world_sizes))}"
          " ranks (about 40-80 s per world size)...", flush=True)
    costs, path = calibrate(config.transport, config.world_sizes, config.timeout_s)
    print(f"stored in {path} (set DISTTRAIN_CALIBRATION to use another file):")
    print(f"{'ranks':>5s}  {'alpha':>9s}  {'1/beta':>10s}  {'alpha_x':>9s}  {'1/beta_x':>10s}  "
          f"{'1/gamma':>10s}  {'native_a':>9s}  {'1/native_b':>10s}")
    for p, c in costs.by_world_size:
        print(f"{p:>5d}  {format_time(c.alpha):>9s}  {_rate(c.beta):>10s}  "
              f"{format_time(c.ax):>9s}  {_rate(c.bx):>10s}  {_rate(c.gamma):>10s}  "
              f"{format_time(c.native_alpha):>9s}  {_rate(c.native_beta):>10s}")
    print(f"chunk_bytes {format_size(costs.chunk_bytes)} (ring sub-chunk; the default, "
          "chosen by measurement in docs/benchmarks.md)")
    print("alpha: one-way message; alpha_x/beta_x: a step that sends and receives at once; "
          "gamma: reduction; native: torch.distributed's own all_reduce (docs/cost_model.md)")
    for p, c in costs.by_world_size:
        print(f"measured tables on {p} ranks (p50, slowest rank; auto compares these):")
        for key, points in c.measured:
            print(f"  {key:<32s} " + "  ".join(f"{format_size(n)} {format_time(t)}"
                                             for n, t in points))
    return 0


def _rate(seconds_per_byte: float) -> str:
    return "inf" if seconds_per_byte == 0 else f"{1 / seconds_per_byte / 1e9:.2f} GB/s"
