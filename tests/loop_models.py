"""Models for the loop's float64 equivalence tests, by ``TrainConfig(model="tests.
loop_models:deep_mlp", dtype="float64")``; the loop casts them and their float inputs to the
config's dtype. No test here."""

from __future__ import annotations

import math

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
