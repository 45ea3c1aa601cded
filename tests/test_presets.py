"""The presets (disttrain.parallel.presets): names as degrees and options, one table that the
composer, the simulator, the memory formulas and the benchmark all read."""

from __future__ import annotations

import math

import pytest

from disttrain.parallel.presets import (
    ALL,
    FLAG,
    FLAG_OR_ALL,
    PRESETS,
    REST,
    Preset,
    degrees,
    zero_presets,
)
from disttrain.parallel.zero.memory import formula
from disttrain.simulate import memory
from disttrain.simulate.analytic import ANALYTIC
from disttrain.simulate.base import Case
from disttrain.simulate.cluster import get_cluster
from disttrain.simulate.strategies import STRATEGIES as SIMULATED
from disttrain.simulate.workload import Workload
from disttrain.train.strategies import PRESETS as BUILT
from disttrain.train.strategies.compose import compose

RUNNABLE = [name for name, p in PRESETS.items() if not p.reference]


@pytest.mark.parametrize("name", RUNNABLE)
def test_every_runnable_preset_has_a_builder_a_simulator_model_and_a_memory_figure(name):
    preset = PRESETS[name]
    assert name in BUILT and name in SIMULATED
    if preset.parameter_server is None:
        assert BUILT[name].build is compose  # one composer builds every composition
    cluster = get_cluster("nvlink-node")
    # a transformer: tp can split it; expert parallelism needs one with experts
    model = "gpt-1.3b-moe8" if "ep" in preset.uses else "gpt-1.3b"
    profile = ANALYTIC[model](cluster.device_flops)
    row = SIMULATED[name](Case(profile, cluster, Workload(global_batch=64), 8))
    assert row.error is None, row.error
    assert row.strategy == name and math.isfinite(row.step_s) and row.memory_bytes > 0
    if preset.kind == "data":  # the ZeRO paper's formula for its stage
        states = formula(preset.zero, profile.params, 8, param_bytes=2, grad_bytes=2,
                         optimizer_bytes=12).total
        assert memory.model_states(preset.zero, profile.params, 8, 2, 12).total == states
        assert row.memory_bytes >= states


def test_degrees_follow_the_rules_and_name_the_fix():
    def sizes(**given: int) -> dict[str, int]:
        return {"dp": 1, "pp": 1, "cp": 1, "ep": 1, "tp": 1, **given}

    assert degrees(PRESETS["ddp"], 4) == sizes(dp=4)
    assert degrees(PRESETS["gpipe"], 4) == sizes(pp=4)
    assert degrees(PRESETS["1f1b"], 4, pp=2) == sizes(dp=2, pp=2)
    assert degrees(PRESETS["tp-sp"], 3) == sizes(tp=3)
    assert degrees(PRESETS["3d"], 8, tp=2, pp=2) == sizes(dp=2, pp=2, tp=2)
    assert degrees(PRESETS["3d"], 4) == sizes(dp=4)
    assert degrees(PRESETS["ep"], 4, ep=2) == sizes(dp=2, ep=2)
    assert degrees(PRESETS["cp"], 3) == sizes(cp=3)
    with pytest.raises(ValueError, match="--tp 3 = 3 does not divide the world size"):
        degrees(PRESETS["3d"], 8, tp=3)
    with pytest.raises(ValueError, match="= 8 ranks, but the world has 4"):
        degrees(PRESETS["3d"], 4, dp=2, tp=2, pp=2)
    with pytest.raises(ValueError, match="rule"):
        Preset("bad", (("tp", "most"),))
    assert {ALL, FLAG, FLAG_OR_ALL, REST} >= {r for p in PRESETS.values() for _, r in p.dims}


def test_the_zero_presets_are_the_stages_in_order():
    assert [PRESETS[n].zero for n in zero_presets()] == [1, 2, 3]
    assert all(PRESETS[n].kind == "data" for n in zero_presets())


def test_a_name_is_defined_once():
    """The literal names of the ZeRO presets live in the presets table (and the baselines'
    registry, which says which preset each baseline implements), nowhere else."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "disttrain"
    holders = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                     if '"zero2"' in p.read_text())
    assert holders == ["baselines/__init__.py", "parallel/presets.py"], holders
