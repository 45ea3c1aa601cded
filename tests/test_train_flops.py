"""Model FLOPs per token (6·N + 12·L·H·T) against the matrix products torch's FlopCounterMode
counts in a forward and backward, for disttrain's transformers, a mixture of experts and
Hugging Face GPT-2 (tied head) and Llama (grouped-query attention); devices and MFU; the
benchmark table's token columns; the peak `disttrain info` measures."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from disttrain.train.data import DataInfo
from disttrain.train.flops import devices_used, mfu, model_flops_per_token, throughput_of
from disttrain.train.moe import MoEConfig, MoEFeedForward, TransformerMoE
from disttrain.train.transformer import TransformerLM

B, T = 4, 32


def counted_per_token(model: torch.nn.Module, logits=lambda out: out) -> float:
    """FLOPs of the matrix products of one forward and backward, per token. The math
    attention, whose QKᵀ and AV are counted products (a fused kernel may not be)."""
    tokens = torch.randint(0, 64, (B, T))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits(model(tokens)).sum().backward()
    return counter.get_total_flops() / (B * T)


def elementwise_share(model: torch.nn.Module) -> float:
    """6 × the parameters the convention counts that no product multiplies (biases, norm
    scales; of experts, the share a token visits): N holds them, the counter does not."""
    experts = {id(p): m.config.top_k / m.config.n_experts
               for m in model.modules() if isinstance(m, MoEFeedForward)
               for p in m.experts.parameters()}
    return 6 * sum(p.numel() * experts.get(id(p), 1.0)
                   for p in model.parameters() if p.dim() == 1)


def test_transformer_flops_are_the_counted_products():
    torch.manual_seed(0)
    model = TransformerLM(64, T, d_model=64, n_heads=4, n_layers=2)
    formula = model_flops_per_token(model, T)
    assert formula is not None
    assert counted_per_token(model) == formula - elementwise_share(model)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert counted_per_token(model) == 6 * linear + 12 * 2 * 64 * T  # PaLM's 6N + 12LHT


def test_mixture_of_experts_counts_the_experts_a_token_visits():
    torch.manual_seed(0)  # no capacity limit: no token dropped, each visits top_k experts
    model = TransformerMoE(64, T, moe=MoEConfig(n_experts=4, top_k=2, capacity_factor=None))
    formula = model_flops_per_token(model, T)
    assert formula is not None
    assert counted_per_token(model) == formula - elementwise_share(model)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hugging_face_models_tied_head_and_grouped_query_attention(kind):
    transformers = pytest.importorskip("transformers")
    if kind == "gpt2":  # wte is the head too (counted once); wpe is a lookup
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                         n_positions=T, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
    else:  # 4 query heads over 2 key/value heads: the scores are the query heads'
        config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32,
                                          num_attention_heads=4, num_key_value_heads=2,
                                          intermediate_size=64, vocab_size=64,
                                          max_position_embeddings=T, bos_token_id=0,
                                          eos_token_id=0)
        model = transformers.LlamaForCausalLM(config)
    formula = model_flops_per_token(model, T)
    assert formula is not None
    assert counted_per_token(model, lambda out: out.logits) == formula - elementwise_share(model)


def test_models_without_attention_have_no_token_figures():
    from disttrain.train.models import mlp

    info = DataInfo((64,), 10)
    assert model_flops_per_token(mlp(info), 1) is None
    speed = throughput_of(mlp(info), info, 2, torch.device("cpu"), 100.0)
    assert speed.tokens_per_s(1000.0) is None and speed.mfu(1000.0) is None


def test_devices_and_mfu():
    assert devices_used(4, 4, "cpu", 0) == 1  # four CPU ranks share one machine
    assert devices_used(8, 4, "cpu", 0) == 2
    assert devices_used(8, 4, "cuda", 8) == 8  # a GPU each
    assert devices_used(8, 8, "cuda", 2) == 2  # 8 ranks on 2 GPUs (Gloo staging)
    assert mfu(6e9, 1e4, 100.0, 2) == pytest.approx(6e13 / 2e14)
    assert mfu(6e9, 1e4, None, 2) is None and mfu(None, 1e4, 100.0, 1) is None
    model = TransformerLM(64, T)
    info = DataInfo((T,), 64, "lm")
    speed = throughput_of(model, info, 2, torch.device("cpu"), 0.5)
    assert speed.tokens_per_s(10.0) == 10.0 * T and speed.devices == 1
    assert speed.mfu(10.0) == pytest.approx(model_flops_per_token(model, T) * 10 * T / 0.5e12)


def test_the_bench_table_adds_token_columns_only_for_language_models():
    from disttrain.bench.report import COLUMNS, cells, table_columns, text_table

    row = {"strategy": "ddp", "world_size": 2, "global_batch": 32, "samples_per_s": 100.0,
           "peak_mem_bytes": 1e8, "theory_bytes_per_rank_per_step": None,
           "accuracy": 0.9, "final_loss": 0.5}
    assert table_columns([row]) == COLUMNS  # the default table as it was
    lm = {**row, "tokens_per_s": 3200.0, "mfu": None}
    assert table_columns([lm]) == (*COLUMNS[:4], "tokens/s", *COLUMNS[4:])
    with_peak = {**lm, "mfu": 0.1234}
    columns = table_columns([with_peak, row])
    assert columns[3:6] == ("samples/s", "tokens/s", "MFU")
    assert cells(with_peak, columns)[3:6] == ["100.0", "3200", "12.34%"]
    assert cells(row, columns)[4:6] == ["-", "-"]
    assert cells({**row, "error": "boom"}, columns)[-1] == ""
    assert "tokens/s" in text_table([with_peak]).splitlines()[0]


def test_info_measures_a_peak():
    from disttrain.launch.info import measure_peak_tflops, render

    peak = measure_peak_tflops("cpu", "float32", budget_s=0.05)
    assert 0 < peak < 1e3  # a CPU's matmul, in TFLOP/s
    facts = {"disttrain": "x", "torch": "x", "python": "x", "host": "h", "platform": "p",
             "backends": {}, "nccl_version": None,
             "cpu": {"logical_cores": 2, "usable_cores": 2, "torch_threads": 2,
                     "numa_nodes": []},
             "gpus": {"count": 0, "cuda_build": None}, "gpu_topology": None,
             "calibration": {"path": "p", "stored": True, "transports": {}},
             "peak_tflops": {"cpu": {"float32": 0.05}},
             "launch": {"placement": "none", "variables": {}}}
    assert "peak       cpu float32 0.05 TFLOP/s" in render(facts)
