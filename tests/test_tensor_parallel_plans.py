"""Plans as data, without processes: a plan that does not fit the model is a one-line
ValueError naming the module and the numbers (a pattern that matches nothing, heads or key/
value heads or a vocabulary that do not divide, a style on the wrong kind of module, a tied
weight split two ways or left whole); fused and transposed splits join back; the built-in
plans are picked by the model. Building a shard calls no collective, so a stand-in
communicator with a rank and a size is enough here."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from disttrain.parallel.tensor import (
    ColumnWise,
    LocalHeads,
    Plan,
    RowWise,
    SequenceParallel,
    VocabEmbedding,
    VocabHead,
    parallelize,
    plan_for,
)
from disttrain.parallel.tensor.api import as_group
from disttrain.parallel.tensor.layers import parse_split, shard, unshard
from disttrain.train.transformer import TransformerLM


class FakeComm:
    """Just enough of a communicator to build a shard (no collective is called)."""

    def __init__(self, world_size: int, rank: int = 0) -> None:
        self.rank, self.world_size = rank, world_size


class Tiny(nn.Module):
    """A user's model: an embedding, a block with a two-layer MLP, a tied head."""

    def __init__(self, vocab: int = 12, hidden: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.block = nn.ModuleDict({"norm": nn.LayerNorm(hidden),
                                    "up": nn.Linear(hidden, 4 * hidden),
                                    "down": nn.Linear(4 * hidden, hidden)})
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight


def _error(model: nn.Module, plan: Any, tp: int) -> str:
    with pytest.raises(ValueError) as info:
        parallelize(model, FakeComm(tp), plan)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# ---------------------------------------------------------------- a plan that does not fit
def test_a_pattern_that_matches_nothing_is_named():
    message = _error(Tiny(), {"blocks.*.up": ColumnWise()}, 2)
    assert "'blocks.*.up' matches no module of Tiny" in message


def test_a_module_two_patterns_match_is_named():
    message = _error(Tiny(), {"block.up": ColumnWise(), "*.up": ColumnWise()}, 2)
    assert "block.up matches both 'block.up' and '*.up'" in message


def test_a_style_on_the_wrong_kind_of_module_names_it():
    message = _error(Tiny(), {"block.norm": ColumnWise()}, 2)
    assert "block.norm is a LayerNorm" in message


def test_features_that_do_not_divide_name_the_module_and_the_numbers():
    message = _error(Tiny(hidden=5), {"block.up": ColumnWise()}, 3)
    assert message.startswith("block.up: its 20 output features (20) do not split over 3 "
                              "tensor-parallel ranks")


def test_a_vocabulary_that_does_not_divide_is_named():
    message = _error(Tiny(vocab=10), {"embed": VocabEmbedding(), "head": VocabHead()}, 4)
    assert message.startswith("embed:") and "10 vocabulary entries" in message


def test_a_tied_weight_split_two_ways_is_an_error():
    message = _error(Tiny(), {"embed": VocabEmbedding(), "head": RowWise()}, 2)
    assert "head.weight is tied to embed.weight" in message


def test_a_tied_weight_left_whole_is_an_error():
    message = _error(Tiny(), {"embed": VocabEmbedding()}, 2)
    assert "head.weight is tied to embed.weight" in message and "give head a style" in message


def test_a_tied_weight_split_alike_stays_one_parameter():
    tp = parallelize(Tiny(), FakeComm(2, rank=1), {
        "embed": VocabEmbedding(), "block.norm": SequenceParallel(),
        "block.up": ColumnWise(), "block.down": RowWise(), "head": VocabHead()})
    module: Any = tp.module
    assert module.head.weight is module.embed.weight
    assert module.embed.weight.shape == (6, 8)
    assert tp.vocab is not None and (tp.vocab.size, tp.vocab.start) == (12, 6)
    assert tp.sequence_parameters == []  # no sequence parallelism


def test_heads_that_do_not_divide_name_the_module():
    model = TransformerLM(vocab_size=48, max_len=8, d_model=24, n_heads=4)
    message = _error(model, None, 3)
    assert message.startswith("1.attention.qkv: its 72 output features (3 parts of 4 heads "
                              "of 6) do not split over 3 tensor-parallel ranks")


def test_the_original_model_is_left_as_it_was():
    model = Tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    parallelize(model, FakeComm(2), {"embed": VocabEmbedding(), "head": VocabHead()})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert isinstance(model.embed, nn.Embedding)


def test_local_heads_divides_the_attributes_and_names_a_missing_one():
    attention = nn.Module()
    attention.num_heads, attention.width = 6, 24  # type: ignore[assignment]
    holder = nn.Sequential(attention)
    tp = parallelize(holder, FakeComm(3), {"0": LocalHeads(("num_heads", "width"))})
    assert (tp.module[0].num_heads, tp.module[0].width) == (2, 8)
    message = _error(holder, {"0": LocalHeads(("heads",))}, 3)
    assert "0 has no integer attribute 'heads'" in message
    message = _error(holder, {"0": LocalHeads(("num_heads",))}, 4)
    assert "0.num_heads=6 does not split over 4" in message


def test_plan_entries_must_be_styles():
    with pytest.raises(ValueError, match="is not a style"):
        Plan({"x": "colwise"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="input must be one of"):
        ColumnWise(input="replicated")


def test_a_mesh_gives_its_tp_group_and_refuses_tp_1():
    class Mesh:
        def __init__(self, tp: Any) -> None:
            self.tp = tp

        def group(self, dims: str) -> Any:
            assert dims == "tp"
            return self.tp

    comm = FakeComm(2, rank=1)
    assert as_group(Mesh(comm)).comm is comm
    with pytest.raises(ValueError, match="tp dimension has size 1"):
        as_group(Mesh(None))


def test_a_model_without_a_built_in_plan_is_told_to_pass_one():
    with pytest.raises(ValueError, match="no built-in tensor-parallel plan for Tiny"):
        plan_for(Tiny())


# ---------------------------------------------------------------- Hugging Face plans
hf = pytest.importorskip  # a Hugging Face case skips without the extra


def test_llama_key_value_heads_that_do_not_divide_name_the_projection():
    hf("transformers")
    from tests.hf_cases import make_model

    model = make_model("llama", num_key_value_heads=2)
    message = _error(model, None, 3)
    assert message.startswith("model.layers.0.self_attn.k_proj:")
    assert "2 heads of 4" in message and "over 3 tensor-parallel ranks" in message


def test_gpt2_heads_that_do_not_divide_name_the_attention_and_projection():
    hf("transformers")
    from tests.hf_cases import make_model

    message = _error(make_model("gpt2"), None, 4)
    assert message.startswith("transformer.h.0.attn.num_heads=6 does not split over 4")
    plan = plan_for(make_model("gpt2"))  # without the attention's own check: the projection
    styles = {k: v for k, v in plan.styles.items() if not k.endswith(".attn")}
    message = _error(make_model("gpt2"), styles, 4)
    assert message.startswith("transformer.h.0.attn.c_attn:")
    assert "3 parts of 6 heads of 4" in message


def test_hf_plans_keep_the_layout_and_the_tie():
    hf("transformers")
    from tests.hf_cases import make_model

    tp = parallelize(make_model("gpt2"), FakeComm(2), sequence_parallel=True)
    module: Any = tp.module
    attn = module.transformer.h[0].attn
    assert attn.c_attn.weight.shape == (24, 36)  # Conv1D's (in, out): q, k, v, 3 heads each
    assert attn.c_attn.tp_split == {"weight": "cols/3", "bias": "rows/3"}
    assert (attn.num_heads, attn.split_size) == (3, 12)
    assert module.lm_head.weight is module.transformer.wte.weight
    assert len(tp.sequence_parameters) == 14  # 2 × (ln_1, ln_2: 2 each; 2 row biases) + ln_f
    llama: Any = parallelize(make_model("llama"), FakeComm(3), sequence_parallel=True).module
    attention = llama.model.layers[0].self_attn
    assert attention.q_proj.weight.shape == (16, 48)  # 4 of 12 heads
    assert attention.k_proj.weight.shape == (8, 48)  # 2 of 6 key/value heads


# ---------------------------------------------------------------- pure pieces
@pytest.mark.parametrize("how", ["rows/3", "cols/3", "cols", "rows/2"])
@pytest.mark.parametrize("t", [1, 2, 3])
def test_fused_and_transposed_shards_join_back(how, t):
    full = torch.randn(36, 18)
    shards = torch.stack([shard(full, how, r, t) for r in range(t)])
    assert torch.equal(unshard(shards, how), full)


def test_a_fused_column_shard_takes_each_parts_slice():
    full = torch.arange(12.0).repeat(2, 1)  # columns: q0..q3 k0..k3 v0..v3
    assert shard(full, "cols/3", 1, 2)[0].tolist() == [2.0, 3.0, 6.0, 7.0, 10.0, 11.0]


def test_split_names():
    assert parse_split("qkv") == parse_split("rows/3") == (0, 3)
    assert parse_split("cols") == (1, 1)
    with pytest.raises(ValueError, match="unknown split"):
        parse_split("diagonal")
