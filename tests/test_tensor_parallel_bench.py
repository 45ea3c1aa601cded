"""``disttrain bench`` rows of the mesh strategies: planned by default only on the
transformer, refused with the reason on another model, ``3d`` rows on the ``--tp`` /
``--pp`` mesh, and a two-rank table of tp against torch-tp on the transformer."""

from __future__ import annotations

import pytest

from disttrain.bench.experiments import BenchConfig, plan
from disttrain.bench.report import text_table
from disttrain.bench.strategy_bench import run_table, train_config

MESH_ROWS = {"tp", "tp-sp", "3d", "torch-tp", "torch-tp-sp"}


def test_default_table_plans_the_tensor_parallel_rows_on_the_transformer_only():
    lenet = {r.experiment.name for r in plan(BenchConfig(model="lenet", dataset="digits"))}
    assert not lenet & MESH_ROWS and {"ddp", "gpipe"} <= lenet
    lm = {r.experiment.name for r in plan(BenchConfig(model="transformer",
                                                      dataset="synthetic-lm"))}
    assert MESH_ROWS <= lm
    assert MESH_ROWS <= {r.experiment.name for r in plan(BenchConfig())}  # transformer-d128
    assert BenchConfig().selected()[0].name == "single"


def test_a_tensor_parallel_row_on_another_model_says_why():
    from disttrain.bench.strategy_bench import _refusal

    config = BenchConfig(strategies=("tp",), model="lenet", dataset="digits")
    row = _refusal(config, plan(config)[1])
    assert row is not None and row["error"].startswith("not runnable here: strategy 'tp' "
                                                       "splits a transformer's attention heads")
    assert "model 'lenet' is not a TransformerLM: use --model transformer" in row["error"]


def test_3d_rows_run_on_the_configured_mesh():
    config = BenchConfig(strategies=("3d", "tp"), world_sizes=(4,), model="transformer",
                         dataset="synthetic-lm", tp_size=2, pp_size=2)
    options = {r.experiment.name: train_config(config, r).parallel for r in plan(config)}
    assert (options["3d"].tp_size, options["3d"].pp_size, options["3d"].algorithm) == (
        2, 2, config.algorithm)
    assert options["tp"].tp_size is None and options["tp"].algorithm == config.algorithm
    with pytest.raises(ValueError, match="--tp must be an integer ≥ 1"):
        BenchConfig(tp_size=0)


@pytest.mark.timeout(300)
def test_tp_against_torch_tp_on_two_ranks():
    config = BenchConfig(strategies=("tp", "torch-tp", "tp-sp"), world_sizes=(2,), steps=3,
                         model="transformer", dataset="synthetic-lm", eval_every=0,
                         untimed_steps=1, timeout_s=30.0)
    rows = {r["strategy"]: r for r in run_table(config).rows}
    tp, torch_tp = rows["tp"], rows["torch-tp"]
    assert tp["error"] is None and torch_tp["error"] is None
    assert tp["vs_torch"] == pytest.approx(tp["samples_per_s"] / torch_tp["samples_per_s"])
    assert tp["bytes_sent_per_rank_per_step"] == tp["theory_bytes_per_rank_per_step"] > 0
    # on the default transport (shared memory) tp-sp's reduce-scatters are priced as shm
    # writes them (every block once), not as a ring sends them
    sp = rows["tp-sp"]
    assert sp["error"] is None
    assert sp["bytes_sent_per_rank_per_step"] == sp["theory_bytes_per_rank_per_step"] > 0
    assert tp["final_loss"] == pytest.approx(rows["single"]["final_loss"], rel=1e-5)
    assert torch_tp["final_loss"] == pytest.approx(rows["single"]["final_loss"], rel=1e-5)
    extras = tp["extras"]
    assert extras["activation_bytes_per_block"] == extras["activation_bytes_per_block_formula"]
    assert "tp n=2: dp 1 × pp 1 × tp 2, no sequence parallelism; activations per block" in (
        text_table(list(rows.values())))
