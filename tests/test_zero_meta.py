"""Meta-device initialisation: a model built on ``torch.device("meta")`` and wrapped equals the
same model built eagerly with the same seed, bit for bit (ZeRO-3 on 2 and 3 ranks, float32
and float64; stages 1 and 2); wrapping holds the shards plus one unit, not the model; a model
that cannot be initialised is a one-line error naming the module or tensor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from disttrain.parallel.zero import MetaInit
from disttrain.parallel.zero.meta import plan
from tests import zero_cases
from tests import zero_meta_cases as cases


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rank: int) -> None:
    assert got.keys() == want.keys()
    for name, value in got.items():
        assert value.dtype == want[name].dtype, (rank, name)
        assert torch.equal(value, want[name]), f"rank {rank}, {name}: differs from eager"


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_zero3_meta_init_equals_eager_init(pools, world_size, dtype):
    """Default units (every layer) and coarser ones (the blocks; the other layers then form
    the root's unit, open throughout): the same values, and the generator left where eager
    construction leaves it."""
    want, rng = cases.state(cases.build(dtype, False)), torch.get_rng_state()
    for units in ("default", "blocks"):
        for rank, result in enumerate(pools(world_size).run(cases.run_meta_init, 3, dtype,
                                                            units, False)):
            assert result["dtype"] == f"torch.{dtype}"
            assert_same(result["state"], want, rank)
            assert torch.equal(result["rng"], rng), f"rank {rank}: drew differently"


@pytest.mark.parametrize("stage", [1, 2])
def test_zero1_and_zero2_meta_init_equals_eager_init(pools, stage):
    want, rng = cases.state(cases.build("float64", False)), torch.get_rng_state()
    for rank, result in enumerate(pools(2).run(cases.run_meta_init, stage, "float64",
                                               "default", False)):
        assert_same(result["state"], want, rank)
        assert torch.equal(result["rng"], rng)


@pytest.mark.parametrize("stage", [2, 3])
def test_meta_init_under_hybrid_sharding_equals_eager_init(pools, stage):
    """2 × 2: each shard group materialises its shards, the replicas the same ones."""
    want = cases.state(cases.build("float64", False))
    for rank, result in enumerate(pools(4).run(cases.run_meta_init, stage, "float64",
                                               "default", False, 2)):
        assert_same(result["state"], want, rank)


def test_a_user_init_function_equals_model_apply(pools):
    eager = cases.eager_with_user_init("float32")
    want, rng = cases.state(eager), torch.get_rng_state()
    for rank, result in enumerate(pools(2).run(cases.run_meta_init, 3, "float32", "blocks",
                                               True)):
        assert_same(result["state"], want, rank)
        assert torch.equal(result["rng"], rng)


@pytest.mark.parametrize(("case", "message"), [
    ("no initialiser", "the root module (Net) holds 'scale' on the meta device but has no "
                       "reset_parameters() or init_weights() to initialise it"),
    ("unset", "meta initialisation left 'norm.weight' unset (NaN): MetaInit.init does not "
              "set it"),
    ("seeds", "the ranks disagree about the random generator state (hashed) before meta "
              "initialisation"),
], ids=["no-initialiser", "unset", "seeds"])
def test_what_cannot_be_initialised_is_a_one_line_error(pools, case, message):
    for error in pools(2).run(cases.run_error, case):
        assert message in error and "\n" not in error, error


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_zero3_wrap_peak_is_the_shards_plus_one_unit(pools, world_size):
    """A model 8× one unit (Ψ = 8U): eager wrapping holds the model, the first unit's
    buffer and its shard (Ψ + U + U/N); meta initialisation this rank's shards and one unit
    (Ψ/N + U), so what it holds beyond the shards it keeps is U, an eighth of the model and
    under a quarter of the eager peak. The whole peak, shards included, is under a quarter
    of eager's from N = 8 on (1/N + 1/8 < (1 + 1/8 + 1/(8N))/4), which the 8-rank case
    asserts."""
    for result in pools(world_size).run(cases.run_wrap_peak, 3, 8, 64):
        meta, eager, unit = result["meta"], result["eager"], result["unit_bytes"]
        model = result["model_bytes"]
        assert_same(result["meta_state"], result["eager_state"], 0)
        assert meta["live"] == eager["live"] == model // world_size  # the shards kept
        assert eager["peak"] == model + unit + unit // world_size
        assert meta["peak"] == meta["live"] + unit  # the shards and one unit, no more
        assert meta["peak"] - meta["live"] < eager["peak"] / 4
        if world_size >= 8:
            assert meta["peak"] < eager["peak"] / 4, (meta["peak"], eager["peak"])


def test_zero2_meta_init_writes_straight_into_the_flat_buffer(pools):
    """Stages 1 and 2 keep every parameter: eager wrapping holds the model and the flat
    buffer (2Ψ), meta initialisation the buffer alone."""
    for result in pools(2).run(cases.run_wrap_peak, 2, 8, 64):
        assert_same(result["meta_state"], result["eager_state"], 0)
        assert result["meta"]["peak"] == result["model_bytes"]
        assert result["eager"]["peak"] == 2 * result["model_bytes"]


# ---------------------------------------------------------------- pure: the plan
def test_plan_runs_initialisers_children_first_and_checks_its_input():
    with torch.device("meta"):
        model = cases.MetaNet()
    order = [name for name, _, call in plan(model, None, torch.device("cpu")).steps if call]
    assert order[:4] == ["inp", "norm", "blocks.0.lin", "blocks.0"]  # eager's draw order
    assert order[-2:] == ["bn", "head"]
    assert plan(cases.MetaNet(), None, torch.device("cpu")) is None  # materialised: eager
    with pytest.raises(ValueError, match="no tensor of this one is on it; drop meta_init"):
        plan(cases.MetaNet(), MetaInit(), torch.device("cpu"))
    partly = zero_cases.Net()
    with torch.device("meta"):
        partly.head = nn.Linear(7, 3)
    with pytest.raises(ValueError, match=r"partly on the meta device \('head.weight'\)"):
        plan(partly, None, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"MetaInit\.init must be a function"):
        MetaInit(init=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not 'meta'"):
        MetaInit(device="meta")
