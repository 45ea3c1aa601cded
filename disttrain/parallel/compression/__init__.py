"""Gradient compression for DataParallel: one interface, four compressors, one registry.

=========  ==============================================  =======================
name       what goes on the wire per bucket of n entries    bytes vs fp32 all-reduce
=========  ==============================================  =======================
none       n fp32 values, all-reduced                       1
fp16/bf16  n 16-bit values, all-reduced                     1/2
topk       k = ratio·n (value, int32 index) pairs, gathered  ≈ p·ratio (p ranks)
powersgd   (rows + cols)·r per matrix, all-reduced twice     ≈ r(n+m)/(nm) per layer
=========  ==============================================  =======================
"""

from __future__ import annotations

import torch

from disttrain.parallel.compression.base import (
    Compressor,
    NoCompression,
    PendingReduction,
    ThenFinish,
)
from disttrain.parallel.compression.cast import CastCompressor
from disttrain.parallel.compression.powersgd import PowerSGDCompressor
from disttrain.parallel.compression.topk import TopKCompressor

COMPRESSORS = ("none", "fp16", "bf16", "topk", "powersgd")


def make_compressor(name: str, *, topk_ratio: float = 0.01, powersgd_rank: int = 2,
                    seed: int = 0) -> Compressor:
    """A fresh compressor by name (what ``--compression`` on the command line maps to)."""
    if name == "none":
        return NoCompression()
    if name == "fp16":
        return CastCompressor(torch.float16)
    if name == "bf16":
        return CastCompressor(torch.bfloat16)
    if name == "topk":
        return TopKCompressor(topk_ratio)
    if name == "powersgd":
        return PowerSGDCompressor(powersgd_rank, seed=seed)
    raise ValueError(f"unknown compression {name!r}; choose one of: {', '.join(COMPRESSORS)}")


__all__ = [
    "COMPRESSORS",
    "CastCompressor",
    "Compressor",
    "NoCompression",
    "PendingReduction",
    "PowerSGDCompressor",
    "ThenFinish",
    "TopKCompressor",
    "make_compressor",
]
