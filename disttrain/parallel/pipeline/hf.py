"""Hugging Face GPT-2 and Llama as a chain of pipeline layers (:func:`hf_stages`), and the
tied weights such a chain holds on two stages (:class:`TiedWeights`).

A transformers causal LM is not an ``nn.Sequential``: its forward computes positions,
rotary angles and the causal mask once and hands them to every block. A pipeline cuts a
chain, so :func:`hf_stages` writes the forward as one, each link a *stage function* that
recomputes what its block needs from the hidden states it receives::

    GPT-2 (GPT2LMHeadModel)                    Llama (LlamaForCausalLM)
    transformer.wte    ids → token embeddings   model.embed_tokens  ids → embeddings
    transformer.wpe    + positions, dropout     model.layers.i      mask, rotary angles,
    transformer.h.i    mask, the block                              the decoder layer
    transformer.ln_f   the model's own          model.norm          the model's own
    lm_head            the model's own          lm_head             the model's own

Between stages travel the hidden states ``(B, T, H)``: no mask or position crosses a stage
boundary (a batch's ``attention_mask`` must be all ones: padding masks are not carried).
The first layer takes ``input_ids`` ``(B, T)``, or a dict holding them (its ``labels`` are
the loss's business, on the last stage; :mod:`disttrain.train.batches`).

**Names.** Each link is named by the model's module it stands for (``layer_names()``) and
holds that module's parameters, buffers and children under their own names (the same
objects: a link is a view, not a copy), so a stage's ``state_dict`` keys are the model's
(``transformer.h.1.attn.c_attn.weight``) and a checkpoint loads into the unsplit model.
The link calls the module itself, so hooks on it (a tensor-parallel plan's) still run.

**Tensor parallelism.** The view of a shard (:func:`~disttrain.parallel.tensor.parallelize`)
runs the shard's modules, collectives included. With sequence parallelism the built-in
plans split the sequence at the first block's input, so the blocks after it receive
``T / t`` positions while their mask and rotary angles are for all ``T``:
``sequence_split=t`` says so.

**Tied weights.** GPT-2 ties its LM head to the token embedding: one matrix used by the
first and the last stage. The view unties them (the head gets a copy, under its own name
``lm_head.weight``, and the model is changed so) and lists the pair in ``tied``;
:class:`TiedWeights` then keeps the copies equal as Megatron-LM does: after backward the two
stages all-reduce (sum) the two gradients, so both hold the whole gradient of the tied
matrix and identical optimizers make identical steps on identical copies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel.backward import all_reduce_flat_gradients

PASSED_KEYS = ("input_ids", "labels", "attention_mask")  # what a dict batch may hold


def input_ids_of(batch: Any) -> torch.Tensor:
    """The token ids of a batch: a tensor, or a dict's ``input_ids`` (beside ``labels`` and
    an all-ones ``attention_mask``); a one-line ValueError for anything the chain would
    drop."""
    if isinstance(batch, torch.Tensor):
        return batch
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise ValueError(f"the first pipeline stage of a Hugging Face model takes input_ids "
                         f"or a dict holding them, got {type(batch).__name__}")
    extra = sorted(set(batch) - set(PASSED_KEYS))
    mask = batch.get("attention_mask")
    if extra or (mask is not None and not bool(torch.all(mask == 1))):
        what = f"key {extra[0]!r}" if extra else "a padding attention_mask"
        raise ValueError(f"a pipeline of a Hugging Face model carries only the hidden states "
                         f"between stages: the batch's {what} would be dropped; give "
                         f"input_ids and labels (unpadded), or train without pipeline stages")
    ids: torch.Tensor = batch["input_ids"]
    return ids


class Link(nn.Module):
    """One stage function standing for the model's module ``inner``: it registers
    ``inner``'s parameters, buffers and children as its own (the same objects, under the
    same names) and calls ``inner`` itself, hooks included."""

    inner: Any

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        for name, param in inner.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buffer in inner.named_buffers(recurse=False):
            self.register_buffer(name, buffer,
                                 persistent=name not in inner._non_persistent_buffers_set)
        for name, child in inner.named_children():
            self.add_module(name, child)
        split = getattr(inner, "tp_split", None)
        if split is not None:  # a tensor-parallel layer's: how its slices join back
            self.tp_split = dict(split)
        object.__setattr__(self, "inner", inner)  # called, not registered: no name twice


class TokenEmbedding(Link):
    """``input_ids`` (or a dict holding them) → token embeddings ``(B, T, H)``."""

    def forward(self, batch: Any) -> torch.Tensor:
        out: torch.Tensor = self.inner(input_ids_of(batch))
        return out


class GPT2Positions(Link):
    """GPT-2's ``wpe``: token embeddings + position embeddings, then the dropout."""

    dropout: Any

    def __init__(self, wpe: nn.Module, dropout: nn.Module) -> None:
        super().__init__(wpe)
        object.__setattr__(self, "dropout", dropout)  # no parameters: the model's own

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        out: torch.Tensor = self.dropout(hidden + self.inner(positions).to(hidden.device))
        return out


class Block(Link):
    """One transformer block (GPT-2's ``h.i``, Llama's ``layers.i``) on the hidden states:
    its causal mask and positions are rebuilt for the whole sequence (``split`` times the
    positions received), and for Llama its rotary angles (``rotary``, the model's own)."""

    config: Any
    rotary: Any

    def __init__(self, block: nn.Module, config: Any, split: int,
                 rotary: nn.Module | None = None) -> None:
        super().__init__(block)
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "rotary", rotary)  # buffers only, shared by every block
        self.split = split

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        batch, length = hidden.shape[0], hidden.shape[1] * self.split
        positions = torch.arange(length, device=hidden.device).unsqueeze(0)
        whole = hidden[:, :1].expand(batch, length, hidden.shape[-1])  # shape only
        mask = create_causal_mask(config=self.config, inputs_embeds=whole, attention_mask=None,
                                  cache=None, position_ids=positions)
        extra: dict[str, Any] = {}
        if self.rotary is not None:
            extra["position_embeddings"] = self.rotary(whole, position_ids=positions)
        out = self.inner(hidden, attention_mask=mask, position_ids=positions, **extra)
        return out[0] if isinstance(out, tuple) else out


class HFStages(nn.Module):
    """A Hugging Face causal LM as a chain (:func:`hf_stages`): ``layers()`` for the
    pipeline, ``layer_names()`` for the model's names, ``tied`` for the weights the chain
    holds twice; called on ``input_ids`` it returns the model's logits."""

    def __init__(self, links: Sequence[nn.Module], names: Sequence[str],
                 tied: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__()
        self.chain = nn.ModuleList(links)
        self.names = list(names)
        self.tied = list(tied)

    def layers(self) -> list[nn.Module]:
        return list(self.chain)

    def layer_names(self) -> list[str]:
        return list(self.names)

    def forward(self, batch: Any) -> torch.Tensor:
        x = batch
        for link in self.chain:
            x = link(x)
        return x


def is_hf_causal_lm(model: nn.Module) -> bool:
    """Whether :func:`hf_stages` can chain ``model`` (GPT-2 or Llama with an LM head)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type in ("gpt2", "llama") and isinstance(getattr(model, "lm_head", None),
                                                         nn.Module)


def _untie(model: nn.Module, embedding: Any) -> bool:
    """Give the LM head its own copy of a weight it shares with ``embedding`` (True)."""
    head: Any = model.lm_head
    if head.weight is not embedding.weight:
        return False
    head.weight = nn.Parameter(head.weight.detach().clone(),
                               requires_grad=head.weight.requires_grad)
    return True


def hf_stages(model: nn.Module, sequence_split: int = 1) -> HFStages:
    """``model`` (a transformers GPT-2 or Llama causal LM, or a tensor-parallel shard of
    one) as a chain of stage functions under the model's names (module docstring);
    ``sequence_split``: how many ranks a shard's sequence-parallel region splits the
    sequence over (1: none). Unties a tied LM head (``tied`` lists the pair)."""
    if not is_hf_causal_lm(model):
        raise ValueError(f"hf_stages chains transformers' GPT-2 and Llama causal LMs (with an "
                         f"lm_head); got {type(model).__name__}: give a pipeline an "
                         f"nn.Sequential or a model with a layers() method")
    m: Any = model
    config = m.config
    if config.model_type == "gpt2":
        body = m.transformer
        names = ["transformer.wte", "transformer.wpe"]
        links: list[nn.Module] = [TokenEmbedding(body.wte), GPT2Positions(body.wpe, body.drop)]
        links += [Block(block, config, sequence_split if i else 1)
                  for i, block in enumerate(body.h)]
        names += [f"transformer.h.{i}" for i in range(len(body.h))]
        tail, embedding = ("transformer.ln_f", body.ln_f), body.wte
    else:
        body = m.model
        names = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(len(body.layers)))]
        links = [TokenEmbedding(body.embed_tokens)]
        links += [Block(layer, config, sequence_split if i else 1, body.rotary_emb)
                  for i, layer in enumerate(body.layers)]
        tail, embedding = ("model.norm", body.norm), body.embed_tokens
    tied = [(f"{names[0]}.weight", "lm_head.weight")] if _untie(model, embedding) else []
    return HFStages([*links, tail[1], m.lm_head], [*names, tail[0], "lm_head"], tied)


def named_layers(names: Sequence[str], layers: Sequence[nn.Module]) -> nn.Module:
    """``layers`` in one module under their names in the model (``transformer.h.1`` at
    ``root.transformer.h`` child ``1``): its ``state_dict`` keys are the model's."""
    root = nn.Module()
    for name, layer in zip(names, layers):
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, nn.Module())
            node = getattr(node, part)
        node.add_module(leaf, layer)
    return root


class TiedWeights:
    """Weights a pipeline holds on its first and its last stage (``tied``: pairs of names
    in the model, :attr:`HFStages.tied`), kept equal as Megatron-LM keeps its embedding:
    before every optimizer step (a step pre-hook on ``optimizer``) the two stages of each
    pipeline all-reduce the sum of their gradients of the pair, over a group of those two
    ranks (one per pipeline; every rank of the pp group takes part in making it)."""

    def __init__(self, pipe: Any, tied: Sequence[tuple[str, str]],
                 optimizer: torch.optim.Optimizer | None) -> None:
        pp: Communicator | None = pipe.mesh.pp
        self.group: Communicator | None = None
        if pp is not None and tied:
            self.group = pp if pp.world_size == 2 else pp.new_group([0, pp.world_size - 1])
        named = dict(pipe.named_module().named_parameters())
        self.params = [named[name] for pair in tied for name in pair if name in named]
        self.nbytes = sum(p.numel() * p.element_size() for p in self.params)
        if self.params and self.group is not None:
            if optimizer is None:
                raise ValueError("a stage holding a tied weight needs an optimizer")
            optimizer.register_step_pre_hook(lambda *_: self.sync())

    def sync(self) -> None:
        """Sum each tied gradient over the two stages that hold it (a collective)."""
        if self.group is None or not self.params:
            return
        all_reduce_flat_gradients(self.params, self.group)

    def theory_bytes(self) -> float:
        """Bytes this rank sends in :meth:`sync` with its group's algorithm (0 where
        torch.distributed runs it natively: the counters do not see those)."""
        if self.group is None or not self.params:
            return 0.0
        return self.group.theory_bytes_sent("all_reduce", self.nbytes) or 0.0

    def copies(self) -> list[nn.Parameter]:
        """The tied parameters this stage holds as the pair's second (the head's copy):
        a global gradient norm counts each pair once, on its first stage."""
        return self.params if self.group is not None and self.group.rank > 0 else []
