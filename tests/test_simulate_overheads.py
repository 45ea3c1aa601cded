"""The pieces a step pays besides its layers (measured ``Overheads``) and ranks sharing
cores, as events: fixed profile numbers in, exact timelines out (no timing assertions),
plus one run of the real measurement on a tiny model (values only checked for sanity)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

from disttrain.comm.cost_model import LinkCosts
from disttrain.simulate.base import Case
from disttrain.simulate.cluster import Cluster, Link
from disttrain.simulate.data_parallel import simulate_ddp, simulate_zero3, simulate_zero12
from disttrain.simulate.events import Simulation
from disttrain.simulate.overheads import Overheads
from disttrain.simulate.parameter_server import PULL_MESSAGES, PUSH_MESSAGES, simulate_ps
from disttrain.simulate.pipeline import simulate_pipeline
from disttrain.simulate.profile import LayerProfile, ModelProfile
from disttrain.simulate.workload import Workload

FREE = LinkCosts(alpha=0.0, beta=0.0, gamma=0.0, native_alpha=0.0, native_beta=0.0)
PAYS = Overheads(step_s=0.5, sgd_fixed_s=0.25, sgd_s_per_byte=1e-3, adam_fixed_s=1.0,
                 adam_s_per_byte=4e-3, optimizer_tensor_s=0.125, collective_call_s=0.75,
                 hook_s_per_tensor=0.0625, zero_s={1: 3.0, 2: 5.0, 3: 8.0})


def _profile(layers: int = 4, params: int = 100, overheads: Overheads = PAYS) -> ModelProfile:
    """Layers of 1 s forward and 2 s backward per sample, two tensors each."""
    return ModelProfile("toy", tuple(LayerProfile(f"l{i}", 0.0, 1.0, 0.0, 2.0, params, 0.0,
                                                  0.0, tensors=2) for i in range(layers)),
                        reference_flops=1.0, optimizer_s_per_param=0.0, overheads=overheads)


def _cluster(costs: LinkCosts = FREE, cores: int = 0) -> Cluster:
    return Cluster("toy", 1, 64, 1e12, Link(1.0, 1.0), Link(1.0, 1.0), gamma=1e-300,
                   intra_costs=costs, shared_cores=cores)


def _case(workers: int, overheads: Overheads = PAYS, cores: int = 0,
          costs: LinkCosts = FREE, **workload: object) -> Case:
    wl = Workload(global_batch=workers, algorithm="ring", **workload)  # type: ignore[arg-type]
    return Case(_profile(overheads=overheads), _cluster(costs, cores), wl, workers)


# ---------------------------------------------------------------------------- the engine
def test_tasks_on_shared_cores_slow_each_other_only_while_they_overlap() -> None:
    sim = Simulation(cores=2)
    for r in range(4):
        sim.resource(f"r{r}", load=1)
    first = [sim.add(f"a{r}", f"r{r}", 1.0) for r in range(4)]  # 4 runnable on 2 cores
    alone = sim.add("alone", "r0", 1.0, (first[0],))
    link = sim.add("msg", "link", 0.5, (first[1],))  # not on the cores: full speed
    assert sim.run() == pytest.approx(3.0)
    assert [sim.end(t) for t in first] == pytest.approx([2.0] * 4)
    assert (sim.start(alone), sim.end(alone)) == pytest.approx((2.0, 3.0))
    assert (sim.start(link), sim.end(link)) == pytest.approx((2.0, 2.5))
    assert sim.busy("r0") == pytest.approx(3.0)  # wall time, stretched


def test_a_representative_load_and_unequal_tasks_share_cores() -> None:
    sim = Simulation(cores=1)
    sim.resource("a", load=1)
    sim.resource("b", load=1)
    short, long = sim.add("s", "a", 1.0), sim.add("l", "b", 3.0)
    assert sim.run() == pytest.approx(4.0)  # both at half speed until s ends at 2
    assert (sim.end(short), sim.end(long)) == pytest.approx((2.0, 4.0))
    rep = Simulation(cores=2)
    rep.resource("p4", load=4)  # one task standing for 4 ranks on 2 cores
    rep.add("x", "p4", 1.0)
    assert rep.run() == pytest.approx(2.0)
    off = Simulation()  # cores=0: loads are ignored
    off.resource("p4", load=4)
    off.add("x", "p4", 1.0)
    assert off.run() == pytest.approx(1.0)


def test_measured_slowdown_applies_only_while_several_cores_compute() -> None:
    sim = Simulation(cores=2, slowdown=1.5)
    sim.resource("a", load=1)
    sim.resource("b", load=1)
    together = [sim.add("a0", "a", 3.0), sim.add("b0", "b", 3.0)]  # both cores: ×1.5
    alone = sim.add("a1", "a", 1.0, (together[1],))  # one core busy: full speed
    assert sim.run() == pytest.approx(5.5)
    assert [sim.end(t) for t in together] == pytest.approx([4.5, 4.5])
    assert (sim.start(alone), sim.end(alone)) == pytest.approx((4.5, 5.5))
    four = Simulation(cores=2, slowdown=1.5)  # oversubscribed: shared, and slowed
    four.resource("p4", load=4)
    four.add("x", "p4", 1.0)
    assert four.run() == pytest.approx(3.0)


def test_engine_rejects_negative_cores_and_conflicting_loads() -> None:
    with pytest.raises(ValueError, match="cores"):
        Simulation(cores=-1)
    with pytest.raises(ValueError, match="slowdown"):
        Simulation(cores=2, slowdown=0.5)
    sim = Simulation(cores=2)
    sim.resource("r", load=1)
    with pytest.raises(ValueError, match="load"):
        sim.resource("r", load=2)
    with pytest.raises(ValueError, match="load"):
        sim.resource("q", load=-1)


# ---------------------------------------------------------------------------- overheads
def test_overheads_validate_name_and_price_the_optimizer() -> None:
    with pytest.raises(ValueError, match="collective_call_s"):
        Overheads(collective_call_s=-1.0)
    with pytest.raises(ValueError, match="concurrent_slowdown"):
        Overheads(concurrent_slowdown=0.9)
    assert not Overheads(concurrent_slowdown=1.3).measured  # a ratio, not a cost
    assert not Overheads().measured and PAYS.measured
    assert PAYS.optimizer("sgd", 400.0, tensors=3) == pytest.approx(0.25 + 0.4 + 2 * 0.125)
    assert PAYS.optimizer("adam", 400.0) == pytest.approx(1.0 + 1.6)
    text = PAYS.text()
    assert all(name in text for name, _ in PAYS.named()) and "zero3_s" in text
    # without measured overheads the profile falls back to its per-parameter rate
    bare = ModelProfile("toy", _profile().layers, 1.0, 0.01)
    assert bare.optimizer(100, "adam", 8) == pytest.approx(1.0)


def test_ddp_timeline_pays_loop_hooks_call_and_optimizer() -> None:
    row = simulate_ddp(_case(2))  # 4 layers × 100 fp32 = 1.6 kB: one bucket
    compute = 4 * (1.0 + 2.0)
    hooks = 4 * 2 * 0.0625
    opt = 0.25 + 1600 * 1e-3 + 7 * 0.125  # 8 tensors
    # loop, F, B (+hooks), then the bucket's call on the link, then the optimizer
    assert row.step_s == pytest.approx(0.5 + compute + hooks + 0.75 + opt)
    bare = simulate_ddp(_case(2, Overheads()))
    assert bare.step_s == pytest.approx(compute)


def test_zero_stages_pay_their_calls_and_their_own_work() -> None:
    one = simulate_zero12(_case(2), 1)
    compute, opt = 4 * 3.0, 0.25 + 800 * 1e-3  # SGD on Ψ/2
    # loop, F, B, call + reduce-scatter, optimizer, call + all-gather, ZeRO's own work
    assert one.step_s == pytest.approx(0.5 + compute + 0.75 + opt + 0.75 + 3.0)
    three = simulate_zero3(_case(2))
    # every F and B carries 8 / (2·4) s of ZeRO-3's gather-and-free work; prefetched
    # gathers' calls hide behind compute (0.75 s < 2 s), the loop behind the first call.
    # Critical path: call agF0, F0..F3 (2 s each), call agB3, B3..B0 (3 s each), call rs0,
    # optimizer on Ψ/2 in one flat tensor
    assert three.step_s == pytest.approx(0.75 + 4 * 2.0 + 0.75 + 4 * 3.0 + 0.75 + opt)


def test_wakeup_after_compute_is_charged_only_where_ranks_share_cores() -> None:
    wake = Overheads(collective_wakeup_s=0.25)
    plain = simulate_ddp(_case(2, Overheads()))
    assert simulate_ddp(_case(2, wake)).step_s == pytest.approx(plain.step_s)  # a cluster
    # this machine (2 ranks on 2 cores): the one bucket's all-reduce waits 0.25 s more
    assert simulate_ddp(_case(2, wake, cores=2)).step_s == pytest.approx(plain.step_s + 0.25)
    # ZeRO-1: its reduce-scatter and its all-gather both follow compute
    zero = simulate_zero12(_case(2, Overheads()), 1)
    assert simulate_zero12(_case(2, wake, cores=2), 1).step_s == pytest.approx(
        zero.step_s + 0.5)


def test_zero3_gathers_only_layers_with_parameters() -> None:
    layers = tuple(LayerProfile(f"l{i}", 0.0, 1.0, 0.0, 2.0, 100 if i % 2 == 0 else 0, 0.0,
                                0.0, tensors=2 if i % 2 == 0 else 0) for i in range(4))
    profile = ModelProfile("toy", layers, 1.0, 0.0,
                           overheads=Overheads(step_s=0.5, collective_call_s=0.75))
    row = simulate_zero3(Case(profile, _cluster(), Workload(global_batch=2), 2))
    # loop, 4 F, 4 B, optimizer; 2 units × (gather, gather, reduce-scatter) × (call, op)
    assert row.details["events"] == 1 + 4 + 4 + 1 + 2 * 3 * 2


def test_ps_round_trips_are_charged_per_protocol_message() -> None:
    alpha = 0.01
    costs = LinkCosts(alpha=alpha, beta=0.0, gamma=0.0, native_alpha=0.0)
    clocks = 3
    row = simulate_ps(_case(2, Overheads(step_s=0.5), costs=costs, servers=1, clocks=clocks),
                      "sync")
    compute = 4 * 3.0 + 0.5  # one sample each, plus the loop
    per_clock = compute + PUSH_MESSAGES * alpha + PULL_MESSAGES * alpha
    assert row.step_s == pytest.approx((PULL_MESSAGES * alpha + clocks * per_clock) / clocks)


def test_measured_ps_exchanges_replace_the_message_formula_on_one_host() -> None:
    """A pull and a push probed through disttrain's server (1 worker, 1 server) are charged
    once per worker: the server answers one request at a time."""
    alpha, pull, push, clocks = 0.01, 0.2, 0.3, 3
    costs = LinkCosts(alpha=alpha, beta=0.0, gamma=0.0, native_alpha=0.0)
    probed = Overheads(step_s=0.5, ps_pull_s=pull, ps_push_s=push)
    row = simulate_ps(_case(2, probed, costs=costs, servers=1, clocks=clocks), "sync")
    compute = 4 * 3.0 + 0.5
    per_clock = compute + 2 * push + 2 * pull  # two workers, one representative of weight 2
    assert row.step_s == pytest.approx((2 * pull + clocks * per_clock) / clocks)
    # on a cluster (not one host) the probe says nothing: the α-β formula stays
    case = _case(2, probed, costs=costs, servers=1, clocks=clocks)
    cluster = replace(case.cluster, nodes=2)
    formula = simulate_ps(replace(case, cluster=cluster), "sync")
    plain = simulate_ps(replace(case, cluster=cluster,
                                profile=_profile(overheads=Overheads(step_s=0.5))), "sync")
    assert formula.step_s == pytest.approx(plain.step_s) != pytest.approx(row.step_s)


def test_with_the_served_share_probed_only_that_share_is_served_in_turn() -> None:
    """Pull 0.2 s and push 0.3 s, of which a second worker added 0.25 s to the probe's
    clock (served: 0.1 of the pull, 0.15 of the push): two workers wait for the served
    shares in turn and run their own shares side by side, 0.75 s of exchange per clock
    instead of 2 × 0.5 s."""
    clocks = 3
    split = Overheads(step_s=0.5, ps_pull_s=0.2, ps_push_s=0.3, ps_served_s=0.25)
    row = simulate_ps(_case(2, split, servers=1, clocks=clocks), "sync")
    compute = 4 * 3.0 + 0.5
    per_clock = compute + (0.15 + 2 * 0.15) + (2 * 0.1 + 0.1)  # push: own, served; pull
    assert row.step_s == pytest.approx((2 * 0.1 + 0.1 + clocks * per_clock) / clocks)
    assert dict(split.named())["ps_served_s"] == 0.25
    # a second worker that added the whole exchange (the probe caps it there) is the
    # whole-exchange rule, whatever the rounding (these floats left the rest at −2e-19)
    pull, push = 0.0018457309997756965, 0.003204242999345297
    capped = Overheads(step_s=0.5, ps_pull_s=pull, ps_push_s=push, ps_served_s=pull + push)
    for workers in (1, 2, 4):
        assert simulate_ps(_case(workers, capped, servers=1, clocks=clocks), "sync").step_s \
            == pytest.approx(simulate_ps(_case(workers, replace(capped, ps_served_s=0.0),
                                               servers=1, clocks=clocks), "sync").step_s)
    # one worker: the same step as charging the whole exchange to the server
    whole = replace(split, ps_served_s=0.0)
    assert simulate_ps(_case(1, split, servers=1, clocks=clocks), "sync").step_s == \
        pytest.approx(simulate_ps(_case(1, whole, servers=1, clocks=clocks), "sync").step_s)


def test_a_task_pays_its_cold_extra_by_how_long_its_resource_sat_idle() -> None:
    sim = Simulation()
    work = sim.add("compute", "cpu", 2.0)
    first = sim.add("call0", "link", 0.1, (work,), cold_s=1.0, cold_after_s=4.0)  # idle 2 s
    queued = sim.add("call1", "link", 0.1, (work,), cold_s=1.0, cold_after_s=4.0)  # none
    later = sim.add("compute2", "cpu", 9.0, (queued,))
    last = sim.add("call2", "link", 0.1, (later,), cold_s=1.0, cold_after_s=4.0)  # 9 s idle
    always = sim.add("call3", "link", 0.1, (last,), cold_s=1.0)  # cold_after 0: in full
    sim.run()
    assert sim.end(first) - sim.start(first) == pytest.approx(0.1 + 0.5)
    assert sim.end(queued) - sim.start(queued) == pytest.approx(0.1)
    assert sim.end(last) - sim.start(last) == pytest.approx(0.1 + 1.0)
    assert sim.end(always) - sim.start(always) == pytest.approx(0.1 + 1.0)
    with pytest.raises(ValueError, match="cold_s"):
        sim.add("bad", "link", 0.1, cold_s=-1.0)


def test_a_step_pays_the_wake_up_measured_with_the_most_ranks_not_above_its_own() -> None:
    crowded = Overheads(collective_wakeup_s=1.0, wakeup_by_ranks={4: 3.0})
    assert [crowded.wakeup(p) for p in (2, 3, 4, 8)] == [1.0, 1.0, 3.0, 3.0]
    assert dict(crowded.named())["collective_wakeup_4ranks_s"] == 3.0
    assert _case(4, crowded, cores=2).wakeup == 3.0
    assert _case(2, crowded, cores=2).wakeup == 1.0
    assert _case(4, crowded).wakeup == 0.0  # a cluster with a device per rank: none
    for keys in ({1: 1.0}, {"4": 1.0, 2: 1.0}):
        with pytest.raises(ValueError, match="wakeup_by_ranks keys must be rank counts"):
            Overheads(wakeup_by_ranks=keys)  # type: ignore[dict-item]
        for name in ("scatter_wakeup_by_ranks", "unit_op_by_ranks", "stage_work_by_ranks",
                     "crossing_by_ranks"):
            with pytest.raises(ValueError, match=f"{name} keys must be rank counts"):
                Overheads(**{name: keys})  # type: ignore[arg-type]


def test_a_reduce_scatter_pays_its_own_probed_wake_up_where_it_was_probed() -> None:
    both = Overheads(collective_wakeup_s=1.0, wakeup_by_ranks={4: 3.0},
                     scatter_wakeup_by_ranks={2: 0.25, 8: 5.0})
    assert [both.wakeup(p, "reduce_scatter") for p in (2, 4, 8)] == [0.25, 0.25, 5.0]
    assert [both.wakeup(p, "all_gather") for p in (2, 4)] == [1.0, 3.0]  # the all-reduce's
    assert Overheads(collective_wakeup_s=1.0).wakeup(2, "reduce_scatter") == 1.0  # unprobed
    assert dict(both.named())["scatter_wakeup_8ranks_s"] == 5.0
    assert _case(2, both, cores=2).wakeup_of("reduce_scatter") == 0.25
    assert _case(2, both).wakeup_of("reduce_scatter") == 0.0  # a device per rank: none


def test_zero_reduce_scatters_wake_at_their_own_price_and_ddp_at_the_all_reduce_s() -> None:
    """One 2-layer model on 2 ranks sharing 2 cores: lowering only the (asynchronous)
    reduce-scatter's wake-up from 1 s to 0.25 s takes 0.75 s off ZeRO-2's step (one
    gradient reduce-scatter after a long backward), nothing off DDP's or ZeRO-1's (whose
    reduce-scatter is a synchronous call, priced by the synchronous all-reduce probe);
    ZeRO-3's per-layer reduce-scatters pay it too."""
    ar_only = Overheads(collective_wakeup_s=1.0, collective_wakeup_after_s=1.0)
    cheaper = replace(ar_only, scatter_wakeup_by_ranks={2: 0.25})

    def step(run: object, overheads: Overheads) -> float:
        case = Case(_profile(layers=2, overheads=overheads), _cluster(cores=2),
                    Workload(global_batch=2, algorithm="ring"), 2)
        return run(case).step_s  # type: ignore[operator]

    def zero(stage: int) -> Callable[[Case], object]:
        return lambda case: simulate_zero12(case, stage)

    assert step(zero(2), ar_only) - step(zero(2), cheaper) == pytest.approx(0.75)
    assert step(zero(1), ar_only) == pytest.approx(step(zero(1), cheaper))
    # ZeRO-1 follows the all-reduce's wake-up instead
    assert step(zero(1), replace(cheaper, collective_wakeup_s=2.0)) - step(
        zero(1), cheaper) == pytest.approx(1.0)
    assert step(simulate_ddp, ar_only) == pytest.approx(step(simulate_ddp, cheaper))
    assert step(simulate_zero3, cheaper) < step(simulate_zero3, ar_only)  # per layer


def test_zero3_gathers_queued_behind_each_other_wake_nothing() -> None:
    """The wake-up of a collective issued after compute is charged by the link's idle time:
    ZeRO-3's prefetched gathers follow each other on the link and pay (almost) none of it."""
    profile = _profile(layers=2, overheads=Overheads(collective_wakeup_s=1.0,
                                                     collective_wakeup_after_s=1.0))
    woken = simulate_zero3(Case(profile, _cluster(cores=2), Workload(global_batch=2), 2))
    every = simulate_zero3(Case(_profile(layers=2, overheads=Overheads(
        collective_wakeup_s=1.0)), _cluster(cores=2), Workload(global_batch=2), 2))
    bare = simulate_zero3(Case(_profile(layers=2, overheads=Overheads()), _cluster(cores=2),
                               Workload(global_batch=2), 2))
    assert bare.step_s < woken.step_s < every.step_s


def test_zero3_collectives_pay_their_probed_in_step_price_instead_of_call_and_wake_up(
) -> None:
    """Where ZeRO-3's pattern was probed, each of its collectives (per unit: two gathers
    and a reduce-scatter) pays the probe's price in place of the call overhead and the
    wake-up, on shared cores only; the probe with the most ranks not above the step's
    counts; DDP and ZeRO-1/2 are left alone."""
    base = Overheads(collective_call_s=0.5, collective_wakeup_s=2.0)
    probed = replace(base, unit_op_by_ranks={2: 0.25, 8: 9.0})
    assert [probed.unit_op(p) for p in (2, 4, 8)] == [0.25, 0.25, 9.0]
    assert base.unit_op(2) is None and probed.unit_op(1) is None
    assert dict(probed.named())["zero3_op_8ranks_s"] == 9.0
    assert Overheads.median([probed, replace(probed, unit_op_by_ranks={2: 0.75})]
                            ).unit_op_by_ranks == {2: 0.5, 8: 9.0}
    with pytest.raises(ValueError, match="unit_op_by_ranks keys must be rank counts"):
        Overheads(unit_op_by_ranks={1: 1.0})

    def step(run: Callable[[Case], object], overheads: Overheads, cores: int = 2) -> float:
        case = Case(_profile(layers=2, overheads=overheads), _cluster(cores=cores),
                    Workload(global_batch=2, algorithm="ring"), 2)
        return run(case).step_s  # type: ignore[attr-defined]

    # 2 units × 3 collectives, one after another on the link: each 0.25 instead of 0.5
    # (the call; nothing after compute wakes: collective_wakeup_after_s is 0, so in full)
    # plus 2.0 (the wake-up)
    assert step(simulate_zero3, probed) < step(simulate_zero3, base) - 6 * 2.0
    assert step(simulate_zero3, replace(probed, unit_op_by_ranks={2: 1.25})) == \
        pytest.approx(step(simulate_zero3, probed) + 6 * 1.0)
    assert step(simulate_zero3, probed, cores=0) == pytest.approx(
        step(simulate_zero3, base, cores=0))  # a device per rank: neither is charged
    for run in (simulate_ddp, lambda c: simulate_zero12(c, 1), lambda c: simulate_zero12(c, 2)):
        assert step(run, probed) == pytest.approx(step(run, base))


def test_zero3s_probed_price_is_what_its_collectives_add_beyond_the_calibrated_ring(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Per collective: what the probe's collectives added to its step, less their
    calibrated ring times (per unit two all-gathers and a reduce-scatter, (p − 1) α each
    here), never below 0; 0 when the probe failed or the model has no parameters."""
    import disttrain.simulate.cluster as cluster_module
    from disttrain.probe.contention import unit_ops_in_step
    from disttrain.probe.unit_ops import unit_bytes, unit_pattern_added, unit_price

    alpha = 1e-3
    costs = LinkCosts(alpha=alpha, beta=0.0, gamma=0.0, native_alpha=alpha, native_beta=0.0)
    monkeypatch.setattr(cluster_module, "local", lambda transport: _cluster(costs, 2))
    assert unit_price(30e-3, [64, 64], 2, "shm") == pytest.approx((30e-3 - 6 * alpha) / 6)
    assert unit_price(30e-3, [64, 64], 4, "shm") == pytest.approx((30e-3 - 18 * alpha) / 6)
    assert unit_price(1e-3, [64, 64], 2, "shm") == 0.0  # faster than calibrated: nothing
    assert unit_price(0.0, [64], 2, "shm") == 0.0  # the probe failed
    assert unit_price(1.0, [], 2, "shm") == 0.0 and unit_ops_in_step(lambda: None, []) == 0.0
    # with compute between them the simulation hides collectives behind it, so the same
    # reading needs more per collective than when nothing overlaps; the extraction gives
    # back what the probe's pattern, simulated as charged, adds
    overlapped = unit_price(30e-3, [64, 64], 2, "shm", work_s=2e-3)
    assert overlapped > (30e-3 - 6 * alpha) / 6
    assert unit_pattern_added(overlapped, 2e-3, [alpha] * 2, [alpha] * 2) == \
        pytest.approx(30e-3, rel=1e-6)
    # collectives that fit under the compute add nothing: a reading of less is 0
    assert unit_price(unit_pattern_added(0.0, 2e-3, [alpha] * 2, [alpha] * 2), [64, 64], 2,
                     "shm", work_s=2e-3) == pytest.approx(0.0, abs=1e-9)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    assert unit_bytes(net) == [(8 * 16 + 16) * 4, (16 * 4 + 4) * 4]  # the ReLU has none


def test_the_unit_probes_pattern_adds_only_what_the_compute_does_not_hide() -> None:
    """One unit, compute w = 2: forward, the gather (1) under the compute; backward, the
    gather again, then the reduce-scatter (0.5) after the wait, waited for at the pass's
    end: only it adds, and whatever each collective costs beyond its time adds to it once
    the gather no longer fits under the compute."""
    from disttrain.probe.unit_ops import unit_pattern_added

    assert unit_pattern_added(0.0, 2.0, [1.0], [0.5]) == pytest.approx(0.5)
    assert unit_pattern_added(0.25, 2.0, [1.0], [0.5]) == pytest.approx(0.75)
    # each gather 2.5 > 2 in both passes, then the reduce-scatter 2.0; less 4 of compute
    assert unit_pattern_added(1.5, 2.0, [1.0], [0.5]) == pytest.approx(2.5 + 2.5 + 2.0 - 4.0)
    # nothing to hide behind: every collective in turn
    assert unit_pattern_added(0.1, 0.0, [1.0, 1.0], [0.5, 0.5]) == pytest.approx(
        4 * 1.1 + 2 * 0.6)


def test_ranks_beyond_the_cores_share_them_only_when_they_compute_at_once() -> None:
    plain = simulate_ddp(_case(4, Overheads()))
    shared = simulate_ddp(_case(4, Overheads(), cores=2))  # 4 ranks on 2 cores
    assert shared.step_s == pytest.approx(2 * plain.step_s)
    assert any("share 2 cores" in n for n in shared.notes)
    slowed = simulate_ddp(_case(4, Overheads(concurrent_slowdown=1.25), cores=2))
    assert slowed.step_s == pytest.approx(2.5 * plain.step_s)
    cluster = simulate_ddp(_case(4, Overheads(concurrent_slowdown=1.25)))  # no shared cores
    assert cluster.step_s == pytest.approx(plain.step_s)
    # model parallelism: one stage computes at a time, nothing to share
    mp = simulate_pipeline(_case(4, Overheads(), cores=2, pp_size=4), "model-parallel")
    assert mp.step_s == pytest.approx(4 * 4 * (1.0 + 2.0))  # 4 stages, 4 samples each
    # GPipe: stages overlap in the steady state, so sharing stretches part of the step
    free = simulate_pipeline(_case(4, Overheads(), pp_size=4, microbatches=4), "gpipe")
    busy = simulate_pipeline(_case(4, Overheads(), cores=2, pp_size=4, microbatches=4),
                             "gpipe")
    assert free.step_s < busy.step_s < 2 * free.step_s


# ---------------------------------------------------------------------------- measuring
def test_measured_overheads_come_from_the_real_wrappers(
        caplog: pytest.LogCaptureFixture) -> None:
    from disttrain.probe.wrappers import measure_overheads

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    calls = []
    with caplog.at_level(logging.WARNING):
        overheads = measure_overheads(net, torch.randn(4, 8), loop=lambda: calls.append(1),
                                      cores=2)
    assert "could not measure" not in caplog.text  # the forked processes reported
    assert calls  # the loop's work was timed
    assert sorted(overheads.zero_s) == [1, 2, 3]
    values = dict(overheads.named())
    assert all(v >= 0 for v in values.values())
    assert values["collective_call_s"] > 0 and values["sgd_s_per_byte"] > 0
    assert values["ps_pull_s"] > 0 and values["ps_push_s"] > 0  # a worker and a server ran
    assert 0 < values["ps_served_s"] <= values["ps_pull_s"] + values["ps_push_s"]
    assert sorted(overheads.wakeup_by_ranks) == [4]  # 4 ranks on the 2 cores, as validated
    assert sorted(overheads.scatter_wakeup_by_ranks) == [2, 4]  # ZeRO's reduce-scatter too
    assert sorted(overheads.unit_op_by_ranks) == [2, 4]  # and ZeRO-3's pattern
    assert "could not measure ZeRO-3's collectives" not in caplog.text  # its ranks ran
    assert "could not measure a pipeline message" not in caplog.text  # the stages ran
    assert values["stage_message_s"] > 0  # at least the messages' Python
    assert "could not measure a pipeline stage's own work" not in caplog.text
    assert values["stage_work_s"] > 0  # the runtime's two stages ran
    # both schedules on 2 stages; none on 4: the model has 3 layers
    assert sorted(overheads.crossing_by_ranks) == [2] and overheads.stage_work_by_ranks == {}
    assert "could not measure the in-step" not in caplog.text  # two gloo ranks ran
    assert overheads.concurrent_slowdown >= 1  # two forked processes ran the model
    assert all(p.grad is None for p in net.parameters())  # the model is left as it was


class _Clock:
    """A clock that moves only when the code under test says it worked: timing rules are
    checked exactly, whatever the machine's load."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def work(self, seconds: float) -> None:
        self.now += seconds


def _fake_clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    import types

    import disttrain.probe.timing as timing
    import disttrain.probe.wrappers as wrappers

    clock = _Clock()
    fake_time = types.SimpleNamespace(perf_counter=clock.perf_counter)
    monkeypatch.setattr(timing, "time", fake_time)
    monkeypatch.setattr(wrappers, "time", fake_time)
    return clock


def test_the_loops_cost_is_a_whole_step_less_what_is_charged_apart(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that runs the model (its layers charged 1 ms by the profile's pass) and 3 ms
    of other work, and whose optimizer is charged 1 ms apart: the loop's own work reads
    2 ms. A step that is only the model reads 0, never below nothing."""
    import disttrain.probe.wrappers as wrappers
    from disttrain.probe.wrappers import loop_cost

    clock = _fake_clock(monkeypatch)
    monkeypatch.setattr(wrappers, "one_pass", lambda layers, x: [(0.0004, 0.0006)])
    net, x = nn.Sequential(nn.Linear(8, 4)), torch.randn(4, 8)

    def step() -> None:
        clock.work(0.001)  # the model
        clock.work(0.003)  # the rest of the loop and the optimizer

    assert loop_cost(net, x, step, sgd_step=0.001) == pytest.approx(0.002)
    assert loop_cost(net, x, lambda: clock.work(0.001), sgd_step=0.001) == 0


def test_the_loops_cost_takes_off_the_layers_sum_the_simulation_charges(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What the layers' times leave out of a pass (the loss, the start of backward) is the
    loop's to pay: here the profile's pass charges 3 ms for its layers whatever its wall
    time, and a step takes 5 ms, so the loop's own work reads 2 ms (a plain
    forward+backward's wall time taken off instead would read about 0 here)."""
    import disttrain.probe.wrappers as wrappers
    from disttrain.probe.wrappers import loop_cost

    clock = _fake_clock(monkeypatch)
    net = nn.Sequential(nn.Linear(8, 4))
    monkeypatch.setattr(wrappers, "one_pass", lambda layers, x: [(0.001, 0.002)])
    took = loop_cost(net, torch.randn(4, 8), lambda: clock.work(0.005), sgd_step=0.0,
                     repeats=5, rounds=2)
    assert took == pytest.approx(0.002)


def test_the_least_disturbed_ps_probe_counts_and_a_failed_one_is_no_reading(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Three parameter-server probes read (2, 3, 2.5), (1, 4, 1) and failed (0, 0, 0): the
    profile keeps the least pull and push, 1 and 3, and the median served share, 1.75 (a
    difference of two runs; the other probes faked)."""
    import disttrain.probe.contention as contention
    import disttrain.probe.ps_probe as ps_probe
    import disttrain.probe.stage_probe as stage_probe
    from disttrain.probe.wrappers import measure_overheads

    readings = iter([(2e-3, 3e-3, 2.5e-3), (1e-3, 4e-3, 1e-3), (0.0, 0.0, 0.0)])
    monkeypatch.setattr(ps_probe, "ps_exchange", lambda *a, **k: next(readings))
    monkeypatch.setattr(contention, "collective_in_step", lambda *a, **k: 0.0)
    monkeypatch.setattr(contention, "concurrent_slowdown", lambda *a, **k: 1.0)
    monkeypatch.setattr(stage_probe, "stage_message", lambda *a, **k: (0.0, 0.0))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    overheads = measure_overheads(net, torch.randn(4, 8), cores=2)
    assert (overheads.ps_pull_s, overheads.ps_push_s) == (1e-3, 3e-3)
    assert overheads.ps_served_s == pytest.approx(1.75e-3)


@pytest.mark.parametrize("bind_cores", [True, False])
def test_probes_are_bound_as_the_runs_they_predict_and_the_parameter_servers_never(
        monkeypatch: pytest.MonkeyPatch, bind_cores: bool) -> None:
    """For bound runs (``bind_cores``) every probe of 2 and of 4 ranks binds them as the
    runs are bound; the parameter server's (3 processes, as its runs, which no plan binds)
    is never asked to. For unbound runs nothing is bound."""
    import disttrain.probe.contention as contention
    import disttrain.probe.ps_probe as ps_probe
    import disttrain.probe.stage_probe as stage_probe
    from disttrain.probe.wrappers import measure_overheads

    seen: dict[tuple[str, int], bool] = {}

    def probe(name: str, value: object) -> Callable[..., object]:
        def run(*args: object, ranks: int = 2, bind: bool = False, **kwargs: object) -> object:
            seen[(name, ranks)] = bind
            return value
        return run

    def ps_exchange(*args: object, **kwargs: object) -> tuple[float, float, float]:
        seen[("ps", 2)] = "bind" in kwargs
        return 0.0, 0.0, 0.0

    def stage_work(module: object, x: object, transport: str, ranks: int,
                   bind: bool = False) -> dict[str, float]:
        seen[("stage_work", ranks)] = bind
        return {}

    monkeypatch.setattr(contention, "collective_in_step", probe("collective", 0.0))
    monkeypatch.setattr(contention, "unit_ops_in_step", probe("units", 0.0))
    monkeypatch.setattr(contention, "concurrent_slowdown", lambda *a, **k: 1.0)
    monkeypatch.setattr(ps_probe, "ps_exchange", ps_exchange)
    monkeypatch.setattr(stage_probe, "stage_message", probe("message", (0.0, 0.0)))
    monkeypatch.setattr(stage_probe, "stage_work", stage_work)
    net = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
    measure_overheads(net, torch.randn(4, 8), cores=2, bind_cores=bind_cores)
    assert seen == {**{(name, ranks): bind_cores for name in ("collective", "units", "stage_work")
                       for ranks in (2, 4)}, ("message", 2): bind_cores, ("ps", 2): False}


def test_bound_probe_ranks_each_run_on_the_core_a_bound_run_gives_them() -> None:
    from disttrain.bench.ranks import bind_plan
    from disttrain.probe.contention import forked_ranks

    usable, plan = sorted(os.sched_getaffinity(0)), bind_plan(2)
    bound = sorted(forked_ranks(_report_cores, 2, bind=True))
    assert bound == ([(r, [core]) for r, core in enumerate(plan)] if plan  # one core each
                     else [(0, usable), (1, usable)])  # (a 1-core machine: no plan)
    assert sorted(forked_ranks(_report_cores, 2)) == [(0, usable), (1, usable)]


def test_a_probe_rank_that_cannot_be_bound_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    import disttrain.bench.ranks as ranks_module
    from disttrain.probe.contention import forked_ranks

    missing = max(os.sched_getaffinity(0)) + 4096  # no such core
    monkeypatch.setattr(ranks_module, "bind_plan", lambda n: [missing] * n)
    with pytest.raises(RuntimeError, match=f"could not be bound to core {missing}"):
        forked_ranks(_report_cores, 2, bind=True)


def _report_cores(rank: int, ranks: int, store: str, report: Callable[[Any], None]) -> None:
    report((rank, sorted(os.sched_getaffinity(0))))


def test_probes_are_read_round_robin_so_a_slow_spell_hits_one_reading_of_each() -> None:
    from disttrain.probe.wrappers import _rounds

    order: list[str] = []
    readings = _rounds({name: (lambda name=name: order.append(name) or len(order))
                        for name in ("a", "b")})
    assert order == ["a", "b"] * 3
    assert readings == {"a": [1, 3, 5], "b": [2, 4, 6]}


def test_the_wake_up_is_the_in_step_all_reduce_beyond_what_the_simulation_charges(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe's all-reduce after compute, minus the call overhead and the calibrated
    ring the simulation already charges for it (2 (p − 1) α here), never below 0."""
    import disttrain.simulate.cluster as cluster_module
    from disttrain.probe.wrappers import _wakeup

    alpha = 1e-3
    costs = LinkCosts(alpha=alpha, beta=0.0, gamma=0.0, native_alpha=alpha, native_beta=0.0)
    transports = []
    monkeypatch.setattr(cluster_module, "local",
                        lambda transport: transports.append(transport) or _cluster(costs, 2))
    assert _wakeup(10e-3, 0.5e-3, 4096, 2, "shm") == pytest.approx(10e-3 - 0.5e-3 - 2 * alpha)
    assert _wakeup(10e-3, 0.5e-3, 4096, 4, "shm") == pytest.approx(10e-3 - 0.5e-3 - 6 * alpha)
    assert transports == ["shm", "shm"]  # the calibration of the transport probed
    # a ring reduce-scatter is charged (p − 1) α
    assert _wakeup(10e-3, 0.5e-3, 4096, 4, "shm", "reduce_scatter") == pytest.approx(
        10e-3 - 0.5e-3 - 3 * alpha)
    assert _wakeup(1e-3, 0.5e-3, 4096, 2, "shm") == 0.0  # faster than charged: nothing
    assert _wakeup(0.0, 0.5e-3, 4096, 2, "shm") == 0.0  # the probe failed


def test_the_in_step_probe_names_the_collectives_it_can_time() -> None:
    from disttrain.probe.contention import collective_in_step

    with pytest.raises(ValueError, match="op must be 'all_reduce' or 'reduce_scatter'"):
        collective_in_step(lambda: None, 4096, op="all_gather")


def test_a_failed_pipeline_message_probe_is_reported_and_charges_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    from disttrain.probe.stage_probe import stage_message

    with caplog.at_level(logging.WARNING):
        assert stage_message(lambda: None, transport="no-such-transport") == (0.0, 0.0)
    assert "could not measure a pipeline message" in caplog.text
    assert "no-such-transport" in caplog.text  # the rank's own error, passed on


def test_the_pipeline_probe_takes_off_the_work_its_stages_ran_not_the_parents(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The stages' work runs at the children's speed: here 8 ms a call in the forked
    stages and 0.5 ms in the parent. The probe must read each message from the rounds
    timed in the stages, less the two runs of the work each stage timed itself right
    after (never a time measured in the parent): checked on the very rounds it measured,
    whatever this machine's speed."""
    import statistics

    import disttrain.probe.stage_probe as stage_probe

    monkeypatch.setattr(stage_probe, "ROUNDS", 6)
    monkeypatch.setattr(stage_probe, "WARM_UP", 1)
    parent = os.getpid()
    measured: list[list[Any]] = []
    forked = stage_probe.forked_ranks

    def keep(*args: Any, **kwargs: Any) -> list[Any]:
        per_rank = forked(*args, **kwargs)
        measured.append(per_rank)
        return per_rank

    monkeypatch.setattr(stage_probe, "forked_ranks", keep)

    def work() -> None:
        time.sleep(0.0005 if os.getpid() == parent else 0.008)

    work()
    busy, wakeup = stage_probe.stage_message(work)
    (per_rank,) = measured
    rounds = {rank: rest for rank, *rest in per_rank}
    (cold, hot, solo), other = rounds[0], rounds[1][2]
    assert len(cold) == len(hot) == len(solo) == len(other) == 6  # after the warm-up
    assert busy == max(0.0, statistics.median(hot) / 2)  # a hot round: two messages
    messages = [(c - a - b) / 2 for c, a, b in zip(cold, solo, other, strict=True)]
    assert wakeup == max(0.0, statistics.median(messages) - busy)


def test_collectives_on_shared_cores_slow_the_compute_they_overlap() -> None:
    """On this machine a collective is the ranks' own CPU work: with 2 ranks on 2 cores a
    gather that overlaps a computation halves the speed of both while they overlap; with 4
    ranks the collective keeps the 2 cores busy (its calibrated time already includes the
    sharing), not 4. On a cluster (a device per rank) the overlap is free."""
    # a computation of 1 s (at full speed: alone, 2 ranks on 2 cores take 1 s, 4 take 2 s)
    # beside a gather of 2 s: with 2 ranks both run at half speed until the computation
    # ends at 2 s, the gather ends 1 s later; with 4 ranks (load 4 + 2 on 2 cores) both
    # run at a third until 3 s
    for workers, cores, compute_end, link_end in ((2, 2, 2.0, 3.0), (4, 2, 3.0, 4.0),
                                                  (2, 0, 1.0, 2.0)):
        case = _case(workers, Overheads(), cores=cores)
        sim = case.simulation()
        case.compute(sim, "compute", workers)
        case.link(sim)
        work = sim.add("F", "compute", 1.0)
        gather = sim.add("ag", "link", 2.0)
        sim.run()
        assert (sim.end(work), sim.end(gather)) == pytest.approx((compute_end, link_end)), \
            (workers, cores)
    # ZeRO-3 prefetches each unit's gather behind the previous unit's compute: on shared
    # cores that overlap is not free
    costs = LinkCosts(alpha=0.25, beta=0.0, gamma=0.0, native_alpha=0.25, native_beta=0.0)
    shared = simulate_zero3(_case(2, Overheads(), cores=2, costs=costs))
    cluster = simulate_zero3(_case(2, Overheads(), costs=costs))
    assert shared.step_s > cluster.step_s


def test_each_pipeline_backward_pays_one_autograd_call() -> None:
    from dataclasses import replace

    # model parallel on 4 ranks: one micro-batch goes down and back up the 4 stages one
    # after the other, so each stage's backward call lies on the critical path once
    without = simulate_pipeline(_case(4, PAYS), "model-parallel")
    paying = simulate_pipeline(_case(4, replace(PAYS, backward_call_s=0.375)), "model-parallel")
    assert paying.step_s - without.step_s == pytest.approx(4 * 0.375)
    # GPipe with m micro-batches on p equal stages: the backward half of the step is
    # m + p − 1 backward slots on the critical path, each one call longer
    for m in (1, 2, 4):
        g0 = simulate_pipeline(_case(4, PAYS, microbatches=m, pp_size=4), "gpipe")
        g1 = simulate_pipeline(_case(4, replace(PAYS, backward_call_s=0.375), microbatches=m,
                                     pp_size=4), "gpipe")
        assert g1.step_s - g0.step_s == pytest.approx((m + 4 - 1) * 0.375)


def test_pipeline_stages_are_cut_as_the_workload_says() -> None:
    # layer 0 holds nearly every parameter; every layer takes the same time
    layers = tuple(LayerProfile(f"l{i}", 0.0, 1.0, 0.0, 2.0, 1000 if i == 0 else 1, 0.0, 0.0)
                   for i in range(4))
    profile = ModelProfile("toy", layers, reference_flops=1.0, optimizer_s_per_param=0.0)
    runs = {}
    for partition in ("params", "time"):
        wl = Workload(global_batch=8, microbatches=4, algorithm="ring", partition=partition)
        runs[partition] = simulate_pipeline(Case(profile, _cluster(), wl, 2), "gpipe")
    # as disttrain's pipelines split by default (choose_balance(..., "params")): (1, 3)
    assert runs["params"].details["balance"] == [1, 3]
    assert runs["time"].details["balance"] == [2, 2]
    assert runs["params"].step_s > runs["time"].step_s  # 3 layers on one stage: slower
    with pytest.raises(ValueError, match="partition must be one of params, time"):
        Workload(partition="layers")


def test_pipeline_messages_cost_two_busy_ranks_and_share_the_cores() -> None:
    from disttrain.comm.cost_model import with_world_sizes

    # α calibrated on 2 ranks: 0.25 s a message; on 4 ranks of 2 cores: 4 s (contention)
    two, four = (LinkCosts(alpha=a, beta=0.0, gamma=0.0, native_alpha=a, native_beta=0.0)
                 for a in (0.25, 4.0))
    costs = with_world_sizes(two, {2: two, 4: four})
    # model parallelism on 4 ranks: 3 activations down, 3 gradients up, one at a time, so
    # each message pays the 2-rank α and nothing stretches it
    base = simulate_pipeline(_case(4, Overheads(), cores=2, pp_size=4), "model-parallel")
    mp = simulate_pipeline(_case(4, Overheads(), cores=2, costs=costs, pp_size=4),
                           "model-parallel")
    assert mp.step_s - base.step_s == pytest.approx(6 * 0.25)
    # on a cluster (a device per rank) the constants of its own world size apply
    gpu = simulate_pipeline(_case(4, Overheads(), costs=costs, pp_size=4), "model-parallel")
    assert gpu.step_s - simulate_pipeline(_case(4, Overheads(), pp_size=4),
                                          "model-parallel").step_s == pytest.approx(6 * 4.0)


def test_pipeline_messages_cost_their_probe_and_wake_an_idle_receiver_on_one_host() -> None:
    """On this machine a message between stages costs the probed message; with micro-batches
    in flight at least the transport's α. The computation that follows it pays
    the probed wake-up in proportion to how long its stage sat idle (in full after
    ``collective_wakeup_after_s``)."""
    alpha = 0.25
    costs = LinkCosts(alpha=alpha, beta=0.0, gamma=0.0, native_alpha=alpha, native_beta=0.0)
    probed = Overheads(stage_message_s=1.0, stage_wakeup_s=0.5, collective_wakeup_after_s=1.0)
    assert dict(probed.named())["stage_wakeup_s"] == 0.5

    def extra(workers: int, overheads: Overheads, cores: int = 2, name: str = "model-parallel",
              m: int = 1) -> float:
        run = simulate_pipeline(_case(workers, overheads, cores=cores, costs=costs,
                                      pp_size=workers, microbatches=m), name)
        free = simulate_pipeline(_case(workers, Overheads(), cores=cores, pp_size=workers,
                                       microbatches=m), name)
        return run.step_s - free.step_s

    # model parallelism: 2 (p − 1) messages one after another, each to a stage that idled
    # at least 1 s (a stage's forward of one sample), so each wakes it in full
    assert extra(2, probed) == pytest.approx(2 * (1.0 + 0.5))
    assert extra(4, probed) == pytest.approx(6 * (1.0 + 0.5))
    # one message at a time, as in the probe: a probe below α is still the price ...
    assert extra(4, Overheads(stage_message_s=0.1)) == pytest.approx(6 * 0.1)
    # ... but with micro-batches in flight the stages compute while messages move and a
    # message costs at least the calibrated α: GPipe, m = 2, on 2 stages sends 4, two of
    # them on the critical path (the last activation, the last gradient)
    below = Overheads(stage_message_s=0.1)
    assert extra(2, below, name="gpipe", m=2) == pytest.approx(2 * alpha)
    # on a cluster (a device per rank) the probes of this host say nothing
    assert extra(4, probed, cores=0) == pytest.approx(6 * alpha)
    # GPipe, m = 2: a message that reaches a stage busy with the other micro-batch wakes
    # nothing, so of its 4 messages only the first activation (stage 1 idled since the
    # step began) and the first gradient (stage 0 idled after its forwards) pay
    woken = extra(2, probed, name="gpipe", m=2) - extra(2, replace(probed, stage_wakeup_s=0.0),
                                                          name="gpipe", m=2)
    assert woken == pytest.approx(2 * 0.5)
