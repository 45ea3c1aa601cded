"""``disttrain simulate --validate``'s verdict per row (disttrain/probe/validate.py): a row
outside the 20 % band is either explained by its own runs (they disagree among themselves,
or its processes outnumber the cores) or counted as the model's error, which fails the
command."""

from __future__ import annotations

from typing import Any

import pytest

from disttrain.probe.validate import FAILED, NOT_PREDICTED, OUTSIDE, WITHIN, report, verdict


def row(pred_ms: float, runs_ms: list[float], world_size: int = 2,
        processes: int | None = None, error: str | None = None) -> dict[str, Any]:
    runs = sorted(t / 1e3 for t in runs_ms)
    measured = runs[(len(runs) - 1) // 2] if runs and error is None else None
    return {"strategy": "gpipe", "world_size": world_size,
            "processes": processes or world_size, "predicted_step_s": pred_ms / 1e3,
            "measured_step_s": measured, "measured_step_s_runs": runs,
            "ratio": pred_ms / 1e3 / measured if measured else None, "error": error}


def test_a_prediction_within_the_band_is_within_whatever_the_runs_do():
    assert verdict(row(10.0, [8.4, 11.0, 30.0]), cores=2) == (WITHIN, "")
    assert verdict(row(10.0, [11.9, 12.0, 12.1], world_size=4), cores=2) == (WITHIN, "")


def test_runs_that_disagree_explain_a_row_only_when_the_prediction_meets_one_of_them():
    kind, reason = verdict(row(5.0, [5.5, 7.0, 9.0]), cores=2)
    assert kind == NOT_PREDICTED and "runs spread 5.50-9.00 ms (+64%)" in reason, reason
    # as wide a spread, but no run near the prediction: that is the model's error
    kind, reason = verdict(row(3.0, [5.5, 7.0, 9.0]), cores=2)
    assert kind == OUTSIDE and "the model is wrong here" in reason, reason


def test_processes_beyond_the_cores_explain_a_row_and_say_by_how_much():
    kind, reason = verdict(row(13.0, [19.0, 20.0, 20.5], world_size=4), cores=2)
    assert kind == NOT_PREDICTED, reason
    assert "its 4 processes share 2 cores" in reason and "7.00 ms a step more" in reason
    # a parameter server's extra process counts: 2 workers + 1 server on 2 cores
    assert verdict(row(4.0, [6.0, 6.1, 6.2], processes=3), cores=2)[0] == NOT_PREDICTED
    assert verdict(row(4.0, [6.0, 6.1, 6.2], processes=3), cores=4)[0] == OUTSIDE


def test_a_failed_run_is_failed():
    assert verdict(row(4.0, [], error="rank 1 died"), cores=2) == (FAILED, "rank 1 died")


@pytest.mark.parametrize(("rows", "status"), [
    ([row(10.0, [10.5] * 3), row(13.0, [20.0] * 3, world_size=4)], 0),
    ([row(10.0, [10.5] * 3), row(3.0, [6.0] * 3)], 1),
    ([row(10.0, [], error="rank 0 died")], 1),
])
def test_the_command_fails_only_for_an_unexplained_row_or_a_failed_run(capsys, rows, status):
    assert report(rows, cores=2) == status
    out = capsys.readouterr().out
    assert f"within 20 %: {sum(r['verdict'] == WITHIN for r in rows)} of {len(rows)} rows" in out
    for r in rows:
        if r["verdict"] != WITHIN:
            assert f"{r['verdict']}: gpipe n={r['world_size']}: {r['reason']}" in out
