"""The ``disttrain`` command: one entry point, one subcommand per job.

Each subcommand lives beside the code it drives and exposes ``configure(subparsers)``,
which adds its parser and sets ``func`` (called with the parsed args, returning an exit
code). This file only lists them.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

# module path of each subcommand, in the order ``disttrain --help`` shows them
SUBCOMMANDS = [
    "disttrain.bench.cli",
    "disttrain.simulate.cli",
    "disttrain.train.cli",
    "disttrain.train.interop.cli",
    "disttrain.launch.cli",
    "disttrain.launch.info",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="disttrain",
        description="Distributed training for PyTorch: collectives, DDP, parameter servers, "
        "pipelines and ZeRO, each measured against theory and against PyTorch.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        importlib.import_module(module).configure(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
