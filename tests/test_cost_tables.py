"""Measured cost tables: interpolation, validation, storage, and how ``auto`` uses them."""

from __future__ import annotations

import pytest

from disttrain.bench.calibrate import fit_tables
from disttrain.comm.cost_model import (
    LinkCosts,
    choose,
    costs_from_bytes,
    costs_to_bytes,
    formula_time,
    load_costs,
    predict,
    save_costs,
    with_world_sizes,
)
from disttrain.comm.cost_tables import interpolate

KiB, MiB = 1 << 10, 1 << 20
TABLE = ((4 * KiB, 1e-3), (1 * MiB, 2e-3), (16 * MiB, 20e-3))


def test_interpolation_passes_through_every_point_and_is_linear_between():
    for n, t in TABLE:
        assert interpolate(TABLE, n) == pytest.approx(t)
    middle = (4 * KiB + MiB) // 2
    assert interpolate(TABLE, middle) == pytest.approx(1.5e-3)
    assert interpolate(TABLE, 8.5 * MiB) == pytest.approx(11e-3)


def test_extrapolation_extends_the_nearest_segment_and_never_falls_with_size():
    # beyond the last point: the last segment's slope (18 ms per 15 MiB)
    assert interpolate(TABLE, 31 * MiB) == pytest.approx(38e-3)
    # below the first point, along the first segment, but never below zero
    assert 0 <= interpolate(TABLE, 0) < 1e-3
    falling = ((4 * KiB, 3e-3), (64 * KiB, 1e-3))  # noise: the larger size measured faster
    assert interpolate(falling, 1 * MiB) == pytest.approx(1e-3)  # flat, not negative
    # fewer bytes never cost more: the 4 KiB point caught a slow spell, 64 KiB bounds it
    assert interpolate(falling, 0) == pytest.approx(1e-3)
    assert interpolate(falling, 4 * KiB) == pytest.approx(1e-3)
    dip = ((4 * KiB, 1e-3), (64 * KiB, 4e-3), (1 * MiB, 2e-3), (16 * MiB, 20e-3))
    assert interpolate(dip, 64 * KiB) == pytest.approx(2e-3)  # bounded by 1 MiB's
    assert interpolate(dip, 16 * KiB) == pytest.approx(1e-3 + 12 / 60 * 1e-3)
    assert interpolate(dip, 8.5 * MiB) == pytest.approx(11e-3)  # rising tables: unchanged


@pytest.mark.parametrize("measured, match", [
    ((("all_reduce/ring", ((4, 1.0),)),), "at least 2"),
    ((("all_reduce/ring", ((8, 1.0), (4, 2.0))),), "increasing"),
    ((("all_reduce/ring", ((4, 1.0), (8, float("nan")))),), "finite"),
    ((("ring", ((4, 1.0), (8, 2.0))),), "op/algorithm"),
])
def test_bad_tables_are_refused_with_the_entry_named(measured, match):
    with pytest.raises(ValueError, match=match):
        LinkCosts(measured=measured)


def _costs(p: int = 2) -> LinkCosts:
    entry = LinkCosts(measured=(
        ("all_reduce/ring", ((4 * KiB, 5e-3), (16 * MiB, 10e-3))),
        ("all_reduce/tree", ((4 * KiB, 1e-3), (16 * MiB, 30e-3))),
    ))
    return with_world_sizes(LinkCosts(), {p: entry})


def test_predict_reads_the_table_at_its_own_world_size_only():
    costs = _costs(p=2)
    assert predict("all_reduce", "ring", 2, 16 * MiB, costs) == pytest.approx(10e-3)
    # world size 4 was not timed: the closed form, even though 2 is the nearest entry
    assert predict("all_reduce", "ring", 4, 16 * MiB, costs) == formula_time(
        "all_reduce", "ring", 4, 16 * MiB, costs)
    # an algorithm without a table at 2 falls back to its closed form too
    assert predict("all_reduce", "naive", 2, MiB, costs) == formula_time(
        "all_reduce", "naive", 2, MiB, costs)


def test_auto_chooses_by_measured_times_and_ignores_untimed_candidates():
    costs = _costs(p=2)
    everything = ["naive", "ring", "tree", "halving_doubling", "native"]
    assert choose("all_reduce", 2, 4 * KiB, costs, everything) == "tree"
    assert choose("all_reduce", 2, 16 * MiB, costs, everything) == "ring"
    # the crossover sits where the two measured lines meet
    # tree − ring = −4 ms at 4 KiB and grows by (29 − 5) ms over the measured range
    n_cross = 4 * KiB + 4e-3 / (24e-3 / (16 * MiB - 4 * KiB))
    assert choose("all_reduce", 2, int(n_cross * 0.98), costs, everything) == "tree"
    assert choose("all_reduce", 2, int(n_cross * 1.02), costs, everything) == "ring"


def test_tables_survive_the_json_round_trip_and_the_calibration_file(tmp_path):
    costs = _costs(p=4)
    assert costs_from_bytes(costs_to_bytes(costs)) == costs
    path = tmp_path / "calibration.json"
    save_costs("torch", costs, path)
    assert load_costs("torch", path) == costs


def _report(times: list[float], nbytes: int, correct: bool = True) -> dict:
    return {"times": times, "nbytes": nbytes, "correct": correct, "bytes_sent": 0,
            "chosen": "x", "transport": "torch"}


def test_fit_tables_takes_the_median_of_the_slowest_rank_per_iteration():
    plan = [("all_reduce", "ring", 4 * KiB), ("all_reduce", "ring", MiB),
            ("all_reduce", "shm", 4 * KiB), ("all_reduce", "shm", MiB),
            ("broadcast", "tree", 4 * KiB)]
    results = [
        [_report([1.0, 3.0, 2.0], 4 * KiB), _report([2.0, 1.0, 5.0], 4 * KiB)],  # max: 2,3,5
        [_report([4.0, 4.0, 9.0], MiB), _report([6.0, 1.0, 1.0], MiB)],  # max: 6,4,9
        [{"skipped": "cannot run"}, {"skipped": "cannot run"}],
        [{"skipped": "cannot run"}, {"skipped": "cannot run"}],
        [_report([1.0], 4 * KiB), _report([1.0], 4 * KiB)],  # one size only: no table
    ]
    assert fit_tables(plan, results) == (("all_reduce/ring", ((4 * KiB, 3.0), (MiB, 6.0))),)
    results[0][1] = _report([1.0, 1.0, 1.0], 4 * KiB, correct=False)
    assert fit_tables(plan, results) == ()  # a wrong result: no table, auto skips it
