"""``disttrain bench``: benchmark subcommands (``comm`` for collectives)."""

from __future__ import annotations

import argparse


def configure(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bench = subparsers.add_parser("bench", help="run benchmarks")
    inner = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    comm = inner.add_parser("comm", help="collectives benchmark (nccl-tests style)")
    comm.set_defaults(func=_not_yet)
    bench.set_defaults(func=_not_yet)


def _not_yet(args: argparse.Namespace) -> int:
    raise SystemExit("disttrain bench: not implemented yet")
