"""``--no-decay-norms-biases``: the usual recipe's two parameter groups (weight decay on the
matrices, none on biases and norm weights) under every strategy's optimizer (a ZeRO
wrapper's slices of its shards, a tensor-parallel shard's slices, a pipeline stage's
parameters), training the TransformerLM as one process does (fp32 AdamW, 1e-5 relative)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from disttrain.train import ParallelOptions, train
from disttrain.train.strategies import optimizer_class, optimizer_factory
from disttrain.train.transformer import TransformerLM
from tests.tensor_parallel_cases import worst_relative_error
from tests.test_tensor_parallel_strategies import CONFIG, rank_train

RECIPE = dataclasses.replace(CONFIG, optimizer="adamw", weight_decay=0.5,
                             no_decay_norms_biases=True)


def trained(config):
    torch.set_num_threads(1)
    return {k: v.detach().clone() for k, v in train(config).model.state_dict().items()}


@pytest.fixture(scope="module")
def single():
    return trained(RECIPE)


def test_the_recipe_leaves_vectors_undecayed():
    model = TransformerLM(vocab_size=48, max_len=8, d_model=8, n_heads=2, n_layers=1)
    optimizer = optimizer_factory(RECIPE)(model.parameters())
    decay, plain = optimizer.param_groups
    assert decay["weight_decay"] == 0.5 and plain["weight_decay"] == 0.0
    assert {p.dim() for p in decay["params"]} == {2}
    assert {p.dim() for p in plain["params"]} == {1}  # biases, LayerNorm weights and biases
    assert len(decay["params"]) + len(plain["params"]) == len(list(model.parameters()))


def test_the_flag_changes_training(single):
    """The equivalences below would hold with the flag ignored everywhere: not here."""
    without = trained(dataclasses.replace(RECIPE, no_decay_norms_biases=False))
    assert worst_relative_error(without, single)[0] > 1e-4


@pytest.mark.parametrize(("strategy", "world", "options"), [
    ("zero2", 2, {}),
    ("3d", 4, {"dp_size": 2, "tp_size": 2, "zero": 3, "sequence_parallel": True}),
    ("1f1b", 2, {"microbatches": 2}),
], ids=["zero2", "dp2-tp2-zero3-sp", "1f1b"])
def test_every_strategy_trains_the_recipe_as_one_process(pools, single, strategy, world,
                                                         options):
    config = dataclasses.replace(RECIPE, strategy=strategy, parallel=ParallelOptions(**options))
    for rank, (state, _) in enumerate(pools(world).run(rank_train, config)):
        expected = {k: v for k, v in single.items() if k in state}  # a stage: its part
        err, name = worst_relative_error(state, expected)
        assert err < 1e-5, (rank, name, err)


def test_strategies_without_parameter_groups_refuse_it_in_one_line():
    config = dataclasses.replace(RECIPE, strategy="ps-sync")
    with pytest.raises(ValueError, match="--no-decay-norms-biases") as exc:
        optimizer_class(config)
    assert "\n" not in str(exc.value)
