"""Pipelines at 3 and 4 stages and the tensor/sequence-parallel meshes, in the shared loop,
in float64 with plain SGD: every parameter's update equals one process's.

With plain SGD (no momentum) a parameter's update after K steps is −lr × the sum of its K
gradients, so comparing updates (final − initial) compares gradients before any optimizer
state could hide a factor, as Adam's normalization does (a gradient twice too large moves
Adam's parameters by the same step, up to eps). Float64 leaves ~1e-15 to the different order
of sums; the bound, 1e-9 of each tensor's update, is far above that and far below any
missing average, lost micro-batch or swapped message. Two-stage pipelines are blind to a
cool-down in the wrong order (stage 0 has one backward left); three and four stages are
not.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from disttrain.train import DataOptions, ParallelOptions, TrainConfig, train
from disttrain.train.data import build_dataset
from disttrain.train.models import build_model

MLP, LM = "tests.loop_models:deep_mlp", "tests.loop_models:lm_6_heads"
BOUND = 1e-9
PIPELINE = TrainConfig(model=MLP, dtype="float64", steps=2, global_batch=24, optimizer="sgd",
                       momentum=0.0, lr=0.5, eval_every=0, log_every=0, progress=False)
MESH = TrainConfig(model=LM, dtype="float64", dataset="synthetic-lm",
                   data=DataOptions(num_samples=48, seq_len=12, vocab_size=48), steps=2,
                   global_batch=8, optimizer="sgd", momentum=0.0, lr=0.5, eval_every=0,
                   log_every=0, progress=False)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def initial(config: TrainConfig) -> dict[str, torch.Tensor]:
    """The parameters every rank starts from (the loop seeds, builds the model, casts it)."""
    torch.manual_seed(config.seed)
    model = build_model(config.model, build_dataset(config.dataset, config.data).info)
    return _state(model.to(getattr(torch, config.dtype)))


def rank_train(comm: Any, config: TrainConfig) -> tuple[dict[str, torch.Tensor], float]:
    result = train(config, comm)
    return _state(result.model), result.final_loss


def update_errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                  start: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per tensor: ‖(got − start) − (want − start)‖ / ‖want − start‖ (a tensor that one
    process leaves unchanged must stay exactly unchanged)."""
    errors = {}
    for name, g in got.items():
        moved = want[name] - start[name]
        diff = float((g - want[name]).norm())
        errors[name] = diff / float(moved.norm()) if float(moved.norm()) else diff * 1e30
    return errors


def check(per_rank: list[Any], config: TrainConfig, *, split: bool) -> None:
    reference = train(dataclasses.replace(config, strategy="single", parallel=ParallelOptions()))
    want, start = _state(reference.model), initial(config)
    assert all(v.dtype == torch.float64 for v in want.values() if v.is_floating_point())
    seen: set[str] = set()
    for rank, (got, final_loss) in enumerate(per_rank):
        assert split or set(got) == set(want), rank
        assert all(v.dtype == want[k].dtype for k, v in got.items()), rank  # float64 throughout
        errors = update_errors(got, want, start)
        worst = max(errors, key=errors.__getitem__)
        assert errors[worst] < BOUND, (rank, worst, errors[worst])
        assert final_loss == pytest.approx(reference.final_loss, rel=1e-12, abs=0), rank
        seen |= set(got)
    assert seen == set(want), "the ranks together hold every parameter"


# ---------------------------------------------------------------- pipelines
@pytest.mark.parametrize(("strategy", "stages", "microbatches"), [
    ("gpipe", 3, 4), ("1f1b", 3, 4), ("gpipe", 4, 4), ("1f1b", 4, 6)])
def test_deep_pipelines_in_the_loop_equal_one_process(pools, strategy, stages, microbatches):
    config = dataclasses.replace(PIPELINE, strategy=strategy,
                                 parallel=ParallelOptions(microbatches=microbatches))
    check(pools(stages).run(rank_train, config), config, split=True)


def test_pp_dp_grid_in_the_loop_equals_one_process(pools):
    config = dataclasses.replace(PIPELINE, strategy="1f1b",
                                 parallel=ParallelOptions(microbatches=3, pp_size=2))
    check(pools(4).run(rank_train, config), config, split=True)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_data_parallel_in_float64_equals_one_process(pools, strategy):
    """ZeRO's master weights too: never narrower than a float64 model's parameters."""
    config = dataclasses.replace(PIPELINE, strategy=strategy,
                                 parallel=ParallelOptions(algorithm="ring"))
    check(pools(2).run(rank_train, config), config, split=False)


# ---------------------------------------------------------------- tensor-parallel meshes
@pytest.mark.parametrize(("strategy", "world", "options", "split"), [
    ("tp", 2, {}, False),
    ("tp", 3, {}, False),
    ("tp-sp", 3, {}, False),
    ("3d", 4, {"dp_size": 2, "tp_size": 2}, False),
    ("3d", 4, {"dp_size": 2, "tp_size": 2, "zero": 1, "sequence_parallel": True}, False),
    ("3d", 4, {"tp_size": 2, "pp_size": 2, "microbatches": 2, "sequence_parallel": True},
     True),
], ids=["tp-2", "tp-3", "tp-sp-3", "dp2-tp2", "dp2-tp2-zero1-sp", "tp2-pp2-sp"])
def test_tensor_parallel_meshes_in_the_loop_equal_one_process(pools, strategy, world, options,
                                                             split):
    config = dataclasses.replace(MESH, strategy=strategy,
                                 parallel=ParallelOptions(algorithm="ring", **options))
    check(pools(world).run(rank_train, config), config, split=split)


@pytest.mark.parametrize("strategy", ["1f1b", "gpipe"])
def test_a_model_that_is_not_a_sequential_pipelines_by_its_layers(pools, strategy):
    """A residual MLP whose blocks pass a (hidden, skip) tuple: its ``layers()`` are the
    chain, the tuples travel between the stages, the names are the model's own."""
    config = dataclasses.replace(PIPELINE, model="tests.loop_models:residual_mlp",
                                 strategy=strategy, parallel=ParallelOptions(microbatches=4))
    check(pools(2).run(rank_train, config), config, split=True)
