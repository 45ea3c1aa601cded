"""The built-in plans: disttrain's TransformerLM, Hugging Face GPT-2 and Llama
(:func:`plan_for` picks one by the model's structure or its ``config.model_type``).

Hugging Face models are read by name and config, never imported (transformers is an
optional extra). Their activations are batch-first ``(B, T, H)``, and their own code needs
the whole sequence after the embedding (GPT-2 adds positions, Llama computes rotary
angles, both build the causal mask from its length): with sequence parallelism the
embedding's output stays whole (g) and the sequence is split at the first block's input
(:class:`~.plan.SplitSequence`), where Megatron would reduce-scatter out of the embedding;
GPT-2 joins it again after its last norm, whose output it reshapes by the whole length.

GPT-2 (``GPT2LMHeadModel`` or ``GPT2Model``)::

    wte               VocabEmbedding          tied to lm_head: one shard for both
    h.0               SplitSequence           (SP) the region starts here
    h.*.ln_1, ln_2    SequenceParallel
    h.*.attn          LocalHeads              num_heads, embed_dim, split_size divided by t
    h.*.attn.c_attn   ColumnWise(parts=3, unit=head_dim)   Conv1D (in, 3·H): q, k, v by heads
    h.*.attn.c_proj   RowWise(unit=head_dim)
    h.*.mlp.c_fc      ColumnWise
    h.*.mlp.c_proj    RowWise
    ln_f              SequenceParallel, JoinSequence       (SP) the region ends here
    lm_head           VocabHead(input="whole")

Llama (``LlamaForCausalLM`` or ``LlamaModel``), grouped-query attention included: q holds
``heads/t`` heads and k, v ``kv_heads/t`` each (both must divide by t); the rotary
embedding is left untouched (it has buffers, no parameters, and every rank needs all of it)::

    embed_tokens                         VocabEmbedding
    layers.0                             SplitSequence (SP)
    layers.*.input_layernorm             SequenceParallel, EnterRegion  (one f for q, k, v)
    layers.*.self_attn                   LocalHeads (the attributes older versions keep)
    layers.*.self_attn.{q,k,v}_proj      ColumnWise(unit=head_dim, input="entered")
    layers.*.self_attn.o_proj            RowWise(unit=head_dim)
    layers.*.post_attention_layernorm    SequenceParallel, EnterRegion  (one f for gate, up)
    layers.*.mlp.{gate,up}_proj          ColumnWise(input="entered")
    layers.*.mlp.down_proj               RowWise
    norm                                 SequenceParallel
    lm_head                              VocabHead                     (ḡ with SP)

Dropout: the equivalence tests run with dropout off. With it on, the dropouts in the
replicated regions draw the same masks on every tp rank (same seed, same calls), as one
process would; those inside the split regions (attention probabilities on this rank's
heads, GPT-2's residual dropouts on this rank's positions under SP) draw from the same
stream on every rank too, so their masks repeat across ranks instead of being independent
(Megatron gives those regions a per-rank random stream).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from disttrain.parallel.tensor.plan import (
    CausalLMLoss,
    ColumnWise,
    EnterRegion,
    JoinSequence,
    LocalHeads,
    Plan,
    RowWise,
    SequenceParallel,
    SplitSequence,
    Styles,
    VocabEmbedding,
    VocabHead,
)
from disttrain.parallel.tensor.transformer import lm_parts, transformer_lm_plan


def _config(model: nn.Module, model_type: str) -> Any:
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != model_type:
        raise ValueError(f"the {model_type} plan splits a transformers {model_type} model; "
                         f"got {type(model).__name__}")
    return config


def _head(model: nn.Module, styles: dict[str, Styles], head: Styles) -> dict[str, Styles]:
    """The plan with the LM head and its loss when the model has one."""
    if isinstance(getattr(model, "lm_head", None), nn.Linear):
        styles.update({"lm_head": head, "": CausalLMLoss()})
    return styles


def gpt2_plan(model: nn.Module) -> Plan:
    """The plan of a Hugging Face GPT-2 (module docstring)."""
    config = _config(model, "gpt2")
    if getattr(config, "add_cross_attention", False):
        raise ValueError("the GPT-2 plan has no entries for cross-attention; write a plan "
                         "that adds them (crossattention, ln_cross_attn)")
    head_dim = int(config.n_embd) // int(config.n_head)
    p = "transformer." if hasattr(model, "transformer") else ""
    styles: dict[str, Styles] = {
        f"{p}wte": VocabEmbedding(),
        f"{p}h.0": SplitSequence(),
        f"{p}h.*.ln_1": SequenceParallel(),
        f"{p}h.*.attn": LocalHeads(("num_heads", "embed_dim", "split_size")),
        f"{p}h.*.attn.c_attn": ColumnWise(parts=3, unit=head_dim),
        f"{p}h.*.attn.c_proj": RowWise(unit=head_dim),
        f"{p}h.*.ln_2": SequenceParallel(),
        f"{p}h.*.mlp.c_fc": ColumnWise(),
        f"{p}h.*.mlp.c_proj": RowWise(),
        f"{p}ln_f": (SequenceParallel(), JoinSequence()),
    }
    return Plan(_head(model, styles, VocabHead(input="whole")), sequence_dim=1)


def llama_plan(model: nn.Module) -> Plan:
    """The plan of a Hugging Face Llama (module docstring)."""
    config = _config(model, "llama")
    hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    p = "model." if hasattr(model, "model") else ""
    attn, mlp = f"{p}layers.*.self_attn", f"{p}layers.*.mlp"
    styles: dict[str, Styles] = {
        f"{p}embed_tokens": VocabEmbedding(),
        f"{p}layers.0": SplitSequence(),
        f"{p}layers.*.input_layernorm": (SequenceParallel(), EnterRegion()),
        attn: LocalHeads(optional=("num_heads", "num_key_value_heads", "hidden_size")),
        f"{attn}.q_proj": ColumnWise(unit=head_dim, input="entered"),
        f"{attn}.k_proj": ColumnWise(unit=head_dim, input="entered"),
        f"{attn}.v_proj": ColumnWise(unit=head_dim, input="entered"),
        f"{attn}.o_proj": RowWise(unit=head_dim),
        f"{p}layers.*.post_attention_layernorm": (SequenceParallel(), EnterRegion()),
        f"{mlp}.gate_proj": ColumnWise(input="entered"),
        f"{mlp}.up_proj": ColumnWise(input="entered"),
        f"{mlp}.down_proj": RowWise(),
        f"{p}norm": SequenceParallel(),
    }
    return Plan(_head(model, styles, VocabHead()), sequence_dim=1)


HF_PLANS: dict[str, Callable[[nn.Module], Plan]] = {"gpt2": gpt2_plan, "llama": llama_plan}


def plan_for(model: nn.Module) -> Plan:
    """The built-in plan of ``model``: a TransformerLM's, or a transformers model's by its
    ``config.model_type``; a one-line ValueError for any other model."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if isinstance(model_type, str) and model_type in HF_PLANS:
        return HF_PLANS[model_type](model)
    try:
        lm_parts(model)
    except ValueError:
        raise ValueError(f"no built-in tensor-parallel plan for {type(model).__name__} (there "
                         f"are for disttrain's TransformerLM and transformers' "
                         f"{', '.join(HF_PLANS)}); pass plan={{pattern: style}}") from None
    return transformer_lm_plan(model)
