"""The cost model: closed forms, choices, native fit, per-world-size costs and storage."""

from __future__ import annotations

import json
import logging
import math

import pytest

from disttrain.comm.cost_model import (
    LinkCosts,
    calibration_path,
    choose,
    load_costs,
    native_fit,
    predict,
    save_costs,
    theory_bytes_sent,
    with_world_sizes,
)

# distinct values, so a formula that uses the wrong constant shows
A, B, G, NA, NB = 1e-4, 1e-9, 3e-10, 7e-5, 2e-9
COSTS = LinkCosts(alpha=A, beta=B, gamma=G, native_alpha=NA, native_beta=NB,
                  chunk_bytes=1 << 40)  # one chunk: no streaming overlap
MiB = 1 << 20


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("n", [4, MiB, 64 * MiB])
def test_thakur_closed_forms_for_powers_of_two(p, n):
    lg, frac = math.log2(p), (p - 1) / p
    expected = {
        # Thakur, Rabenseifner & Gropp 2005, section 4 (ring all-reduce as in Patarasuk & Yuan)
        ("all_reduce", "ring"): 2 * (p - 1) * A + 2 * frac * n * B + frac * n * G,
        ("all_reduce", "halving_doubling"): 2 * lg * A + 2 * frac * n * B + frac * n * G,
        ("all_reduce", "tree"): 2 * lg * (A + n * B) + lg * n * G,
        ("all_reduce", "naive"): (p - 1) * (A + n * B + n * G),
        ("broadcast", "tree"): lg * (A + n * B),
        ("reduce", "tree"): lg * (A + n * B + n * G),
        ("all_gather", "ring"): (p - 1) * A + frac * n * B,
        ("all_gather", "halving_doubling"): lg * A + frac * n * B,
        ("reduce_scatter", "halving_doubling"): lg * A + frac * n * (B + G),
        ("reduce_scatter", "naive"): (p - 1) * A + frac * n * (B + G),
        ("gather", "naive"): (p - 1) * A + frac * n * B,
        ("scatter", "tree"): lg * A + frac * n * B,
        ("all_to_all", "naive"): (p - 1) * A + frac * n * B,
        ("all_reduce", "native"): 2 * lg * NA + 2 * frac * n * NB + frac * n * G,
    }
    for (op, algorithm), value in expected.items():
        assert predict(op, algorithm, p, n, COSTS) == pytest.approx(value, rel=1e-12), \
            (op, algorithm)


def test_ring_streaming_hides_all_but_one_sub_chunk_of_reduction():
    p, n, chunk = 4, 64 * MiB, MiB
    costs = LinkCosts(alpha=A, beta=B, gamma=G, chunk_bytes=chunk)
    expected = 2 * (p - 1) * A + 2 * (p - 1) / p * n * B + (p - 1) * chunk * G
    assert predict("all_reduce", "ring", p, n, costs) == pytest.approx(expected)


def test_non_power_of_two_pays_the_fold():
    p, n = 3, MiB  # q = 2: one halving and one doubling step, plus fold and unfold
    expected = 2 * A + 2 * 0.5 * n * B + 0.5 * n * G + 2 * (A + n * B) + n * G
    assert predict("all_reduce", "halving_doubling", p, n, COSTS) == pytest.approx(expected)
    assert predict("all_reduce", "tree", 3, n, COSTS) == pytest.approx(
        2 * 2 * (A + n * B) + 2 * n * G)  # ⌈log₂ 3⌉ = 2 rounds


def test_exchange_costs_apply_to_exchange_steps_only():
    ax, bx = 5e-3, 4e-9
    costs = LinkCosts(alpha=A, beta=B, gamma=G, alpha_exchange=ax, beta_exchange=bx,
                      chunk_bytes=1 << 40)
    p, n = 4, MiB
    assert predict("all_reduce", "ring", p, n, costs) == pytest.approx(
        2 * 3 * ax + 1.5 * n * bx + 0.75 * n * G)
    assert predict("all_reduce", "tree", p, n, costs) == predict("all_reduce", "tree", p, n,
                                                                   COSTS)
    assert predict("broadcast", "naive", p, n, costs) == pytest.approx(3 * (A + n * B))


def test_one_rank_costs_nothing_and_unknown_pairs_raise():
    assert predict("all_reduce", "ring", 1, MiB, COSTS) == 0.0
    with pytest.raises(KeyError):
        predict("all_reduce", "bruck", 4, MiB, COSTS)
    with pytest.raises(KeyError):
        predict("all_to_all", "ring", 4, MiB, COSTS)


def test_choose_latency_optimal_when_tiny_bandwidth_optimal_when_large():
    costs = LinkCosts()  # typical: α ≈ 100 µs, β ≈ 1 GB/s
    candidates = ["naive", "ring", "tree", "halving_doubling"]
    assert choose("all_reduce", 8, 4, costs, candidates) in ("tree", "halving_doubling")
    assert choose("all_reduce", 8, 256 * MiB, costs, candidates) in ("ring", "halving_doubling")
    assert choose("broadcast", 8, 4, costs, ["naive", "tree"]) == "tree"
    # unknown candidates are skipped, not chosen
    assert choose("all_reduce", 8, 4, costs, ["shm", "ring"]) == "ring"


def test_choose_follows_the_costs():
    slow_native = LinkCosts(native_alpha=1.0)
    fast_native = LinkCosts(native_alpha=1e-7, native_beta=1e-12)
    names = ["ring", "tree", "native"]
    assert choose("all_reduce", 4, MiB, slow_native, names) != "native"
    assert choose("all_reduce", 4, MiB, fast_native, names) == "native"


@pytest.mark.parametrize("p", [2, 3, 4, 6])
def test_native_fit_reproduces_both_measurements(p):
    small, large = (4096, 3e-4), (16 * MiB, 2e-2)
    alpha, beta = native_fit(p, small, large, G)
    costs = LinkCosts(native_alpha=alpha, native_beta=beta, gamma=G)
    for n, t in (small, large):
        assert predict("all_reduce", "native", p, n, costs) == pytest.approx(t, rel=1e-9)
    with pytest.raises(ValueError, match="two different sizes"):
        native_fit(p, small, (4096, 1e-3), G)


def test_per_world_size_costs_are_used_and_the_nearest_is_taken():
    two, four = LinkCosts(alpha=1e-5), LinkCosts(alpha=1e-3)
    costs = with_world_sizes(two, {2: two, 4: four})
    assert costs.at(2) is costs.by_world_size[0][1] and costs.at(4).alpha == 1e-3
    assert costs.at(3).alpha == 1e-5  # tie between 2 and 4: the smaller
    assert costs.at(16).alpha == 1e-3
    assert predict("barrier", "tree", 4, 0, costs) == pytest.approx(2 * 2 * 1e-3)
    assert predict("barrier", "tree", 2, 0, costs) == pytest.approx(2 * 1e-5)


def test_save_load_round_trip_keeps_other_transports(tmp_path):
    path = tmp_path / "sub" / "calibration.json"
    costs = with_world_sizes(COSTS, {2: COSTS, 4: LinkCosts(alpha=2e-3, alpha_exchange=4e-3)})
    save_costs("other", LinkCosts(alpha=9e-6), path)
    assert save_costs("torch", costs, path) == path
    assert load_costs("torch", path) == costs
    assert load_costs("other", path).alpha == 9e-6
    assert load_costs("shm", path) == LinkCosts()  # nothing stored: defaults


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"torch": {"alpha": -1}}',
                                  '{"torch": {"alpha": "fast"}}', '{"torch": 3}',
                                  '{"torch": {"by_world_size": {"x": {}}}}'])
def test_corrupted_calibration_falls_back_to_defaults(tmp_path, caplog, text):
    path = tmp_path / "calibration.json"
    path.write_text(text)
    with caplog.at_level(logging.WARNING):
        assert load_costs("torch", path) == LinkCosts()
    assert "ignoring calibration" in caplog.text
    save_costs("torch", COSTS, path)  # and a corrupted file can be overwritten
    assert json.loads(path.read_text())["torch"]["alpha"] == A


def test_calibration_path_honours_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DISTTRAIN_CALIBRATION", str(tmp_path / "c.json"))
    assert calibration_path() == tmp_path / "c.json"
    monkeypatch.delenv("DISTTRAIN_CALIBRATION")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert calibration_path() == tmp_path / "disttrain" / "calibration.json"


@pytest.mark.parametrize("field, value", [
    ("alpha", -1e-6), ("beta", math.nan), ("gamma", math.inf), ("native_alpha", True),
    ("alpha_exchange", -1.0), ("chunk_bytes", 0), ("chunk_bytes", 1.5),
])
def test_link_costs_reject_bad_values(field, value):
    with pytest.raises(ValueError, match=f"LinkCosts.{field}"):
        LinkCosts(**{field: value})


def test_link_costs_reject_nested_world_sizes():
    inner = with_world_sizes(LinkCosts(), {2: LinkCosts()})
    with pytest.raises(ValueError, match="by_world_size"):
        LinkCosts(by_world_size=((4, inner),))


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_theory_bytes_closed_forms(p):
    v = 1200.0 * 7 * 8
    assert theory_bytes_sent("all_reduce", "ring", p, int(v)) == pytest.approx(2 * (p - 1) / p * v)
    assert theory_bytes_sent("all_reduce", "naive", p, int(v)) == (p - 1) * v
    assert theory_bytes_sent("all_gather", "ring", p, int(v)) == pytest.approx((p - 1) / p * v)
    assert theory_bytes_sent("all_reduce", "native", p, int(v)) is None
    with pytest.raises(KeyError):
        theory_bytes_sent("all_reduce", "bruck", p, int(v))


def test_a_transport_missing_from_the_file_is_not_a_warning(tmp_path, caplog):
    """Calibrating one transport is normal; only a broken file deserves a warning."""
    path = tmp_path / "calibration.json"
    save_costs("torch", COSTS, path)
    with caplog.at_level(logging.WARNING):
        assert load_costs("shm", path) == LinkCosts()
    assert caplog.text == ""
