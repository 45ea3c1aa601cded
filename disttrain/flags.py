"""The command line's one vocabulary: what each shared flag means, the old spellings kept
for one release, and ``--json FILE`` (JSON Lines of rows), for every subcommand's parser.

A flag means the same thing in every subcommand that has it (:data:`VOCABULARY`; the test
``tests/test_cli_vocabulary.py`` walks every parser and holds each flag to one destination),
and takes torchrun's word where torchrun has one. A renamed flag keeps its old spelling as a
:class:`DeprecatedAlias` that still works and says once, on stderr, which flag replaces it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

# flag → its one meaning, in every subcommand that has it (docs/cli.md shows this table)
VOCABULARY: dict[str, str] = {
    "-n": "number of worker ranks: one count where the command runs once (--nproc-per-node), "
          "a comma list where it sweeps (--world-sizes); parameter-server runs add --servers",
    "--nproc-per-node": "worker ranks started on this machine (torchrun's word)",
    "--world-sizes": "comma-separated numbers of worker ranks to run each case at",
    "--servers": "parameter-server ranks started beside the workers",
    "--global-batch": "samples per optimizer step over all workers",
    "--batch-per-worker": "samples per optimizer step on each worker",
    "--microbatches": "micro-batches per pipeline step (a comma list where the command sweeps)",
    "--pp": "pipeline stages",
    "--virtual-stages": "model chunks per pipeline stage, interleaved 1F1B (a comma list "
                        "where the command sweeps)",
    "--tp": "ranks per tensor-parallel group",
    "--dp-shard": "ZeRO's hybrid sharding: ranks per shard group, replicated across groups",
    "--meta-init": "ZeRO: the model built on the meta device, each rank materialising its "
                   "shards",
    "--activation-checkpointing": "recompute the blocks' activations in backward (none, "
                                  "full, selective)",
    "--compile": "torch.compile the model's blocks",
    "--compile-backend": "torch.compile's backend (inductor, aot_eager, ...)",
    "--comm-timeout": "seconds any collective (any rank waiting for a peer) may wait",
    "--timeout": "seconds the whole run may take",
    "--bucket-cap-mb": "megabytes per gradient bucket (torch DDP's word)",
    "--json": "write JSON Lines: one JSON object per row (FILE, or - for stdout)",
    "--transport": "how disttrain.comm moves bytes between ranks (torch, shm, auto)",
    "--algorithm": "collective algorithm of disttrain.comm (auto, ring, tree, ...)",
    "--strategies": "comma-separated strategies to compare",
    "--model": "model: a registered name or package.module:factory",
    "--model-config": "a Hugging Face model's transformers config, as a JSON file",
    "--format": "a checkpoint's format outside disttrain (dcp, safetensors)",
    "--dataset": "dataset: a registered name, tokens:PATH, text:PATH or package.module:factory",
    "--seq-len": "tokens per language-model sample",
    "--vocab-size": "vocabulary of the language-model data (token ids are below it)",
    "--token-dtype": "how a tokens:PATH file stores each id (uint16, uint32)",
    "--optimizer": "optimizer (sgd, adam, ...)",
    "--lr": "learning rate",
    "--peak-tflops": "one device's peak TFLOP/s, the yardstick of model FLOPs utilization "
                     "(auto: measured first)",
    "--precision": "number format of the training (fp32, bf16, fp16)",
    "--epochs": "passes over the training split",
    "--steps": "steps per run",
    "--warmup": "untimed iterations before the timed ones",
    "--repeat": "fresh runs of each case",
    "--eval-every": "steps between evaluations (0: only at the end)",
    "--device": "where each rank computes (auto, cpu, cuda, cuda:N)",
    "--backend": "torch.distributed backend of the ranks (auto, gloo, nccl)",
    "--bind-cores": "pin each rank to a core of its own",
    "--partition": "how a model is cut into pipeline stages",
    "--staleness": "parameter server (ps-ssp): steps a worker may run ahead of the slowest",
    "--staleness-lr": "parameter server: learning rate scaled by staleness or not",
    "--straggler": "slow some workers' steps (RANK:FACTOR[:EVERY])",
    "--module": "run the target as a module, python -m (torchrun's -m)",
}

# short flag → the long flags it may stand for (one meaning: -n is always a number of ranks)
SHORT_FLAGS: dict[str, tuple[str, ...]] = {
    "-h": ("--help",), "-v": ("--verbose",), "-n": ("--nproc-per-node", "--world-sizes"),
    "-m": ("--module",), "-p": ("--stages",),
}


GIVEN = "given_flags"  # the namespace attribute: destinations set on the command line
FROM_FILE = "config_file_flags"  # ... and those a config file set (--config)


def note_given(parser: argparse.ArgumentParser, namespace: argparse.Namespace,
               action: argparse.Action) -> None:
    """Record on ``namespace`` that ``action``'s flag was on the command line, which a
    config file must not override (``disttrain run --config``); a flag the file set that
    cannot stand beside it (``--epochs`` beside ``--steps``) falls back to its default."""
    given = getattr(namespace, GIVEN, None)
    if given is None:
        given = set()
        setattr(namespace, GIVEN, given)
    given.add(action.dest)
    from_file: set[str] = getattr(namespace, FROM_FILE, set())
    for other in exclusive_with(parser, action):
        if other.dest in from_file and other.dest not in given:
            setattr(namespace, other.dest, other.default)


def exclusive_with(parser: argparse.ArgumentParser,
                   action: argparse.Action) -> Iterator[argparse.Action]:
    """The flags of ``parser`` that may not be given with ``action``'s."""
    for group in parser._mutually_exclusive_groups:
        if action in group._group_actions:
            yield from (a for a in group._group_actions if a is not action)


class DeprecatedAlias(argparse.Action):
    """An old flag name that still works, with a one-time note naming the new one."""

    def __init__(self, *args: Any, new: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.new = new
        self.warned = False

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if not self.warned:
            new = self.new or next(a.option_strings[0] for a in parser._actions
                                   if a.dest == self.dest and a is not self)
            print(f"{parser.prog}: {option_string} is deprecated; use {new} (same meaning)",
                  file=sys.stderr)
            self.warned = True
        setattr(namespace, self.dest, values)
        note_given(parser, namespace, self)


def add_alias(container: argparse._ActionsContainer, *old: str,
              new: argparse.Action) -> argparse.Action:
    """Keep ``old`` spellings of the flag ``new`` (an action ``add_argument`` returned) for
    one release: same destination and parsing, plus a deprecation note naming the new one."""
    name = next(s for s in new.option_strings if s.startswith("--"))
    parsing: dict[str, Any] = {"type": new.type} if new.type is not None else {}
    return container.add_argument(*old, dest=new.dest, choices=new.choices,
                                  metavar=new.metavar, default=argparse.SUPPRESS,
                                  action=DeprecatedAlias, new=name,
                                  help=f"deprecated spelling of {name}", **parsing)


def add_json_argument(container: argparse._ActionsContainer, rows: str,
                      optional_file: bool = False) -> argparse.Action:
    """``--json FILE``: JSON Lines, one object per ``rows`` (e.g. "measured row"); with
    ``optional_file`` a bare ``--json`` writes to stdout."""
    extra: dict[str, Any] = {"nargs": "?", "const": Path("-")} if optional_file else {}
    return container.add_argument(
        "--json", type=Path, default=None, metavar="FILE", **extra,
        help=f"write JSON Lines to FILE (- for stdout{', the default' if optional_file else ''})"
             f": one JSON object per {rows}")


class RowWriter:
    """Writes rows as JSON Lines as they come (``with RowWriter(path) as out: out.write(row)``);
    ``path`` None writes nothing, ``-`` writes to stdout. Each line is flushed, so an
    interrupted run keeps the rows it finished."""

    def __init__(self, path: Path | str | None) -> None:
        self.path = None if path is None else Path(path)
        self._out: TextIO | None = None

    def __enter__(self) -> RowWriter:
        if self.path is not None:
            self._out = sys.stdout if str(self.path) == "-" else self.path.open("w")
        return self

    def write(self, row: Mapping[str, Any]) -> None:
        if self._out is not None:
            self._out.write(json.dumps(row) + "\n")
            self._out.flush()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._out is not None and self._out is not sys.stdout:
            self._out.close()
        self._out = None


def write_rows(path: Path | str | None, rows: Iterable[Mapping[str, Any]]) -> None:
    """Every row of ``rows`` as one JSON Lines file (nothing when ``path`` is None)."""
    with RowWriter(path) as out:
        for row in rows:
            out.write(row)


def read_rows(path: Path | str) -> list[dict[str, Any]]:
    """The rows of a JSON Lines file ``--json`` wrote."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
