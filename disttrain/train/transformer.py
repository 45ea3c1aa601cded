"""A small decoder-only transformer language model (GPT-style, pre-norm, causal attention).

Data flow, one ``nn.Sequential`` so the pipeline strategy can split it between blocks::

    tokens (B, T) → Embeddings → Block × n_layers → LayerNorm → Linear → logits (B, T, vocab)

    Block:  x = x + Attention(LayerNorm(x))      (each position attends to itself and earlier)
            x = x + MLP(LayerNorm(x))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Embeddings(nn.Module):
    """Token embedding plus a learned embedding of each position."""

    def __init__(self, vocab_size: int, max_len: int, d_model: int) -> None:
        super().__init__()
        self.max_len = max_len
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(max_len, d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[-1]
        if length > self.max_len:
            raise ValueError(f"sequence of {length} tokens is longer than max_len={self.max_len}")
        positions = torch.arange(length, device=tokens.device)
        return self.tokens(tokens) + self.positions(positions)


class CausalSelfAttention(nn.Module):
    """Multi-head attention where position t sees positions ≤ t only."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, d_model = x.shape
        q, k, v = self.qkv(x).split(d_model, dim=-1)
        # (B, T, D) → (B, heads, T, D/heads)
        q, k, v = (t.view(batch, length, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, length, d_model))


class Block(nn.Module):
    """Pre-norm transformer block: attention and a 4× MLP, each with a residual connection."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attention = CausalSelfAttention(d_model, n_heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TransformerLM(nn.Sequential):
    """Embeddings, ``n_layers`` blocks, a final LayerNorm and the vocabulary projection."""

    def __init__(self, vocab_size: int, max_len: int, d_model: int = 64, n_heads: int = 4,
                 n_layers: int = 2) -> None:
        if vocab_size < 2 or max_len < 1 or n_layers < 1:
            raise ValueError(f"TransformerLM needs vocab_size ≥ 2, max_len ≥ 1, n_layers ≥ 1; "
                             f"got {vocab_size}, {max_len}, {n_layers}")
        super().__init__(
            Embeddings(vocab_size, max_len, d_model),
            *(Block(d_model, n_heads) for _ in range(n_layers)),
            nn.LayerNorm(d_model),
            nn.Linear(d_model, vocab_size),
        )
