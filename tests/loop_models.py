"""Models for the loop's float64 equivalence tests, by ``TrainConfig(model="tests.
loop_models:deep_mlp", dtype="float64")``; the loop casts them and their float inputs to the
config's dtype. No test here."""

from __future__ import annotations

import math

import torch
from torch import nn

from disttrain.train.data import DataInfo
from disttrain.train.transformer import TransformerLM


def deep_mlp(info: DataInfo) -> nn.Module:
    """Eight layers, four with parameters: 3 and 4 pipeline stages each get some."""
    width = 24
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(info.input_shape), width), nn.Tanh(),
                         nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, info.num_classes))


def lm_6_heads(info: DataInfo) -> nn.Module:
    """The loop's TransformerLM with 6 heads of 4: tp = 2 and tp = 3 both split it."""
    vocab, length = info.num_classes, info.input_shape[0]
    return TransformerLM(vocab, length, d_model=24, n_heads=6, n_layers=2)


class _Embed(nn.Module):
    """Input → (hidden, skip): the residual stream starts as a tuple."""

    def __init__(self, inputs: int, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(inputs, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x.flatten(1))
        return h, h


class _Block(nn.Module):
    """(hidden, skip) → (hidden', skip'): a residual block whose output is a tuple."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, state: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        h, skip = state
        out = torch.tanh(self.fc(h)) + skip
        return out, h


class _Head(nn.Module):
    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.fc(torch.cat(state, dim=-1))


class ResidualMLP(nn.Module):
    """Not an nn.Sequential: its blocks pass a (hidden, skip) tuple along. ``layers()`` is
    its chain, the stage function a pipeline cuts (docs/pipeline.md)."""

    def __init__(self, inputs: int, classes: int, width: int = 16, blocks: int = 3) -> None:
        super().__init__()
        self.embed = _Embed(inputs, width)
        self.blocks = nn.ModuleList(_Block(width) for _ in range(blocks))
        self.head = _Head(width, classes)

    def layers(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = self.embed(x)
        for block in self.blocks:
            state = block(state)
        return self.head(state)


def residual_mlp(info: DataInfo) -> nn.Module:
    return ResidualMLP(math.prod(info.input_shape), info.num_classes)
