"""``disttrain bench`` (the strategy table): one small real run checked for its JSON keys,
its bytes against DDP's ring all-reduce theory, a failing row that does not stop the table,
its Chrome trace and its HTML report; plus ``--list`` and bad arguments."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from disttrain.bench.experiments import BenchConfig, experiments, plan
from disttrain.bench.html_report import html_report
from disttrain.bench.presets import DEFAULT_PRESET, PRESETS
from disttrain.bench.report import environment, markdown_table, text_table, write_json
from disttrain.bench.strategy_bench import run_table
from disttrain.bench.trace import chrome_trace, write_traces
from disttrain.cli import main
from disttrain.train import STRATEGIES

ROW_KEYS = {"strategy", "world_size", "global_batch", "samples_per_s", "peak_mem_bytes",
            "bytes_sent_per_rank_per_step", "theory_bytes_per_rank_per_step", "accuracy",
            "final_loss", "algorithm", "transport", "speedup", "efficiency", "error"}
ENV_KEYS = {"torch", "backend", "transport", "cpu", "commit"}
CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def outcome():
    """single (n=1), then ddp on 3 ranks (rank 1 fails on purpose), then ddp on 2 ranks."""
    config = BenchConfig.from_preset(
        "lenet-digits", strategies=("ddp",), world_sizes=(3, 2), steps=6, eval_every=3,
        model="tests.bench_table_cases:lenet_failing_on_three_ranks", untimed_steps=1,
        timeout_s=30.0, global_batch=24, transport="torch", algorithm="ring")
    return config, run_table(config, trace=True)


def _row(outcome, name, n):
    return next(r for r in outcome[1].rows if r["strategy"] == name and r["world_size"] == n)


@pytest.mark.timeout(240)
def test_rows_carry_every_key_in_json(outcome, tmp_path):
    config, result = outcome
    assert [(r["strategy"], r["world_size"]) for r in result.rows] == [
        ("single", 1), ("ddp", 3), ("ddp", 2)]
    path = tmp_path / "rows.jsonl"
    write_json(path, result.rows, environment(config, "disttrain bench (test)"))
    rows = [json.loads(line) for line in path.read_text().splitlines()]  # JSON Lines
    assert len(rows) == len(result.rows)
    for row in rows:
        assert ENV_KEYS <= set(row["env"]), row["env"]
        assert row["global_batch"] == 24
    good = [r for r in rows if r["error"] is None]
    assert len(good) == 2
    for row in good:
        assert ROW_KEYS <= set(row), ROW_KEYS - set(row)
        assert row["samples_per_s"] > 0 and row["peak_mem_bytes"] > 0
        assert 0 <= row["accuracy"] <= 1 and row["final_loss"] > 0
        assert row["step_time_s_runs"] == [row["step_time_s"]]  # one run: its own median
    ddp = _row(outcome, "ddp", 2)
    assert ddp["algorithm"] == "ring" and ddp["steps"] == 6
    assert ddp["speedup"] == pytest.approx(ddp["samples_per_s"] / _row(
        outcome, "single", 1)["samples_per_s"])
    # same data, same global batch: DDP's accuracy matches the single-process reference
    assert ddp["accuracy"] == pytest.approx(ddp["reference_accuracy"], abs=0.02)


def test_ddp_ring_bytes_match_theory(outcome):
    ddp = _row(outcome, "ddp", 2)
    measured, theory = ddp["bytes_sent_per_rank_per_step"], ddp["theory_bytes_per_rank_per_step"]
    assert theory and theory > 0
    # ring on 2 ranks: each rank sends 2(p-1)/p of the gradients; chunks round to elements
    assert measured == pytest.approx(theory, abs=2 * 4 * ddp["world_size"])


def test_failing_row_is_reported_and_the_table_goes_on(outcome):
    failed = _row(outcome, "ddp", 3)
    assert "rank 1 of 3" in failed["error"] and "deliberate failure" in failed["error"]
    table = text_table(outcome[1].rows)
    assert "FAILED ddp n=3: rank 1 of 3" in table
    assert _row(outcome, "ddp", 2)["error"] is None  # the run after the failure finished
    assert "| ddp | 2 | 24 |" in markdown_table(outcome[1].rows, {"command": "x"})


def test_trace_has_spans_from_every_rank(outcome, tmp_path):
    paths = write_traces(tmp_path, outcome[1].traces)
    assert sorted(p.name for p in paths) == ["ddp-n2.trace.json", "single-n1.trace.json"]
    events = json.loads((tmp_path / "ddp-n2.trace.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    for rank in (0, 1):
        mine = [e for e in spans if e["pid"] == rank]
        steps = [e for e in mine if e["cat"] == "step"]
        assert len(steps) == 6  # one span per optimizer step
        phases = [e for e in mine if e["cat"] == "compute"]
        for name in ("forward", "backward", "optimizer"):  # one of each per step
            assert sum(e["name"] == name for e in phases) == 6, (rank, name)
        in_order = [e["name"] for e in sorted(phases, key=lambda e: e["ts"])]
        assert in_order == ["forward", "backward", "optimizer"] * 6, rank
        reduces = [e for e in mine if e["cat"] == "collective" and e["name"] == "all_reduce"]
        assert len(reduces) >= 6 and all(e["dur"] >= 0 for e in reduces)
        assert any(e["args"]["algorithm"] == "ring" for e in reduces)
        assert {e["args"]["comm"] for e in reduces} == {"world"}


@pytest.mark.timeout(120)
def test_pipeline_trace_has_one_train_step_span_per_step(tmp_path):
    """A pipeline's step is one call (forward and backward interleaved by the schedule)."""
    config = BenchConfig.from_preset("lenet-digits", strategies=("gpipe",), world_sizes=(2,),
                                     steps=10, eval_every=10, untimed_steps=1, timeout_s=30.0,
                                     global_batch=24)
    progress: list[tuple[str, int]] = []
    result = run_table(config, trace=True, on_progress=lambda run, step: progress.append(
        (run.label, step)))
    assert [r["error"] for r in result.rows] == [None, None]
    assert [step for _, step in progress] == [10, 10]  # one heartbeat per 10 steps and run
    spans = [e for e in result.traces["gpipe-n2"] if e["ph"] == "X"]
    for rank in (0, 1):
        compute = [e["name"] for e in spans if e["pid"] == rank and e["cat"] == "compute"]
        assert compute == ["train_step"] * 10, (rank, compute)
        assert any(e["cat"] == "collective" for e in spans if e["pid"] == rank)


def test_trace_labels_collectives_by_communicator():
    """A pipeline grid's ranks send through several communicators: each gets its own thread,
    and a strategy whose step is one call shows one ``train_step`` span."""
    def entry(seq: int, op: str, comm: str, t: float) -> dict:
        return {"seq": seq, "op": op, "algorithm": "ring", "nbytes": 8, "state": "completed",
                "queued_at": t, "started_at": t, "ended_at": t + 0.001, "comm": comm}

    report = {"steps": [(1, 10.0, 10.01)], "phases": [("train_step", 10.0, 10.009)],
              "collectives": [entry(0, "send", "ranks 0,1", 10.002),
                              entry(0, "all_reduce", "ranks 0,2", 10.003),
                              entry(1, "broadcast", "world", 10.008)]}
    events = chrome_trace([report, report])
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e["name"] == "thread_name"}
    spans = [e for e in events if e["ph"] == "X" and e["pid"] == 1]
    assert [e["name"] for e in spans if e["cat"] == "compute"] == ["train_step"]
    by_comm = {e["args"]["comm"]: e for e in spans if e["cat"] == "collective"}
    assert set(by_comm) == {"ranks 0,1", "ranks 0,2", "world"}
    for label, event in by_comm.items():
        assert threads[(1, event["tid"])] == f"collectives ({label})"
    assert by_comm["ranks 0,2"]["ts"] == pytest.approx(3000.0)  # µs after the first span


def test_html_report_has_its_plots(outcome):
    pytest.importorskip("matplotlib")
    page = html_report(outcome[1].rows, {"command": "disttrain bench"})
    for plot in ("plot-throughput", "plot-memory", "plot-accuracy", "plot-bytes"):
        start = page.index(f'<figure id="{plot}" class="plot"><svg')
        assert "</svg></figure>" in page[start:]
    assert "<script" not in page
    assert "<?xml" not in page and "<!DOCTYPE svg" not in page  # inline, not a document
    assert "KiB</text>" in page and "e+0" not in page  # bytes in binary units, as text
    # human units for samples/s: thousands with one decimal below 10k, none above (the
    # measured speeds are replaced by known ones, so the labels are known)
    rows = [dict(r) for r in outcome[1].rows]
    for row, speed in zip([r for r in rows if r["error"] is None], (12_345.0, 2_468.0)):
        row["samples_per_s"], row["speedup"] = speed, None
    page = html_report(rows, {"command": "disttrain bench"})
    start = page.index('<figure id="plot-throughput"')
    plot = page[start:page.index("</figure>", start)]
    assert " 12k</text>" in plot and " 2.5k</text>" in plot  # each bar's own label


def test_html_report_without_matplotlib_keeps_the_table(outcome, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    page = html_report(outcome[1].rows, {"command": "disttrain bench"})
    assert "Plots need matplotlib: pip install &#x27;disttrain[plots]&#x27;" in page
    assert "<svg" not in page and "<td>ddp</td>" in page


@pytest.mark.skipif(not CHROMIUM.exists() or importlib.util.find_spec("matplotlib") is None,
                    reason="headless Chromium or matplotlib is not installed "
                    "(/usr/bin/chromium; the test setup installs it: apt-get install -y chromium)")
@pytest.mark.timeout(120)
def test_html_report_loads_in_headless_chromium(outcome, tmp_path):
    path = tmp_path / "report.html"
    path.write_text(html_report(outcome[1].rows, {"command": "disttrain bench"}))
    dom = subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu",
                          f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom",
                          path.as_uri()], capture_output=True, text=True, timeout=90,
                         check=True).stdout
    for plot in ("plot-throughput", "plot-memory", "plot-accuracy", "plot-bytes"):
        assert f'id="{plot}"' in dom
    assert dom.count("<svg") >= 4 and dom.count("<path") >= 8


# ---------------------------------------------------------------------------- the CLI
def test_list_names_every_registered_strategy(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    start = out.index("experiments (--strategies):")
    listed = [line.split()[0] for line in out[start + 1:]]
    assert sorted(listed) == sorted(STRATEGIES)
    assert listed[0] == "single"
    assert experiments()["ddp"].compare_to == "torch-ddp"
    assert experiments()["zero3"].compare_to == "torch-fsdp"
    assert experiments()["zero2"].compare_to_deepspeed == "deepspeed-zero2"
    presets = [line.split()[0] for line in out[1:start]]
    assert presets == list(PRESETS) and "[default]" in out[1 + presets.index(DEFAULT_PRESET)]


@pytest.mark.parametrize("argv, message", [
    (["--strategies", "ddp,nope"], "unknown strategy 'nope'"),
    (["-n", "0"], "world sizes ≥ 1"),
    (["-n", "two"], "comma-separated integers"),
    (["--steps", "0"], "--steps must be an integer ≥ 1"),
    (["--repeat", "0"], "--repeat must be an integer ≥ 1"),
    (["--transport", "carrier-pigeon"], "unknown transport 'carrier-pigeon'"),
    (["--epochs", "1", "--steps", "2"], "not allowed with argument"),
    (["--servers", "0"], "--servers must be an integer ≥ 1"),
    (["--staleness", "-1"], "--staleness must be an integer ≥ 0"),
    (["--straggler", "1"], "is not RANK:FACTOR"),
    (["--straggler", "1:0.5"], "must be a finite number ≥ 1"),
    (["--eval-every", "-1"], "--eval-every must be ≥ 0"),
])
def test_bad_arguments_are_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_plan_runs_the_reference_once_and_respects_caps():
    config = BenchConfig(strategies=("ddp", "single"), world_sizes=(1, 2, 4))
    assert [(r.experiment.name, r.world_size) for r in plan(config)] == [
        ("single", 1), ("ddp", 1), ("ddp", 2), ("ddp", 4)]


def test_bench_comm_is_still_a_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "comm", "--help"])
    assert exit_info.value.code == 0
    assert "collectives" in capsys.readouterr().out


def test_parameter_server_rows_add_their_servers_and_take_their_options():
    from disttrain.bench.strategy_bench import train_config

    config = BenchConfig(strategies=("ps-sync", "ps-ssp", "ddp"), world_sizes=(2, 4),
                         servers=2, staleness=1, straggler=((1, 2.0),))
    runs = plan(config)
    assert [(r.label, r.ranks) for r in runs] == [
        ("single n=1", 1), ("ddp n=2", 2), ("ddp n=4", 4), ("ps-sync n=2+2", 4),
        ("ps-sync n=4+2", 6), ("ps-ssp n=2+2", 4), ("ps-ssp n=4+2", 6)]
    options = {r.label: train_config(config, r).parallel for r in runs}
    assert options["ps-ssp n=2+2"].staleness == 1 and options["ps-sync n=2+2"].staleness is None
    assert (options["ps-sync n=4+2"].straggler, options["ps-sync n=4+2"].servers) == (
        ((1, 2.0),), 2)
    assert options["ddp n=2"].straggler == () and options["ddp n=2"].servers is None


@pytest.mark.timeout(240)
def test_a_parameter_server_row_reports_the_workers_rate_and_staleness():
    from disttrain.bench.strategy_bench import add_comparisons, make_row, run_once

    config = BenchConfig.from_preset("lenet-digits", strategies=("ps-async",),
                                     world_sizes=(2,), steps=10, eval_every=0, model="mlp",
                                     untimed_steps=1, timeout_s=30.0, straggler=((1, 2.0),))
    run = plan(config)[1]  # the reference is left out: it is not what this test is about
    progress: list[int] = []  # rank 0's heartbeat; the server's rank takes no steps
    row = make_row(config, run, [run_once(config, run, False,
                                          on_progress=lambda _, step: progress.append(step))])
    add_comparisons(row, [row])
    rows = [row]
    assert row["error"] is None and (row["world_size"], row["servers"]) == (2, 1)
    assert progress == [10]
    assert row["samples_per_s"] == row["extras"]["samples_per_s"] > 0
    assert sum(row["extras"]["staleness"].values()) == 2 * 10  # one update per worker step
    assert row["bytes_sent_per_rank_per_step"] == row["theory_bytes_per_rank_per_step"]
    table = text_table(rows)
    assert "ps-async  2+1" in table and "ps-async n=2+1: staleness {" in table
    assert "straggler rank 1 ×2" in table


# ------------------------------------------------------------- repeats spread over the table
def _fake_runs(monkeypatch, fail=None, interrupt=None):
    """run_once and make_row replaced: records the order of the fresh runs; ``fail`` =
    (label, k): that label's k-th run raises a BenchError; ``interrupt``: the n-th run (0-based)
    raises KeyboardInterrupt."""
    from disttrain.bench import strategy_bench as sb
    from disttrain.bench.ranks import BenchError

    order = []

    def run_once(config, run, trace, on_progress):
        if interrupt is not None and len(order) == interrupt:
            raise KeyboardInterrupt
        order.append(run.label)
        if fail is not None and (run.label, order.count(run.label)) == fail:
            raise BenchError(f"rank 1 of {run.world_size} died (from the test)")
        return [{"label": run.label}]

    def make_row(config, run, repeats):
        return {**sb.base_row(config, run), "samples_per_s": 1.0, "accuracy": 0.5,
                "final_loss": 1.0, "repeats": len(repeats)}

    monkeypatch.setattr(sb, "run_once", run_once)
    monkeypatch.setattr(sb, "make_row", make_row)
    return order


def test_repeats_go_round_the_table_and_rows_come_in_plan_order(monkeypatch):
    order = _fake_runs(monkeypatch)
    config = BenchConfig(strategies=("ddp",), world_sizes=(2, 4), steps=2, repeat=3)
    starts, rows_seen = [], []
    outcome = run_table(config, on_row=lambda r: rows_seen.append(r["world_size"]),
                        on_start=lambda i, n, run: starts.append((i, n, run.label)))
    labels = ["single n=1", "ddp n=2", "ddp n=4"]
    assert order == labels * 3  # not single, single, single, ddp n=2, ...
    assert starts == [(i, 9, label) for i, label in enumerate(labels * 3)]
    assert [(r["strategy"], r["world_size"], r["repeats"]) for r in outcome.rows] == [
        ("single", 1, 3), ("ddp", 2, 3), ("ddp", 4, 3)]
    assert rows_seen == [1, 2, 4] and not outcome.interrupted
    assert outcome.rows[1]["speedup"] == 1.0  # compared with the reference row


def test_a_run_that_fails_in_a_later_repeat_is_not_run_again(monkeypatch):
    order = _fake_runs(monkeypatch, fail=("ddp n=2", 2))
    config = BenchConfig(strategies=("ddp",), world_sizes=(2,), steps=2, repeat=3)
    outcome = run_table(config)
    assert order == ["single n=1", "ddp n=2", "single n=1", "ddp n=2", "single n=1"]
    single, ddp = outcome.rows
    assert single["repeats"] == 3 and single["error"] is None
    assert "rank 1 of 2 died" in ddp["error"]


def test_ctrl_c_keeps_the_runs_with_a_finished_repeat(monkeypatch):
    order = _fake_runs(monkeypatch, interrupt=4)  # single, ddp2, ddp4, single, then Ctrl-C
    config = BenchConfig(strategies=("ddp",), world_sizes=(2, 4), steps=2, repeat=3)
    outcome = run_table(config)
    assert outcome.interrupted and len(order) == 4
    assert [(r["world_size"], r["repeats"]) for r in outcome.rows] == [(1, 2), (2, 1), (4, 1)]


def test_a_refused_run_is_announced_once_and_never_started(monkeypatch):
    order = _fake_runs(monkeypatch)
    config = BenchConfig(strategies=("ddp", "gpipe"), world_sizes=(3,), steps=2,
                         global_batch=32, repeat=2)  # 32 does not split over 3 ddp ranks
    starts = []
    outcome = run_table(config, on_start=lambda i, n, run: starts.append((i, n, run.label)))
    assert order == ["single n=1", "gpipe n=3"] * 2
    assert starts == [(0, 5, "single n=1"), (1, 5, "gpipe n=3"), (2, 5, "single n=1"),
                      (3, 5, "ddp n=3"), (4, 5, "gpipe n=3")]
    assert [r["strategy"] for r in outcome.rows] == ["single", "ddp", "gpipe"]
    assert "does not split evenly" in outcome.rows[1]["error"]
