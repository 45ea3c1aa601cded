"""Simulated strategies reproduce closed forms: the GPipe/1F1B bubble, DDP hiding its
communication behind backward, a synchronous parameter server waiting for its slowest
worker; plus the CLI end to end on an analytic profile (no processes)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from disttrain.cli import main
from disttrain.comm.cost_model import LinkCosts
from disttrain.parallel.pipeline.schedule_check import simulate as simulate_schedule
from disttrain.parallel.pipeline.schedules import get_schedule
from disttrain.simulate.base import Case
from disttrain.simulate.cluster import Cluster, Link
from disttrain.simulate.data_parallel import simulate_ddp
from disttrain.simulate.parameter_server import simulate_ps
from disttrain.simulate.pipeline import simulate_pipeline
from disttrain.simulate.profile import LayerProfile, ModelProfile
from disttrain.simulate.recommend import recommend
from disttrain.simulate.strategies import STRATEGIES, sweep
from disttrain.simulate.workload import Speeds, Workload

MIB = 1 << 20


def _profile(layers: int, fwd: float = 1.0, bwd: float = 1.0, params: int = 0,
             out_bytes: float = 0.0) -> ModelProfile:
    """``layers`` identical layers; times per sample (batch 1 → fwd, bwd seconds)."""
    return ModelProfile("toy", tuple(
        LayerProfile(f"l{i}", 0.0, fwd, 0.0, bwd, params, 0.0, out_bytes)
        for i in range(layers)), reference_flops=1.0, optimizer_s_per_param=0.0)


def _cluster(costs: LinkCosts, devices: int = 64) -> Cluster:
    """One node whose links cost exactly ``costs`` (device_flops None: times as profiled)."""
    return Cluster("toy", 1, devices, 1e12, Link(1.0, 1.0), Link(1.0, 1.0), gamma=1.0,
                   intra_costs=costs)


FREE = LinkCosts(alpha=0.0, beta=0.0, gamma=0.0, native_alpha=0.0, native_beta=0.0)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(2, 1), (2, 4), (4, 8), (8, 8), (4, 3)])
def test_pipeline_bubble_is_the_closed_form(name: str, p: int, m: int) -> None:
    case = Case(_profile(p), _cluster(FREE), Workload(global_batch=m, microbatches=m,
                                                      pp_size=p), p)
    row = simulate_pipeline(case, name)
    assert row.details["bubble"] == pytest.approx((p - 1) / (m + p - 1))
    assert row.step_s == pytest.approx(2 * (m + p - 1))  # F and B of one micro-batch: 1 each
    # the pipeline package's own checker of the same table agrees
    assert simulate_schedule(get_schedule(name, p, m)).bubble == pytest.approx(
        row.details["bubble"])


def test_1f1b_holds_fewer_micro_batches_than_gpipe() -> None:
    profile = ModelProfile("toy", tuple(LayerProfile(f"l{i}", 0, 1, 0, 1, 0, 1e6, 0)
                                        for i in range(4)), 1.0, 0.0)
    case = Case(profile, _cluster(FREE), Workload(global_batch=16, microbatches=16,
                                                  pp_size=4), 4)
    gpipe, one_f = simulate_pipeline(case, "gpipe"), simulate_pipeline(case, "1f1b")
    assert one_f.memory_bytes == pytest.approx(gpipe.memory_bytes * 4 / 16)


def _ddp_case(seconds_per_bucket: float, layers: int = 6) -> Case:
    # each layer: 256 Ki float32 parameters = 1 MiB, its own bucket (1 MiB caps);
    # a 2-rank ring all-reduce of n bytes costs n·β_x (γ = α = 0)
    beta = seconds_per_bucket / MIB
    costs = LinkCosts(alpha=0.0, beta=beta, gamma=0.0, native_alpha=0.0)
    wl = Workload(global_batch=2, bucket_mb=1.0, first_bucket_mb=1.0, algorithm="ring")
    return Case(_profile(layers, 1.0, 2.0, params=MIB // 4), _cluster(costs), wl, 2)


def test_ddp_hides_communication_shorter_than_backward() -> None:
    row = simulate_ddp(_ddp_case(0.5))
    compute = 6 * (1.0 + 2.0)
    # every bucket but the last (layer 0's, ready when backward ends) overlaps backward
    assert row.step_s == pytest.approx(compute + 0.5)
    assert row.details["exposed_comm_s"] == pytest.approx(0.5)


def test_ddp_exposes_communication_longer_than_backward() -> None:
    row = simulate_ddp(_ddp_case(5.0))
    # 6 all-reduces of 5 s queue on the link; the first starts when layer 5's backward ends
    assert row.step_s == pytest.approx(6 * 1.0 + 2.0 + 6 * 5.0)


def test_ps_sync_step_is_the_slowest_worker() -> None:
    speeds = Speeds("straggler", fraction=1 / 8, factor=3.0)
    wl = Workload(global_batch=8, servers=1, clocks=4, speeds=speeds)
    case = Case(_profile(3), _cluster(FREE), wl, 8)
    compute = 3 * 2.0  # three layers, forward + backward on one sample each
    sync = simulate_ps(case, "sync")
    assert sync.step_s == pytest.approx(3.0 * compute)
    # asynchronous workers are not held back: 7 at full speed, 1 at a third
    asyn = simulate_ps(case, "async")
    assert asyn.step_s == pytest.approx(8 / (7 / compute + 1 / (3 * compute)))
    ssp = simulate_ps(case, "ssp")
    assert asyn.step_s <= ssp.step_s <= sync.step_s


def test_every_strategy_at_4096_workers_keeps_events_bounded() -> None:
    from disttrain.simulate.analytic import resnet101

    cluster = Cluster("big", 512, 8, 80e9, Link(5e-6, 300e9), Link(1e-5, 50e9),
                      device_flops=1.5e14, gamma=1e-12)
    wl = Workload(batch_per_worker=32, speeds=Speeds("lognormal", sigma=0.1))
    rows = sweep(resnet101(1.5e14), cluster, wl, tuple(STRATEGIES), (4096,))
    assert len(rows) == len(STRATEGIES)
    simulated = [r for r in rows if r.error is None]
    assert {r.strategy for r in simulated} >= {"ddp", "zero1", "zero2", "zero3", "ps-sync"}
    assert all(0 < r.details["events"] < 5000 for r in simulated), [
        (r.strategy, r.details.get("events")) for r in simulated]
    assert any(r.error for r in rows)  # model parallel over 4096 devices: marked
    ddp = next(r for r in rows if r.strategy == "ddp")
    assert 0 < ddp.efficiency <= 1


def test_recommendation_marks_what_does_not_fit() -> None:
    from disttrain.simulate.analytic import resnet101

    small = Cluster("small", 2, 4, 4e9, Link(5e-6, 300e9), Link(1e-5, 50e9),
                    device_flops=1e13)
    rows = sweep(resnet101(1e13), small, Workload(batch_per_worker=64),
                 ("ddp", "zero3", "gpipe"), (8,))
    rec = recommend(rows, 8)
    text = rec.text()
    assert "does not fit" in text and "ddp" in text
    assert len(rec.lines) == 3 or rec.strategy is None


def test_cli_table_json_plot_and_recommendation(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    out, plot = tmp_path / "rows.jsonl", tmp_path / "plot.svg"
    code = main(["simulate", "--model", "resnet101", "--cluster", "roce-25g", "--batch-per-worker",
                 "64", "-n", "8,512", "--strategies", "ddp,zero3,ps-sync,gpipe",
                 "--json", str(out), "--plot", str(plot)])
    assert code == 0
    text = capsys.readouterr().out
    assert "# recommendation" in text and "512 workers:" in text
    rows = [json.loads(x) for x in out.read_text().splitlines()]  # JSON Lines of rows
    assert all(r["env"]["model"] == "resnet101" for r in rows)
    assert {(r["strategy"], r["workers"]) for r in rows} == {
        (s, w) for s in ("ddp", "zero3", "ps-sync", "gpipe") for w in (8, 512)}
    assert plot.read_text().startswith("<svg") and "efficiency" in plot.read_text()


@pytest.mark.parametrize("algorithm", ["tree", "hierarchical", "halving_doubling"])
def test_cli_runs_every_strategy_with_every_algorithm(tmp_path: Path, algorithm: str,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    # roce-25g has 4 devices per node: 3 workers on one node, 8 on two, 12 on three (p not
    # a power of two: halving/doubling folds). reduce_scatter and all_gather have no tree.
    out = tmp_path / "rows.jsonl"
    code = main(["simulate", "--model", "resnet101", "--cluster", "roce-25g", "-n",
                 "3,8,12", "--algorithm", algorithm, "--json", str(out)])
    assert code == 0
    capsys.readouterr()
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert {r["strategy"] for r in rows} == set(STRATEGIES)
    for r in rows:
        if r["strategy"] in ("ddp", "zero1", "zero2", "zero3"):
            assert r.get("error") is None and r["step_s"] > 0, r
            used = set(r["details"]["algorithm"].split(","))
            allowed = {algorithm, "ring", "halving_doubling"}
            assert used <= allowed, r
            if r["strategy"] == "ddp":  # all_reduce has them all (hierarchical: > 1 node)
                one_node = algorithm == "hierarchical" and r["workers"] <= 4
                assert used == {"ring" if one_node else algorithm}, r


def test_cli_rejects_unknown_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--strategies", "ddp,magic"])
    assert "magic" in capsys.readouterr().err


def test_validate_rejects_micro_batches_the_bench_does_not_run(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:  # before anything is profiled or measured
        main(["simulate", "--validate", "--microbatches", "4", "-n", "2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--microbatches 4 cannot be validated" in err and "--microbatches 8" in err


@pytest.mark.parametrize("world_size", [2, 4])
def test_validate_predicts_every_locally_runnable_strategy(world_size: int) -> None:
    from dataclasses import replace

    from disttrain.probe.validate import predicted, single_step
    from disttrain.simulate.overheads import Overheads
    from disttrain.train.strategies import STRATEGIES as RUNNABLE

    profile = _profile(4, fwd=1e-4, bwd=2e-4, params=1000, out_bytes=400.0)
    paying = replace(profile, overheads=Overheads(step_s=1e-3, sgd_fixed_s=1e-4,
                                                  collective_call_s=1e-4))
    assert single_step(paying, 32) == pytest.approx(profile.compute(32) + 1e-3 + 1e-4)
    for name in STRATEGIES:
        if name not in RUNNABLE or RUNNABLE[name].layout == "mesh":
            continue  # tensor parallelism needs a transformer: test_simulate_tensor_parallel
        bare = predicted(profile, name, world_size, 32, 8)
        assert 0 < bare < predicted(paying, name, world_size, 32, 8), name


@pytest.mark.parametrize(("args", "bound"), [([], True), (["--no-bind-cores"], False),
                                             (["--bind-cores"], True)])
def test_validate_binds_ranks_to_cores_unless_told_not_to(
        args: list[str], bound: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """By default the validation's runs give each rank a core of its own where there are
    enough, as the model assumes; the kernel's own placement is one option away."""
    import disttrain.probe.validate as validate

    seen: list[bool] = []
    monkeypatch.setattr(validate, "run_validation", lambda a: seen.append(a.bind_cores) or 0)
    assert main(["simulate", "--validate", "-n", "2", *args]) == 0
    assert seen == [bound]


@pytest.mark.parametrize(("args", "message"), [
    (["--repeat", "0"], "--repeat must be an integer ≥ 1"),
    (["--partition", "time"], "--partition time cannot be validated"),
])
def test_validate_rejects_what_the_bench_cannot_measure(
        args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:  # before anything is profiled or measured
        main(["simulate", "--validate", "-n", "2", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_simulate_rejects_an_unknown_transport(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:  # before anything is profiled or measured
        main(["simulate", "--validate", "-n", "2", "--transport", "carrier-pigeon"])
    assert exc.value.code == 2
    assert "unknown transport 'carrier-pigeon'; known: " in capsys.readouterr().err


class _Rounds:
    """A stand-in for LayerRounds: counts its rounds, and its profile is ``later``."""

    def __init__(self, later: ModelProfile) -> None:
        self.later, self.taken, self.closed = later, 0, False
        self.inputs = (None, [0.0] * 32)
        self.overheads: list[object] = []

    def sample(self) -> None:
        self.taken += 1

    def sample_overheads(self) -> None:
        self.overheads.append(self.taken)  # how many runs had started

    def close(self) -> None:
        self.closed = True

    def totals(self) -> list[float]:
        return [1e-3] * self.taken

    def profile(self, base: ModelProfile) -> ModelProfile:
        return self.later


def test_validate_predicts_before_it_measures(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prediction the model cannot make fails before the minutes of benchmark runs (it
    once failed after them). Each row is then predicted again from the profile with the
    layer rounds taken before every run (one per run, one after the last), and keeps the
    prediction made up front beside it."""
    import argparse

    import disttrain.probe.validate as validate

    profile = _profile(4, fwd=1e-4, bwd=2e-4, params=1000, out_bytes=400.0)
    later = _profile(4, fwd=3e-4, bwd=2e-4, params=1000, out_bytes=400.0)
    rounds = _Rounds(later)
    profiled: list[object] = []  # probes placed for bound runs or not
    monkeypatch.setattr(validate, "registered_rounds",
                        lambda *a, **k: profiled.append(k.get("bind_cores")) or (profile, rounds))
    ran: list[object] = []
    monkeypatch.setattr(validate, "run_table", lambda config, **k: ran.append(config))
    args = argparse.Namespace(strategies=["ddp", "gpipe"], dataset=None, model="lenet",
                              transport="torch", world_sizes=[2, 4], steps=5,
                              global_batch=None, repeat=1, microbatches=8,
                              bind_cores=True)

    def broken(_profile: object, name: str, *rest: object) -> float:
        if name == "gpipe":
            raise ValueError("task 'x': duration must be ≥ 0 seconds")
        return 1.0

    monkeypatch.setattr(validate, "predicted", broken)
    with pytest.raises(ValueError, match="duration must be"):
        validate.rows_for(args)
    assert ran == []  # nothing was measured
    assert rounds.closed  # and the profile's loop was let go
    rounds.closed = False

    calls: list[tuple[object, str, int]] = []

    def counting(prof: ModelProfile, name: str, world_size: int, *rest: object) -> float:
        calls.append((prof, name, world_size))
        return 0.5 if prof is profile else 0.75

    monkeypatch.setattr(validate, "predicted", counting)
    rows = [{"strategy": "ddp", "world_size": 2, "step_time_s": 0.25, "error": None},
            {"strategy": "gpipe", "world_size": 4, "step_time_s": 0.5, "error": None}]

    bound: list[bool] = []

    def table(config: Any, on_start: Any) -> SimpleNamespace:
        bound.append(config.bind_cores)
        runs = rows * config.repeat  # the table goes round
        for i, row in enumerate(runs):
            on_start(i, len(runs), SimpleNamespace(label=row["strategy"]))
        return SimpleNamespace(rows=rows)

    monkeypatch.setattr(validate, "run_table", table)
    out = validate.rows_for(args)
    keys = [("ddp", 2), ("ddp", 4), ("gpipe", 2), ("gpipe", 4)]
    assert sorted((n, w) for p, n, w in calls if p is profile) == keys  # once each, first
    assert sorted((n, w) for p, n, w in calls if p is later) == keys  # then again
    assert rounds.taken == len(rows) + 1
    assert rounds.overheads == [len(rows) + 1] and rounds.closed  # after the last run
    assert out[0]["predicted_step_s"] == 0.75 and out[0]["ratio"] == 3.0
    assert out[0]["predicted_before_runs_s"] == 0.5
    assert out[1]["ratio"] == 1.5

    rounds = _Rounds(later)  # three rounds of the table: the overheads before the 2nd, 3rd
    monkeypatch.setattr(validate, "registered_rounds",
                        lambda *a, **k: profiled.append(k.get("bind_cores")) or (profile, rounds))
    validate.rows_for(argparse.Namespace(**{**vars(args), "repeat": 3, "bind_cores": False}))
    assert rounds.overheads == [2, 4, 7] and rounds.closed
    assert bound == [True, False]  # the runs are placed as --[no-]bind-cores says
    assert profiled == [True, True, False]  # and so are the probes for them


def test_validate_compares_the_median_fresh_run() -> None:
    from disttrain.probe.validate import measured_step, runs_text

    assert measured_step({"step_time_s": 9.0, "step_time_s_runs": [3.0, 1.5, 2.0]}) == 2.0
    assert measured_step({"step_time_s": 9.0, "step_time_s_runs": [3.0, None, 2.0]}) == 2.0
    assert measured_step({"step_time_s": 9.0, "step_time_s_runs": [3.0, 1.5, 2.0, 2.5]}) == 2.0
    assert measured_step({"step_time_s": 9.0}) == 9.0  # rows written before the runs key
    assert measured_step({"step_time_s": None, "step_time_s_runs": []}) is None
    assert runs_text([3e-3, None, 2e-3]) == "; runs 3.00, 2.00 ms"  # every run is printed
    assert runs_text([3e-3]) == runs_text(None) == ""


def test_a_runs_step_time_is_its_slowest_ranks_median_not_a_maximum_per_step() -> None:
    """Ranks of one synchronous job take turns at the long steps (each waits at its own
    offset round the collective): the first two ranks both run at 2 s a step, though
    each step's maximum is 3 s; a third rank at 2.5 s a step is the slowest."""
    from types import SimpleNamespace

    from disttrain.bench.experiments import BenchConfig
    from disttrain.bench.strategy_bench import _median_step

    config = BenchConfig(untimed_steps=2)
    warm_up = [50.0, 50.0]
    ranks = [SimpleNamespace(step_times=warm_up + [1.0, 3.0] * 4),
             SimpleNamespace(step_times=warm_up + [3.0, 1.0] * 4),
             SimpleNamespace(step_times=warm_up + [2.5] * 8)]
    assert _median_step(config, ranks) == 2.5  # type: ignore[arg-type]
    assert _median_step(config, ranks[:2]) == 2.0  # type: ignore[arg-type]
    assert _median_step(config, [SimpleNamespace(step_times=[])]) is None  # type: ignore[arg-type]
    # a run shorter than its warm-up still has a time: all of its steps
    assert _median_step(config, [SimpleNamespace(step_times=[4.0])]) == 4.0  # type: ignore[arg-type]
