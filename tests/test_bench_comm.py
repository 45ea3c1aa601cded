"""``disttrain bench comm``: units, statistics, rows, calibration fits, bytes against theory on
real ranks, the command end to end, its errors, and its clean-up on Ctrl-C and on failures."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from disttrain.bench import cases
from disttrain.bench.calibrate import LARGE_A, LARGE_B, NATIVE_LARGE, NATIVE_SMALL, fit
from disttrain.bench.comm import (
    COPY_BYTES,
    CommBenchConfig,
    copy_after,
    copy_row,
    make_row,
    plan,
)
from disttrain.bench.comm_job import Timing, round_order, run_plan, start_barrier
from disttrain.bench.ranks import BenchError, RankGroup, bind_plan
from disttrain.bench.timing import (
    bandwidths,
    busbw_factor,
    copy_bandwidth,
    percentile,
    slowest_rank,
)
from disttrain.bench.units import format_size, parse_size, parse_sizes, size_range
from disttrain.comm import ALGORITHMS, LinkCosts
from disttrain.comm.cost_model import predict, theory_bytes_sent

ROOT = Path(__file__).resolve().parent.parent
NOT_ON_TORCH = {"native", "shm", "hierarchical"}  # native hides its bytes; shm needs the shm
# transport; hierarchical bytes depend on the node layout, not on p alone


# ---------------------------------------------------------------------------- pure parts
@pytest.mark.parametrize("text, value", [
    ("4096", 4096), ("512B", 512), ("4KiB", 4096), ("4 KiB", 4096), ("4k", 4096),
    ("16MiB", 16 << 20), ("16MB", 16 << 20), ("1GiB", 1 << 30), ("1.5KiB", 1536),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "KiB", "4XB", "-4KiB", "0", "1.3B", "4 TiB"])
def test_parse_size_rejects_with_the_accepted_forms(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_size_lists_and_formatting():
    assert parse_sizes("16MiB,4KiB,4096") == [4096, 16 << 20]
    assert size_range(4 << 10, 64 << 20, 16) == [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
    assert size_range(1, 8, 2) == [1, 2, 4, 8]
    assert [format_size(n) for n in (512, 4096, 1536, 64 << 20)] == [
        "512 B", "4 KiB", "1.5 KiB", "64 MiB"]


def test_busbw_factors_follow_nccl_tests():
    assert busbw_factor("all_reduce", 4) == 1.5
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert busbw_factor(op, 4) == 0.75
    assert busbw_factor("broadcast", 4) == busbw_factor("reduce", 8) == 1.0
    algbw, busbw = bandwidths("all_reduce", 2, 2_000_000_000, 2.0)
    assert (algbw, busbw) == (1.0, 1.0)
    with pytest.raises(ValueError, match="bus-bandwidth"):
        busbw_factor("barrier", 2)


def test_slowest_rank_and_percentiles():
    assert slowest_rank([[1, 5, 3], [2, 4, 6]]) == [2, 5, 6]
    with pytest.raises(ValueError, match="iteration counts"):
        slowest_rank([[1, 2], [1]])
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.5
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0


def _report(times, sent, correct=True, chosen="ring"):
    return {"times": times, "bytes_sent": sent, "correct": correct, "chosen": chosen,
            "nbytes": 1 << 20, "transport": "torch"}


def test_make_row_takes_the_slowest_rank_and_all_checks():
    per_rank = [_report([1e-3, 4e-3, 2e-3], 700_000.0), _report([2e-3, 1e-3, 3e-3], 786_432.0)]
    row = make_row("all_reduce", "auto", 2, per_rank, lambda t: LinkCosts())
    assert row["time_p50_s"] == 3e-3 and row["time_p99_s"] == pytest.approx(3.98e-3)
    assert row["algbw_GBps"] == pytest.approx((1 << 20) / 3e-3 / 1e9)
    assert row["busbw_GBps"] == row["algbw_GBps"]  # 2(p−1)/p = 1 for p = 2
    assert row["bytes_sent_per_rank"] == 786_432.0
    assert row["theory_bytes_per_rank"] == theory_bytes_sent("all_reduce", "ring", 2, 1 << 20)
    assert row["model_s"] == predict("all_reduce", "ring", 2, 1 << 20, LinkCosts())
    assert row["correct"] and row["chosen"] == "ring" and row["algorithm"] == "auto"
    per_rank[1]["correct"] = False
    assert not make_row("all_reduce", "ring", 2, per_rank, lambda t: LinkCosts())["correct"]
    native = make_row("all_reduce", "native", 2, [_report([1e-3], 0.0, chosen="native")] * 2)
    assert native["bytes_sent_per_rank"] is None and native["theory_bytes_per_rank"] is None


def test_config_validation_and_plan():
    with pytest.raises(ValueError, match="bogus"):
        CommBenchConfig(ops=("bogus",))
    with pytest.raises(ValueError, match="bruck"):
        CommBenchConfig(algorithms=("bruck",))
    with pytest.raises(ValueError, match=r"known: .*torch"):
        CommBenchConfig(transport="carrier-pigeon")
    with pytest.raises(ValueError, match="≥ 2"):
        CommBenchConfig(world_sizes=(1,))
    config = CommBenchConfig(ops=("broadcast", "all_reduce"), algorithms=("ring", "auto"),
                             sizes=(4096, 8192))
    assert plan(config) == [("broadcast", "auto", 4096), ("broadcast", "auto", 8192),
                            ("all_reduce", "ring", 4096), ("all_reduce", "auto", 4096),
                            ("all_reduce", "ring", 8192), ("all_reduce", "auto", 8192)]
    every = plan(CommBenchConfig(ops=("all_to_all",), sizes=(4096,)))
    assert [a for _, a, _ in every] == [*ALGORITHMS["all_to_all"], "auto"]


def _synthetic_samples(alpha, beta, alpha_x, beta_x, gamma, native, partner=True):
    def line(a, b, n, trips):  # round trips of ping-pong (2 messages) or exchange steps
        return [trips * (a + n * b)] * 40

    return {
        "ping_pong_tiny": line(alpha, beta, 4, 2) if partner else [],
        "ping_pong_a": line(alpha, beta, LARGE_A, 2), "ping_pong_b": line(alpha, beta, LARGE_B, 2),
        "exchange_tiny": line(alpha_x, beta_x, 4, 1),
        "exchange_a": line(alpha_x, beta_x, LARGE_A, 1),
        "exchange_b": line(alpha_x, beta_x, LARGE_B, 1),
        "add": [gamma * LARGE_B] * 20,
        "native_small": [native(NATIVE_SMALL)] * 50, "native_large": [native(NATIVE_LARGE)] * 10,
    }


def test_calibration_fit_recovers_the_constants():
    truth = LinkCosts(alpha=80e-6, beta=1 / 3e9, gamma=1 / 20e9, alpha_exchange=300e-6,
                      beta_exchange=1 / 1.5e9, native_alpha=50e-6, native_beta=1 / 4e9)

    def native(n):
        return predict("all_reduce", "native", 3, n, truth)

    args = (truth.alpha, truth.beta, truth.alpha_exchange, truth.beta_exchange, truth.gamma,
            native)
    per_rank = [_synthetic_samples(*args), _synthetic_samples(*args),
                _synthetic_samples(*args, partner=False)]  # rank 2 of 3 has no partner
    got = fit(3, per_rank, 1 << 20)
    for name in ("beta", "gamma", "beta_exchange", "native_alpha", "native_beta"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    # the tiny messages carry 4 bytes: α absorbs their 4·β
    assert got.alpha == pytest.approx(truth.alpha + 4 * truth.beta, rel=1e-6)
    assert got.alpha_exchange == pytest.approx(300e-6 + 4 * truth.beta_exchange, rel=1e-6)
    with pytest.raises(ValueError, match="partner"):
        fit(3, [per_rank[2]], 1 << 20)


# ---------------------------------------------------------------------------- real ranks
_THEORY_BYTES = 4 * 12 * 64  # 768 float32: splits evenly into 2, 3 and 4 ranks and halves


def count_bytes_of_every_algorithm(comm):
    """Run every (op, algorithm) once on a benchmark case; bytes this rank sent, and checks."""
    sent, correct = {}, {}
    for op in cases.BENCHMARKED_OPS:
        case = cases.build(comm, op, _THEORY_BYTES)
        for algorithm in ALGORITHMS[op]:
            if algorithm in NOT_ON_TORCH:
                continue
            case.reset()
            before = comm.stats.snapshot().get(op, {}).get("bytes_sent", 0)
            case.run(algorithm)
            sent[op, algorithm] = comm.stats.snapshot()[op]["bytes_sent"] - before
            correct[op, algorithm] = case.check()
    before = comm.stats.snapshot().get("barrier", {}).get("bytes_sent", 0)
    for algorithm in ("naive", "tree"):
        comm.barrier(algorithm=algorithm)
    sent["barrier", "naive+tree"] = comm.stats.snapshot()["barrier"]["bytes_sent"] - before
    return sent, correct


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_theory_bytes_match_the_counters_of_real_runs(pools, world_size):
    per_rank = pools(world_size).run(count_bytes_of_every_algorithm)
    p = world_size
    for key in per_rank[0][0]:
        busiest = max(sent[key] for sent, _ in per_rank)
        if key[0] == "barrier":
            barrier_naive, barrier_tree = p - 1, theory_bytes_sent("barrier", "tree", p, 0)
            assert busiest <= barrier_naive + barrier_tree and busiest >= barrier_naive
            continue
        nbytes = cases.elements(key[0], _THEORY_BYTES, p) * cases.ELEMENT_SIZE
        assert busiest == theory_bytes_sent(*key, p, nbytes), (key, p)
        assert all(correct[key] for _, correct in per_rank), (key, p)


def _fail_on_rank_one(comm, emit, how):
    emit("first")
    # rank 0's report is in its pipe before rank 1 fails: the group raises as soon as an
    # error arrives, and without the barrier a slow rank 0 made the first round incomplete
    comm.barrier()
    if comm.rank == 1:
        if how == "raise":
            raise RuntimeError("boom from the test")
        os._exit(7)
    emit("second")


@pytest.mark.parametrize("how, message", [("raise", "raised:.*boom from the test"),
                                          ("die", "died \\(exit code 7\\)")])
def test_a_failing_rank_is_named_and_every_rank_stopped(how, message):
    group = RankGroup(2, _fail_on_rank_one, (how,), transport="torch", timeout_s=20,
                      describe=lambda i: f"report #{i}")
    procs = list(group.ranks.processes)
    reports = group.reports()
    assert next(reports) == ["first", "first"]
    with pytest.raises(BenchError, match=f"(?s)rank 1 of 2 {message}.*report #1"):
        next(reports)
    assert not any(proc.is_alive() for proc in procs)



def test_a_rank_that_cannot_start_raises_its_own_error(monkeypatch):
    """Starting rank 1 fails: rank 0 is stopped and the caller sees the start's error, not
    the AssertionError of joining a process that never started."""
    from disttrain.launch.ranks import rank_context

    process = rank_context().Process  # the class RankGroup starts its ranks with
    started = []
    real_start = process.start

    def start(self):
        if started:
            raise OSError("no more processes (from the test)")
        started.append(self)
        real_start(self)

    monkeypatch.setattr(process, "start", start)
    with pytest.raises(OSError, match="no more processes"):
        RankGroup(2, _fail_on_rank_one, ("raise",), transport="torch", timeout_s=20)
    assert len(started) == 1 and not started[0].is_alive()

# ---------------------------------------------------------------------------- the command
def _disttrain(*args, env=None, **kwargs):
    return subprocess.run([sys.executable, "-m", "disttrain", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240, **kwargs)


KEYS = {"op", "algorithm", "chosen", "transport", "world_size", "bytes", "time_p50_s",
        "time_p99_s", "algbw_GBps", "busbw_GBps", "bytes_sent_per_rank",
        "theory_bytes_per_rank", "correct", "model_s", "iters"}


def test_bench_comm_end_to_end(tmp_path):
    out = tmp_path / "out.json"
    env = {**os.environ, "DISTTRAIN_CALIBRATION": str(tmp_path / "none.json")}
    result = _disttrain("bench", "comm", "--sizes", "4KiB", "--ops", "all_reduce", "-n", "2",
                        "--iters", "3", "--warmup", "1", "--json", str(out), env=env)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    expected = [a for a in ALGORITHMS["all_reduce"] if a != "shm"] + ["auto"]
    assert [r["algorithm"] for r in rows] == expected
    for row in rows:
        assert KEYS <= row.keys(), KEYS - row.keys()
        assert row["correct"] is True and row["iters"] == 3 and row["world_size"] == 2
        assert row["bytes"] == 4096 and row["time_p99_s"] >= row["time_p50_s"] > 0
        if row["chosen"] not in ("native", "hierarchical"):
            assert row["bytes_sent_per_rank"] == row["theory_bytes_per_rank"]
    assert rows[-1]["chosen"] in ALGORITHMS["all_reduce"]
    assert "auto against the fastest" in result.stdout and "tree" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--ops", "all_reduce,teleport"], "unknown or missing ops \\['teleport'\\]"),
    (["--transport", "carrier-pigeon"], "unknown transport 'carrier-pigeon'; known: .*torch"),
    (["--sizes", "4XB"], "cannot read size '4XB'"),
    (["--algorithms", "bruck"], "unknown or missing algorithms \\['bruck'\\]"),
    (["-n", "1"], "world sizes must be ≥ 2"),
])
def test_bad_arguments_exit_non_zero_with_the_fix(capsys, args, message):
    from disttrain.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "comm", *args])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def _processes_with(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if marker.encode() in environ:
            found.append(int(pid))
    return found


def test_ctrl_c_stops_every_rank(tmp_path):
    marker = f"DISTTRAIN_TEST_MARKER={uuid.uuid4()}"
    env = {**os.environ, "DISTTRAIN_CALIBRATION": str(tmp_path / "none.json"),
           marker.split("=")[0]: marker.split("=")[1]}
    proc = subprocess.Popen(
        [sys.executable, "-m", "disttrain", "bench", "comm", "--ops", "all_reduce", "-n", "2",
         "--sizes", "4KiB", "--iters", "100000", "--budget", "0"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # a shell's background job (`cmd &`) inherits SIGINT ignored, and Python then never
        # raises KeyboardInterrupt: give the bench the default, as a terminal would
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while len(_processes_with(marker)) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2.0)  # the ranks are initialized and timing
        assert len(_processes_with(marker)) >= 3, "the ranks never started"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    deadline = time.monotonic() + 10
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_with(marker) == [], "ranks outlived Ctrl-C"


def test_ctrl_c_while_a_rank_starts_waits_until_it_is_recorded():
    """Ctrl-C inside Process.start could lose a rank's pid, and the rank then outlived the
    command (the test above, 2 runs in 8): RankGroup starts ranks with SIGINT held back."""
    from disttrain.launch.ranks import ctrl_c_deferred

    reached = []
    # A shell's background job starts with SIGINT ignored, and the deferral rightly keeps
    # it ignored: give this test the handler an interactive Python has.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with ctrl_c_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # a SIGINT let through would raise here
                reached.append("the block ran to its end")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert reached == ["the block ran to its end"]


def test_ctrl_c_ignored_by_the_parent_stays_ignored():
    """A job started with SIGINT ignored (nohup, a shell's background job) is not
    interrupted by the deferral either: the held-back signal goes to the ignoring handler."""
    from disttrain.launch.ranks import ctrl_c_deferred

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with ctrl_c_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


# ---------------------------------------------------------------------------- shm rows
def test_copy_bandwidth_and_its_reference_row():
    seconds, gbps = copy_bandwidth(1 << 20, repeats=2)
    assert seconds > 0 and gbps == pytest.approx((1 << 20) / seconds / 1e9)
    with pytest.raises(ValueError, match="nbytes > 0"):
        copy_bandwidth(0)
    row = copy_row(4, "shm", 0.004, 16.8)
    assert KEYS <= row.keys() and row["op"] == "copy" and row["world_size"] == 4
    assert row["busbw_GBps"] == row["algbw_GBps"] == 16.8 and row["bytes"] == COPY_BYTES
    assert row["bytes_sent_per_rank"] is None and row["correct"] is True


def test_copy_row_follows_the_largest_all_reduce():
    config = CommBenchConfig(ops=("all_reduce", "broadcast"), algorithms=("auto", "native"),
                             sizes=(4096, 1 << 20), transport="shm")
    cases_p = plan(config)
    at = copy_after(cases_p)
    assert cases_p[at] == ("all_reduce", "native", 1 << 20)
    assert copy_after([("broadcast", "auto", 4096), ("broadcast", "native", 4096)]) == 1


class _Transport:
    def __init__(self, name, native_group):
        self.name, self.native_group = name, native_group


class _Comm:
    def __init__(self, name, native_group):
        self.transport = _Transport(name, native_group)


def test_timed_calls_start_from_the_tightest_barrier():
    assert start_barrier(_Comm("shm", object())) == "shm"  # shm rows and native rows alike
    assert start_barrier(_Comm("torch", object())) == "native"
    assert start_barrier(_Comm("torch", None)) is None


def test_bench_comm_on_shm_reports_the_copy_bandwidth(tmp_path):
    """Also: --shared-buffers (512 KiB is above the one-shot limit, so auto's shm all-reduce
    runs in place on the shared tensor) and --interleave (same number of calls each)."""
    out = tmp_path / "out.json"
    env = {**os.environ, "DISTTRAIN_CALIBRATION": str(tmp_path / "none.json")}
    result = _disttrain("bench", "comm", "--transport", "shm", "--algorithms", "auto,native",
                        "--sizes", "4KiB,512KiB", "--ops", "all_reduce", "-n", "2", "--iters",
                        "3", "--warmup", "1", "--shared-buffers", "--interleave",
                        "--json", str(out), env=env)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["op"], r["chosen"], r["bytes"]) for r in rows] == [
        ("all_reduce", "shm", 4096), ("all_reduce", "native", 4096),
        ("all_reduce", "shm", 512 << 10), ("all_reduce", "native", 512 << 10),
        ("copy", "np.copyto 1 core", 64 << 20)]
    assert rows[0]["bytes_sent_per_rank"] == 4096 and all(r["correct"] for r in rows)
    assert rows[2]["bytes_sent_per_rank"] == 512 << 10
    assert all(r["shared_buffers"] and r["interleaved"] and r["iters"] == 3 for r in rows[:4])
    assert rows[4]["busbw_GBps"] > 0 and "np.copyto 1 core" in result.stdout
    assert "shared buffers; algorithms interleaved call by call" in result.stdout

def _report_affinity(comm, emit):
    emit(sorted(os.sched_getaffinity(0)))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_bound_ranks_each_run_on_their_own_core():
    plan = bind_plan(2)
    with RankGroup(2, _report_affinity, (), transport="torch", timeout_s=20,
                   bind_cores=True) as group:
        (cores,) = list(group.reports())
    if plan is None:  # fewer than 2 cores: nothing is bound
        assert cores[0] == cores[1] == sorted(os.sched_getaffinity(0))
    else:
        assert cores == [[plan[0]], [plan[1]]] and plan[0] != plan[1]
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) > 1:  # a whole multiple of the cores: as many ranks on each, in turn
        n = 3 * len(usable)
        assert bind_plan(n) == [usable[r % len(usable)] for r in range(n)]
    assert bind_plan(3 * len(usable) + 1) is None  # otherwise the kernel shares them


def test_a_size_whose_algorithms_all_refuse_is_skipped_interleaved_or_not():
    """Interleaving with nothing left to time must not divide by zero: every rank reports
    the refusal (``shm`` cannot run on the torch transport)."""
    plan = [("all_reduce", "shm", 4096), ("all_reduce", "shm", 8192)]
    for interleave in (False, True):
        with RankGroup(2, run_plan, (plan, Timing(3, 0, 0.0), False, interleave),
                       transport="torch", timeout_s=20) as group:
            reports = list(group.reports())
        assert len(reports) == 2
        assert all("'shm' cannot run on the 'torch' transport" in r["skipped"]
                   for per_rank in reports for r in per_rank)


def test_interleaved_rounds_shuffle_so_no_algorithm_always_follows_the_same_one():
    """Every rank must call the same algorithm at the same time (the order depends on the
    round only), and a call must not always come right after the same other algorithm: the
    call before can slow it (a rotation put auto behind native in 5 rounds of 6)."""
    algos = ["naive", "ring", "tree", "halving_doubling", "native", "auto"]
    rounds = [round_order(algos, i) for i in range(600)]
    assert all(sorted(r) == sorted(algos) for r in rounds)
    assert rounds == [round_order(list(algos), i) for i in range(600)]  # same on every rank
    calls = [a for r in rounds for a in r]
    pairs = list(itertools.pairwise(calls))
    behind = set(pairs)
    after_native = pairs.count(("native", "auto"))
    assert {(x, y) for x in algos for y in algos if x != y} <= behind
    assert after_native < 0.35 * 600  # a rotation: ~500 of 600


def test_auto_is_compared_with_the_algorithms_it_chooses_from():
    """``hierarchical`` (only ever run by name; in one machine the shared-memory all-reduce)
    is shown beside the line when it beat auto, not taken as the best: the yardstick for the
    cost model's pick is the set it picks from."""
    from disttrain.bench.table import auto_versus_best

    def row(algorithm, p50, chosen=None, nbytes=4096):
        return {"op": "all_reduce", "world_size": 2, "bytes": nbytes, "algorithm": algorithm,
                "time_p50_s": p50, "chosen": chosen or algorithm}

    rows = [row("auto", 300e-6, "naive"), row("tree", 250e-6), row("naive", 320e-6),
            row("hierarchical", 120e-6),
            row("auto", 2.0e-3, "tree", 1 << 20), row("tree", 2.1e-3, nbytes=1 << 20),
            row("hierarchical", 2.5e-3, nbytes=1 << 20)]
    small, large = auto_versus_best(rows)
    assert "best tree" in small and "auto/best 1.20" in small
    assert "(hierarchical, by name only: 120 µs, auto/it 2.50)" in small
    assert "auto/best 0.95" in large and "hierarchical" not in large  # slower: not shown
    # with nothing held back, or nothing else measured, hierarchical is the yardstick again
    assert "best hierarchical" in auto_versus_best(rows, by_name_only=())[0]
    alone = auto_versus_best([r for r in rows if r["algorithm"] in ("auto", "hierarchical")])
    assert "best hierarchical" in alone[0] and "by name only" not in alone[0]
