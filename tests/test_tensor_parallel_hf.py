"""Hugging Face GPT-2 and Llama split by their built-in plans on real ranks equal the same
model in one process (float64, plain SGD, transformers' own ``labels=`` loss path): loss,
logits, every gradient of the first step and every parameter after three steps, with and
without sequence parallelism, tp = 2 and 3; GPT-2's tied embedding stays one shard and
Llama's grouped-query attention keeps whole key/value heads per rank. The bytes each rank
sends are the formula's: without sequence parallelism exactly the TransformerLM's (one f
per attention and MLP, Llama's q/k/v and gate/up included), with it the count below."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from disttrain.parallel.tensor.theory import (
    Collective,
    LMShape,
    bytes_sent,
    tp_step_collectives,
)
from tests.hf_cases import BATCH, CONFIGS, SEQ, VOCAB, step_traffic, train_and_compare


@pytest.mark.parametrize("tp", [2, 3])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp-sp"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_model_by_plan_equals_one_process_in_float64(pools, name, sequence_parallel, tp):
    """Float64 leaves ~1e-15 for the different order of sums; a gradient wrong by a factor
    (a missing sum over the group, a head split mid-way) shows by that factor."""
    for worst in pools(tp).run(train_and_compare, name, sequence_parallel):
        assert max(worst.values()) < 1e-10, worst


def _shape(name: str) -> tuple[int, int]:
    config = CONFIGS[name]
    return (int(config.get("n_embd", config.get("hidden_size", 0))),
            int(config.get("n_layer", config.get("num_hidden_layers", 0))))


def sequence_parallel_collectives(name: str, tp: int) -> list[Collective]:
    """One step of a Hugging Face model under its plan with sequence parallelism: each
    block's four f / g become an all-gather and a reduce-scatter each way (as for the
    TransformerLM); the embedding all-reduces the whole sequence (the model's own code
    needs it whole) and the first block's input split gathers its gradient back; GPT-2
    joins the sequence after ln_f and its head's f all-reduces (Llama's head gathers,
    ḡ); the loss's two all-reduces; the norms' (and GPT-2's row biases') gradients."""
    hidden, layers = _shape(name)
    act, tokens = BATCH * SEQ * hidden, BATCH * SEQ

    def c(op: str, numel: int = act) -> Collective:
        return Collective(op, numel, 4, name)

    per_block = [c("all_gather"), c("reduce_scatter")] * 4  # 2 forward pairs, 2 backward
    out = [c("all_reduce")] + per_block * layers + [c("all_gather")]  # + split's backward
    if name == "gpt2":
        out += [c("all_gather"), c("all_reduce")]  # join after ln_f, the head's f backward
        grads = (6 * layers + 2) * hidden  # ln_1, ln_2, two row biases; ln_f
    else:
        out += [c("all_gather"), c("reduce_scatter")]  # the head's ḡ
        grads = (2 * layers + 1) * hidden  # two RMSNorms per layer; the final one
    return [*out, c("all_reduce", tokens), c("all_reduce", 2 * tokens),
            c("all_reduce", grads)]


@pytest.mark.parametrize("tp", [2, 3])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp-sp"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_bytes_counted_by_the_transport_equal_the_formula(pools, name, sequence_parallel,
                                                             tp):
    hidden, layers = _shape(name)
    plan = sequence_parallel_collectives(name, tp) if sequence_parallel else (
        tp_step_collectives(LMShape(VOCAB, hidden, 6, layers, SEQ), BATCH, SEQ, tp, False))
    for rank, measured in enumerate(pools(tp).run(step_traffic, name, sequence_parallel)):
        expected: dict[str, tuple[int, int]] = {}
        for collective in plan:
            sent, calls = expected.get(collective.op, (0, 0))
            expected[collective.op] = (sent + int(bytes_sent([collective], tp, rank)),
                                       calls + 1)
        assert measured == expected
