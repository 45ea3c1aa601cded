"""A recommendation-style model and synthetic click data for sparse parameter-server runs.

``ClickModel`` scores (user, item) pairs: two embedding tables feed an MLP that predicts a
click. Almost all of its parameters are embedding rows, and a batch touches only a few of
them, which is the case sparse push/pull exists for (ps-lite's and BytePS's motivating
workloads: click-through-rate models with huge, sparsely touched tables).

``make_click_data`` draws users and items with a skewed (Zipf-like) popularity, as in real
logs, and labels a pair clicked when hidden user and item factors agree: a rule the model
can learn, so accuracy above the base rate shows that training works.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

SPARSE_PARAMS = ("users.weight", "items.weight")


@dataclass(frozen=True)
class ClickData:
    """Sizes of the synthetic click log."""

    num_users: int = 2000
    num_items: int = 2000
    samples: int = 8192
    factors: int = 4  # dimension of the hidden taste vectors that decide clicks
    skew: float = 1.0  # popularity ∝ 1 / (rank + 1) ** skew
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_users", "num_items", "samples", "factors"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int ≥ 1, got {value!r}")
        if not isinstance(self.skew, (int, float)) or self.skew < 0:
            raise ValueError(f"skew must be a number ≥ 0 (0: uniform), got {self.skew!r}")


def make_click_data(spec: ClickData = ClickData()) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, clicks)``: inputs is ``(samples, 2)`` int64 [user, item], clicks float 0/1."""
    gen = torch.Generator().manual_seed(spec.seed)
    users = _popular(spec.num_users, spec.samples, spec.skew, gen)
    items = _popular(spec.num_items, spec.samples, spec.skew, gen)
    taste = torch.randn(spec.num_users, spec.factors, generator=gen)
    trait = torch.randn(spec.num_items, spec.factors, generator=gen)
    clicks = ((taste[users] * trait[items]).sum(dim=1) > 0).float()
    return torch.stack([users, items], dim=1), clicks


def _popular(n: int, samples: int, skew: float, gen: torch.Generator) -> torch.Tensor:
    weights = 1.0 / torch.arange(1, n + 1, dtype=torch.float64) ** skew
    ranked = torch.multinomial(weights, samples, replacement=True, generator=gen)
    return torch.randperm(n, generator=gen)[ranked]  # popular ids scattered over the table


class ClickModel(nn.Module):
    """Embeddings of user and item, concatenated, through an MLP to one click logit."""

    def __init__(self, num_users: int = 2000, num_items: int = 2000, dim: int = 16,
                 hidden: int = 32) -> None:
        super().__init__()
        self.users = nn.Embedding(num_users, dim)
        self.items = nn.Embedding(num_items, dim)
        self.mlp = nn.Sequential(nn.Linear(2 * dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        both = torch.cat([self.users(inputs[:, 0]), self.items(inputs[:, 1])], dim=1)
        return self.mlp(both).squeeze(1)

    @staticmethod
    def sparse_ids(inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The table rows a batch touches, for ``PSWorker.pull(sparse_ids=...)``."""
        return {"users.weight": inputs[:, 0], "items.weight": inputs[:, 1]}
