"""``disttrain bench pipeline``: rows from stage reports (pure), the configuration's errors, and
one short run on real ranks through the command line. No timed assertions: the figures are
the benchmark's to report, the tests check how they are computed and carried."""

from __future__ import annotations

import json

import pytest

from disttrain.bench.pipeline_bench import (
    PipelineBenchConfig,
    cases,
    format_row,
    make_row,
    synthetic_model,
    theory,
)
from disttrain.cli import main


def _step(wall: float, idle: float, busy: float) -> dict[str, float]:
    return {"wall_s": wall, "inside_s": wall, "wait_s": idle, "idle_s": idle, "busy_s": busy}


def test_theory_is_the_bubble():
    assert theory(4, 8) == pytest.approx(3 / 11)
    assert theory(2, 1) == 0.5
    assert theory(4, 8, 2) == pytest.approx(3 / 19)  # interleaved: v·m slots to fill


def test_interleaved_rows_need_1f1b_and_m_a_multiple_of_p():
    config = PipelineBenchConfig(microbatches=(1, 2, 4), virtual_stages=(1, 2))
    assert cases(config, 2) == [("gpipe", 1, 1), ("gpipe", 1, 2), ("gpipe", 1, 4),
                                ("1f1b", 1, 1), ("1f1b", 1, 2), ("1f1b", 1, 4),
                                ("1f1b", 2, 2), ("1f1b", 2, 4)]
    assert [case for case in cases(config, 4) if case[1] == 2] == [("1f1b", 2, 4)]


def test_a_row_splits_each_stage_interval_into_idle_busy_and_overhead():
    config = PipelineBenchConfig(stages=(2,), microbatches=(4,), steps=3)
    # stage 0: 1 s periods, 0.2 s waiting for a neighbour, 0.7 s computing; its third step
    # was disturbed (the median leaves it out). Stage 1 waits 0.3 s, computes 0.6 s.
    stage0 = [_step(1.0, 0.2, 0.7), _step(1.0, 0.2, 0.7), _step(2.0, 1.0, 0.1)]
    stage1 = [_step(1.0, 0.3, 0.6)] * 3
    reports = [{"schedule": "gpipe", "microbatches": 4, "stage": s, "steps": steps,
                "peak_stashed": 4} for s, steps in enumerate((stage0, stage1))]
    row = make_row(2, config, reports)
    assert row["theory"] == pytest.approx(0.2)
    assert row["idle_per_stage"] == pytest.approx([0.2, 0.3])
    assert row["idle_mean"] == pytest.approx(0.25)
    assert row["relative_error"] == pytest.approx(0.25)
    assert row["worst_relative_error"] == pytest.approx(0.5)
    assert row["not_computing_per_stage"] == pytest.approx([0.3, 0.4])
    assert row["overhead_per_microbatch_s"] == pytest.approx([0.1 / 4, 0.1 / 4])
    assert row["step_s"] == pytest.approx(1.0)
    assert row["transport"] == "torch"
    assert "gpipe" in format_row(row) and "+25.0%" in format_row(row)


@pytest.mark.parametrize("changes,message", [
    ({"stages": (1, 2)}, "stages must be ≥ 2"),
    ({"microbatches": (0,)}, "micro-batch counts must be ≥ 1"),
    ({"schedules": ("zigzag",)}, "unknown or missing schedules ['zigzag']"),
    ({"compute": "gpu"}, "compute must be one of sleep, matmul"),
    ({"forward_ms": 0, "backward_ms": 0}, "not both 0"),
    ({"steps": 0}, "steps must be ≥ 1"),
    ({"transport": "pigeon"}, "unknown transport 'pigeon'"),
    ({"virtual_stages": (0,)}, "virtual stage counts must be ≥ 1"),
    ({"virtual_stages": (2,), "schedules": ("gpipe",)}, "interleaves 1f1b; add 1f1b to "
                                                        "--schedules"),
    ({"virtual_stages": (1, 3)}, "2 layers per stage do not cut into 3 chunks"),
])
def test_bad_settings_say_what_to_fix(changes, message):
    with pytest.raises(ValueError) as info:
        PipelineBenchConfig(**changes)
    assert message in str(info.value)


@pytest.mark.parametrize("compute", ["sleep", "matmul"])
def test_the_synthetic_model_is_balanced(compute):
    config = PipelineBenchConfig(compute=compute, layers=3, width=8)
    model = synthetic_model(config, 4)
    assert len(model) == 12
    assert len({repr(layer) for layer in model}) == 1  # every layer alike: stages alike


def test_command_prints_and_writes_every_row(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    code = main(["bench", "pipeline", "-p", "2", "--microbatches", "2,3", "--forward-ms", "1",
                 "--backward-ms", "1", "--steps", "1", "--warmup", "0", "--microbatch-size", "2",
                 "--width", "4", "--comm-timeout", "30", "--virtual-stages", "1,2", "--json",
                 str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "over transport torch" in printed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # interleaved (v = 2) only where m is a multiple of p = 2
    assert [(r["schedule"], r["virtual_stages"], r["microbatches"]) for r in rows] == [
        ("gpipe", 1, 2), ("gpipe", 1, 3), ("1f1b", 1, 2), ("1f1b", 1, 3), ("1f1b", 2, 2)]
    for row in rows:
        assert row["theory"] == pytest.approx(theory(2, row["microbatches"],
                                                     row["virtual_stages"]))
        assert len(row["idle_per_stage"]) == 2
        assert all(0 <= idle <= 1 for idle in row["idle_per_stage"])
        assert format_row(row) in printed
        assert row["transport"] == "torch"
    # what each stage held, measured: GPipe all m micro-batches, 1F1B at most p − s,
    # interleaved with m = p every chunk's forward first (v·m chunk-micro-batches)
    assert rows[1]["peak_stashed"] == [3, 3] and rows[3]["peak_stashed"] == [2, 1]
    assert rows[4]["peak_stashed"] == [4, 4] and "1f1b v2" in printed


def test_command_refuses_bad_flags(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "pipeline", "-p", "1"])
    assert info.value.code == 2
    assert "stages must be ≥ 2" in capsys.readouterr().err
