"""One CLI vocabulary: every flag means one thing in every subcommand, the old spellings
still work and say what replaces them, and ``--json`` always writes JSON Lines of rows.

Parser-level: nothing here starts a rank. The end-to-end ``--json`` checks live with each
command's own test (bench comm, bench pipeline, simulate, run, info); here are the writer
they share and the ones no end-to-end test reaches cheaply (simulate --validate).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from disttrain.cli import build_parser, main
from disttrain.flags import SHORT_FLAGS, VOCABULARY, DeprecatedAlias, RowWriter, read_rows

DOCS = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def subcommands(parser: argparse.ArgumentParser, name: str = "disttrain"
                ) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every parser under ``disttrain``: run, launch, bench, bench comm, ..."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                yield from subcommands(child, f"{name} {sub}")


def flags() -> Iterator[tuple[str, argparse.Action]]:
    for command, parser in subcommands(build_parser()):
        for action in parser._actions:
            if action.option_strings:
                yield command, action


def current_flags() -> dict[str, dict[str, set[str]]]:
    """long flag → {dest → commands}, the deprecated spellings left out."""
    seen: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for command, action in flags():
        if not isinstance(action, DeprecatedAlias):
            for flag in action.option_strings:
                seen[flag][action.dest].add(command)
    return seen


def test_every_flag_has_one_destination_in_every_subcommand():
    clashes = {flag: dict(dests) for flag, dests in current_flags().items()
               if len(dests) > 1 and flag not in SHORT_FLAGS}
    assert not clashes, f"one flag, several meanings: {clashes}"


def test_a_flag_shared_by_subcommands_has_its_meaning_written_down():
    shared = {flag for flag, dests in current_flags().items()
              if len({c for cs in dests.values() for c in cs}) > 1}
    missing = shared - set(VOCABULARY) - {"-h", "--help"}
    assert not missing, f"add these to disttrain.flags.VOCABULARY (one meaning each): {missing}"


def test_short_flags_keep_one_meaning():
    for command, action in flags():
        shorts = [f for f in action.option_strings if not f.startswith("--")]
        longs = [f for f in action.option_strings if f.startswith("--")]
        for short in shorts:
            if isinstance(action, DeprecatedAlias):
                continue  # an old spelling, kept for one release
            assert short in SHORT_FLAGS, f"{command}: {short} is not in SHORT_FLAGS"
            assert longs and longs[0] in SHORT_FLAGS[short], (
                f"{command}: {short} stands for {longs}, elsewhere for {SHORT_FLAGS[short]}")


def test_torchrun_words_are_kept():
    assert {"-n", "--nproc-per-node"} <= set(current_flags())
    run = dict(subcommands(build_parser()))["disttrain run"]
    assert run.parse_args(["--nproc-per-node", "3"]).nproc_per_node == 3
    launch = dict(subcommands(build_parser()))["disttrain launch"]
    for flag in ("--nnodes", "--node-rank", "--master-addr", "--master-port",
                 "--max-restarts", "--module"):
        assert any(flag in a.option_strings for a in launch._actions), flag


def test_every_deprecated_spelling_points_at_a_current_flag_and_is_documented():
    text = DOCS.read_text()
    aliases = [(command, action) for command, action in flags()
               if isinstance(action, DeprecatedAlias)]
    assert aliases
    for command, action in aliases:
        assert action.new is not None
        assert action.new in current_flags(), (command, action.option_strings)
        assert action.dest in current_flags()[action.new], (command, action.new)
        for old in action.option_strings:
            assert f"`{old}`" in text, f"docs/cli.md does not list {old} ({command})"
    for flag in VOCABULARY:
        assert f"`{flag}`" in text, f"docs/cli.md does not list {flag}"


# (argv, dest, value, new flag): each old spelling parses as before
ALIASES = [
    (["run", "--nproc", "3"], "nproc_per_node", 3, "--nproc-per-node"),
    (["run", "--batch", "64"], "global_batch", 64, "--global-batch"),
    (["run", "--pp-size", "2"], "pp_size", 2, "--pp"),
    (["simulate", "--batch", "16"], "batch_per_worker", 16, "--batch-per-worker"),
    (["simulate", "--workers", "8,64"], "world_sizes", (8, 64), "--world-sizes"),
    (["simulate", "--bucket-mb", "10"], "bucket_cap_mb", 10.0, "--bucket-cap-mb"),
    (["simulate", "--pp-size", "4"], "pp_size", 4, "--pp"),
    (["bench", "--timeout", "30"], "comm_timeout", 30.0, "--comm-timeout"),
    (["bench", "comm", "--timeout", "30"], "comm_timeout", 30.0, "--comm-timeout"),
    (["bench", "pipeline", "--timeout", "30"], "comm_timeout", 30.0, "--comm-timeout"),
    (["bench", "pipeline", "-m", "2,4"], "microbatches", (2, 4), "--microbatches"),
    (["bench", "pipeline", "--rows", "16"], "microbatch_size", 16, "--microbatch-size"),
]


@pytest.mark.parametrize(("argv", "dest", "value", "new"), ALIASES,
                         ids=[" ".join(a[0]) for a in ALIASES])
def test_an_old_spelling_warns_once_and_still_works(argv, dest, value, new, capsys):
    old = argv[-2]
    args = build_parser().parse_args([*argv, old, argv[-1]])  # given twice: one note
    assert getattr(args, dest) == value
    err = capsys.readouterr().err
    assert err.count(f"{old} is deprecated; use {new} (same meaning)") == 1, err
    assert len(err.strip().splitlines()) == 1
    fresh = build_parser().parse_args([*argv[:-2], new, argv[-1]])
    assert getattr(fresh, dest) == value and not capsys.readouterr().err


def test_simulate_n_is_what_it_simulates_or_what_validate_runs(monkeypatch):
    import disttrain.probe.validate as validate
    import disttrain.simulate.cli as simulate_cli

    seen: list[tuple[int, ...]] = []
    monkeypatch.setattr(validate, "run_validation", lambda a: seen.append(a.world_sizes) or 0)
    monkeypatch.setattr(simulate_cli, "_simulate",
                        lambda a, cluster, wl: seen.append(a.world_sizes) or 0)
    for argv in (["--validate"], ["--validate", "-n", "3"], [], ["-n", "8,16"]):
        assert main(["simulate", *argv]) == 0
    assert seen == [(2, 4), (3,), simulate_cli.DEFAULT_WORKERS, (8, 16)]


def test_every_json_flag_takes_a_file():
    jsons = [(command, a) for command, a in flags() if "--json" in a.option_strings]
    assert {c for c, _ in jsons} == {"disttrain run", "disttrain bench", "disttrain bench comm",
                                     "disttrain bench pipeline", "disttrain simulate",
                                     "disttrain info"}
    for command, action in jsons:
        assert action.metavar == "FILE" and "JSON Lines" in (action.help or ""), command


def test_row_writer_writes_one_object_per_line(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    with RowWriter(path) as out:
        out.write({"a": 1})
        assert path.read_text() == '{"a": 1}\n'  # flushed: an interrupted run keeps it
        out.write({"b": [2, 3]})
    assert read_rows(path) == [{"a": 1}, {"b": [2, 3]}]
    with RowWriter("-") as out:
        out.write({"c": None})
    assert capsys.readouterr().out == '{"c": null}\n'
    with RowWriter(None) as out:
        out.write({"nothing": True})  # no --json: writes nothing


def test_validate_json_is_json_lines(tmp_path, monkeypatch, capsys):
    import disttrain.probe.validate as validate

    rows = [{"strategy": s, "world_size": 2, "predicted_step_s": 0.018, "measured_step_s": 0.02,
             "ratio": 0.9, "error": None, "measured_step_s_runs": None} for s in ("ddp", "zero1")]
    monkeypatch.setattr(validate, "rows_for", lambda args: rows)
    path = tmp_path / "validate.jsonl"
    assert validate.run_validation(argparse.Namespace(json=path)) == 0
    written = [json.loads(line) for line in path.read_text().splitlines()]
    assert written == rows and all(r["verdict"] == "within" for r in written)
    capsys.readouterr()
