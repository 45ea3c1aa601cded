"""Activation checkpointing and torch.compile on a strategy's blocks (train/blocks.py): the
same training, bit for bit (checkpointing) or to float64 rounding (compile), under every
strategy; fewer saved activations with checkpointing."""

from __future__ import annotations

import dataclasses
import shutil
from typing import Any

import pytest
import torch

from disttrain.train import ParallelOptions, TrainConfig, train
from disttrain.train.blocks import apply_activation_checkpointing, blocks_of
from tests.test_train_float64 import MESH, PIPELINE

# Inductor (it needs a C++ compiler) compiles the single-process case; the distributed ones
# use aot_eager: the same graphs and graph breaks around the communicator (Dynamo and AOT
# autograd), without generating code, which on a fresh machine costs tens of seconds a case
INDUCTOR = "inductor" if shutil.which("g++") else "aot_eager"


def run(comm: Any, config: TrainConfig) -> tuple[dict[str, torch.Tensor], int]:
    result = train(config, comm)
    state = {k: v.detach().clone() for k, v in result.model.state_dict().items()}
    return state, result.activation_peak_bytes_max


CASES = [("single", 1, PIPELINE, {}), ("ddp", 2, PIPELINE, {}), ("zero1", 2, PIPELINE, {}),
         ("zero2", 2, PIPELINE, {}), ("zero3", 2, PIPELINE, {}),
         ("gpipe", 2, PIPELINE, {"microbatches": 4}), ("1f1b", 2, PIPELINE, {"microbatches": 4}),
         ("tp", 2, MESH, {}), ("tp-sp", 2, MESH, {}), ("cp", 2, MESH, {}),
         ("3d", 4, MESH, {"tp_size": 2, "pp_size": 2, "microbatches": 2})]


def _pair(comm: Any, config: TrainConfig) -> list[tuple[dict[str, torch.Tensor], int]]:
    return [run(comm, dataclasses.replace(config, activation_checkpointing=mode))
            for mode in ("none", "full")]


@pytest.mark.parametrize(("strategy", "world", "base", "options"), CASES,
                         ids=[c[0] for c in CASES])
def test_activation_checkpointing_changes_no_gradient(pools, strategy, world, base, options):
    config = dataclasses.replace(base, strategy=strategy, parallel=ParallelOptions(**options))
    per_rank = [_pair(None, config)] if world == 1 else pools(world).run(_pair, config)
    for rank, ((plain, plain_act), (checked, checked_act)) in enumerate(per_rank):
        assert plain.keys() == checked.keys()
        for name in plain:  # float64, the same operations again: bit for bit
            assert torch.equal(plain[name], checked[name]), (rank, name)
        assert checked_act <= plain_act, (rank, checked_act, plain_act)
        if base is MESH:  # a transformer block keeps its input only, not its insides
            assert checked_act < plain_act / 2, (rank, checked_act, plain_act)


def test_selective_checkpoints_every_second_block():
    from disttrain.train.transformer import TransformerLM

    model = TransformerLM(16, 8, d_model=8, n_heads=2, n_layers=4)
    assert len(blocks_of(model)) == 4
    assert apply_activation_checkpointing(model, "selective") == 2
    assert [getattr(b, "_disttrain_checkpointed", False) for b in blocks_of(model)] == [
        True, False, True, False]
    with pytest.raises(ValueError, match="none, full, selective"):
        apply_activation_checkpointing(model, "some")


def _compiled(comm: Any, config: TrainConfig) -> list[dict[str, torch.Tensor]]:
    backend = INDUCTOR if comm is None else "aot_eager"
    return [run(comm, dataclasses.replace(config, compile=flag, compile_backend=backend))[0]
            for flag in (False, True)]


@pytest.mark.parametrize(("strategy", "world", "base", "options"), [
    ("single", 1, PIPELINE, {}), ("ddp", 2, PIPELINE, {}), ("zero2", 2, PIPELINE, {}),
    ("tp", 2, MESH, {}), ("tp", 2, MESH, {"algorithm": "ring"}),
    ("cp", 2, MESH, {"algorithm": "ring"})],
    ids=["single", "ddp", "zero2", "tp", "tp-ring", "cp-ring"])
def test_compiled_blocks_train_as_eager_ones(pools, strategy, world, base, options):
    """disttrain's own algorithms (ring) inside compiled blocks run between the graphs."""
    config = dataclasses.replace(base, strategy=strategy,
                                 parallel=ParallelOptions(**options))
    per_rank = [_compiled(None, config)] if world == 1 else pools(world).run(_compiled, config)
    for rank, (eager, compiled) in enumerate(per_rank):
        for name in eager:
            torch.testing.assert_close(compiled[name], eager[name], rtol=1e-9, atol=1e-12,
                                       msg=f"rank {rank} {name}")


def test_compile_under_zero3_is_refused_in_one_line():
    from disttrain.train.strategies import get_strategy

    config = dataclasses.replace(PIPELINE, strategy="zero3", compile=True)
    with pytest.raises(ValueError, match="ZeRO-3") as exc:
        get_strategy("zero3").check_config(config, 2)
    assert "\n" not in str(exc.value)


def checkpointed_bytes(comm: Any, config: TrainConfig) -> list[tuple[list[int], float]]:
    out = []
    for mode in ("full", "selective"):
        result = train(dataclasses.replace(config, activation_checkpointing=mode), comm)
        out.append((result.bytes_sent_per_step, result.theory_bytes_per_step))
    return out


@pytest.mark.parametrize(("strategy", "world", "options"), [
    ("tp", 2, {}), ("tp-sp", 2, {}), ("cp", 2, {}), ("cp", 2, {"cp_variant": "ulysses"}),
    ("3d", 4, {"tp_size": 2, "pp_size": 2, "microbatches": 2})],
    ids=["tp", "tp-sp", "cp-ring", "cp-ulysses", "tp2-pp2"])
def test_checkpointed_blocks_send_what_the_theory_says(pools, strategy, world, options):
    """A checkpointed block's forward runs again in backward, and so do its collectives
    (tensor parallelism's all but the last: torch stops recomputing before the block's
    output; context parallelism's attention): full and selective, bytes = formula every
    step."""
    from tests.test_tensor_parallel_strategies import CONFIG

    config = dataclasses.replace(CONFIG, strategy=strategy, parallel=ParallelOptions(
        algorithm="ring", **options))
    for per_mode in pools(world).run(checkpointed_bytes, config):
        for sent, theory in per_mode:
            assert sent == [theory] * len(sent)
