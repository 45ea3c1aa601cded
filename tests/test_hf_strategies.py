"""Hugging Face GPT-2 and Llama (tiny configs from JSON files, as ``--model-config`` gives
them: 2 layers, width 32, 4 heads, Llama with 2 key/value heads, vocabulary 48, 8
positions) trained by the loop under every strategy equal the single process: fp32, three
Adam steps on ``synthetic-lm``, every parameter within 1e-5 relative (GPT-2's key bias
aside: tests/hf_loop_cases.py), the same final loss and held-out accuracy, and the stages
together hold every parameter under the model's own names (GPT-2's tied head included).
With the ring algorithm every rank's bytes per step equal the strategy's theory (ZeRO-3
from the second step: its first forward prefetches in module order, which is not Llama's
order of execution, and gathers a mis-guessed unit twice)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from disttrain.train import ParallelOptions
from tests.hf_loop_cases import loop_config, rank_train, worst_relative_error

RING = {"algorithm": "ring"}
CASES = [  # (strategy, ranks, options); broadcast_buffers: the rotary tables are constants
    ("ddp", 2, {"broadcast_buffers": False, **RING}),
    ("zero1", 2, RING),
    ("zero2", 2, RING),
    ("zero3", 2, RING),
    ("tp", 2, RING),
    ("tp-sp", 2, RING),
    ("gpipe", 2, {"microbatches": 2}),
    ("1f1b", 2, {"microbatches": 4}),
    ("3d", 4, {"dp_size": 2, "tp_size": 2, **RING}),
    ("3d", 4, {"tp_size": 2, "pp_size": 2, "microbatches": 2, **RING}),
    ("3d", 4, {"tp_size": 2, "pp_size": 2, "microbatches": 2, "sequence_parallel": True,
               **RING}),
]
IDS = ["ddp", "zero1", "zero2", "zero3", "tp", "tp-sp", "gpipe", "1f1b", "dp2-tp2", "tp2-pp2",
       "tp2-pp2-sp"]


@pytest.fixture(scope="module")
def references() -> Any:
    """One single-process run per model and dataset, made when first asked for."""
    made: dict[tuple[str, str], tuple[dict[str, torch.Tensor], Any]] = {}

    def reference(name: str, dataset: str = "synthetic-lm"
                  ) -> tuple[dict[str, torch.Tensor], Any]:
        if (name, dataset) not in made:
            before = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                made[name, dataset] = rank_train(None, loop_config(name, dataset=dataset))
            finally:
                torch.set_num_threads(before)
        return made[name, dataset]

    return reference


def check(per_rank: list[Any], reference: tuple[dict[str, torch.Tensor], Any],
          first_step_bytes: bool = True) -> None:
    want, ref = reference
    seen: set[str] = set()
    for rank, (got, result) in enumerate(per_rank):
        err, name = worst_relative_error(got, want)
        assert err < 1e-5, (rank, name, err)
        seen |= set(got)
        assert result.final_loss == pytest.approx(ref.final_loss, rel=1e-5)
        assert result.accuracy == pytest.approx(ref.accuracy, abs=1.01 / 96)  # one token
        sent, theory = result.bytes_sent_per_step, result.theory_bytes_per_step
        assert theory is not None and sent is not None, rank
        assert sent[0 if first_step_bytes else 1:] == [theory] * (3 - (not first_step_bytes))
    assert seen == set(want), sorted(set(want) ^ seen)


@pytest.mark.parametrize(("strategy", "world", "options"), CASES, ids=IDS)
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_every_strategy_equals_one_process(pools, references, name, strategy, world,
                                           options):
    config = loop_config(name, strategy=strategy, parallel=ParallelOptions(**options))
    check(pools(world).run(rank_train, config), references(name),
          first_step_bytes=strategy != "zero3")



DICTS = "tests.hf_loop_cases:token_dicts"


@pytest.mark.parametrize(("strategy", "world", "options"), [
    ("ddp", 2, {"broadcast_buffers": False, **RING}),
    ("tp", 2, RING),
    ("1f1b", 2, {"microbatches": 4}),
    ("3d", 4, {"tp_size": 2, "pp_size": 2, "microbatches": 2, **RING}),
], ids=["ddp", "tp", "1f1b", "tp2-pp2"])
def test_dict_batches_with_labels_equal_one_process(pools, references, strategy, world,
                                                    options):
    """``{"input_ids", "labels"}`` batches (the last two labels of each ignored): one
    process, DDP and tp train on the model's own labels loss (the plan's vocabulary-parallel
    one under tp), the pipelines' last stage on the cross-entropy of the targets the loop
    aligned: the same loss, the same parameters."""
    config = loop_config("gpt2", dataset=DICTS, strategy=strategy,
                         parallel=ParallelOptions(**options))
    check(pools(world).run(rank_train, config), references("gpt2", DICTS))
