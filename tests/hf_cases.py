"""Shared pieces of the Hugging Face tensor-parallel tests: tiny GPT-2 and Llama configs,
their data, the single-process reference, and rank functions for the pools (importable, so
picklable). Models are built from a config, never downloaded."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

from disttrain.parallel.tensor import parallelize

VOCAB, SEQ, BATCH, STEPS = 48, 12, 3, 3  # SEQ divides by 2 and 3 (sequence parallelism)
SGD_LR = 0.5  # large steps: a wrong gradient moves the parameters visibly

# 6 heads of 4: tp = 2 and 3 split them; the MLP (96) and the vocabulary (48) divide too
GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 24, "n_head": 6, "vocab_size": VOCAB,
        "n_positions": 16, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "bos_token_id": 0, "eos_token_id": 0}
# grouped-query attention: 12 query heads of 4, 6 key/value heads (2 queries share one);
# tp = 2 gives each rank 6 and 3, tp = 3 gives 4 and 2
LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 48,
         "intermediate_size": 48, "num_attention_heads": 12, "num_key_value_heads": 6,
         "vocab_size": VOCAB, "max_position_embeddings": 16, "bos_token_id": 0,
         "eos_token_id": 0, "tie_word_embeddings": False}
CONFIGS = {"gpt2": GPT2, "llama": LLAMA}


def make_model(name: str, dtype: torch.dtype = torch.float64, **overrides: Any
               ) -> torch.nn.Module:
    """The tiny ``name`` model from its config, the same on every rank (seed 0)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {**CONFIGS[name], **overrides}
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(dtype)


def batches(steps: int = STEPS, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, labels) with a few labels ignored (-100), as padding would be."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        labels = ids.clone()
        labels[0, -3:] = -100
        out.append((ids, labels))
    return out


def reference_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM loss, in the logits' own precision (its ForCausalLMLoss
    casts to float32)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                           ignore_index=-100)


def relative_errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]
                    ) -> dict[str, float]:
    """‖got − want‖ / ‖want‖ for every key of ``want`` (``got`` must hold them all)."""
    missing = sorted(set(want) - set(got))
    assert not missing, missing
    return {k: float((got[k] - want[k]).norm() / want[k].norm().clamp_min(1e-300))
            for k in want}


def full_grads(tp: Any) -> dict[str, torch.Tensor]:
    """The unsplit model's gradients on every rank: the parameters' data swapped for their
    gradients while ``full_state_dict`` gathers them."""
    params = list(tp.module.parameters())
    kept = [p.data for p in params]
    for p in params:
        p.data = p.grad
    try:
        return dict(tp.full_state_dict())
    finally:
        for p, data in zip(params, kept):
            p.data = data


def train_and_compare(comm: Any, name: str, sequence_parallel: bool) -> dict[str, float]:
    """float64, plain SGD, transformers' own ``labels=`` loss path: the worst relative
    error of the loss, the logits, the first step's gradients and the parameters after
    the steps, against the same model in one process."""
    data = batches()
    model = make_model(name)
    reference = copy.deepcopy(model)
    tp = parallelize(model, comm, sequence_parallel=sequence_parallel, algorithm="ring")
    opt = torch.optim.SGD(tp.module.parameters(), lr=SGD_LR)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=SGD_LR)
    worst = {"loss": 0.0, "logits": 0.0, "grads": 0.0, "params": 0.0}
    for step, (ids, labels) in enumerate(data):
        ref_opt.zero_grad()
        ref_logits = reference(input_ids=ids, use_cache=False).logits
        ref_loss = reference_loss(ref_logits, labels)
        ref_loss.backward()
        opt.zero_grad()
        out = tp.module(input_ids=ids, labels=labels, use_cache=False)
        out.loss.backward()
        tp.reduce_sequence_parallel_grads()
        worst["loss"] = max(worst["loss"], abs(out.loss.item() / ref_loss.item() - 1))
        aligned = tp.loss(out.logits[:, :-1], labels[:, 1:])  # the strategies' loss path
        worst["loss"] = max(worst["loss"], abs(aligned.item() / ref_loss.item() - 1))
        with torch.no_grad():
            logits = tp.full_logits(out.logits)
            worst["logits"] = max(worst["logits"], float((logits - ref_logits).norm()
                                                         / ref_logits.norm()))
        if step == 0:
            want = {n: p.grad for n, p in reference.named_parameters()}
            worst["grads"] = max(relative_errors(full_grads(tp), want).values())
        ref_opt.step()
        opt.step()
    state = tp.full_state_dict()
    assert sorted(state) == sorted(reference.state_dict())
    worst["params"] = max(relative_errors(state, reference.state_dict()).values())
    fresh = make_model(name)  # a checkpoint of the unsplit model loads into a shard
    tp.load_full_state_dict(fresh.state_dict())
    worst["reload"] = max(relative_errors(tp.full_state_dict(), fresh.state_dict()).values())
    return worst


def step_traffic(comm: Any, name: str, sequence_parallel: bool
                 ) -> dict[str, tuple[int, int]]:
    """One float32 training step's bytes sent and calls per collective, counted by the
    transport (the ``labels=`` loss path, sequence-parallel gradients included)."""
    tp = parallelize(make_model(name, torch.float32), comm,
                     sequence_parallel=sequence_parallel, algorithm="ring")
    ids, labels = batches(steps=1)[0]
    before = comm.stats.snapshot()
    tp.module(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    tp.reduce_sequence_parallel_grads()
    after = comm.stats.snapshot()
    return {op: (after[op]["bytes_sent"] - before.get(op, {}).get("bytes_sent", 0),
                 after[op]["calls"] - before.get(op, {}).get("calls", 0))
            for op in after if after[op] != before.get(op)}
