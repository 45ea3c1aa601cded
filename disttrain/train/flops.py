"""Throughput in the units people compare: tokens/s and model FLOPs utilization (MFU).

Model FLOPs per token of a decoder-only transformer, PaLM's convention (Chowdhery et al.
2022, "PaLM: Scaling Language Modeling with Pathways", Appendix B; nanoGPT's
``estimate_mfu`` and torchtitan's ``get_num_flop_per_token`` use it too)::

    6·N + 12·L·H·T      per token, forward and backward (2 FLOPs a multiply-add; the
                        backward pass twice the forward's)
    N  parameters that multiply activations: every trainable parameter except embedding
       tables, which are looked up (one tied to the output head is counted); of a
       mixture-of-experts layer, the top_k of its n_experts experts a token is routed to
    L  attention layers, H their width (heads × head size), T the sequence length:
       12·L·H·T is the attention scores and their weighted sum, QKᵀ and AV, over the whole
       T×T square (a causal mask's skipped half counted, as PaLM does)

These are *model* FLOPs: what the model needs, whatever the implementation does, so
recomputed activations (activation checkpointing) and a pipeline's bubble count as lost
utilization, not as work (PaLM's MFU; Megatron's "hardware FLOPs" count recomputation,
Korthikanti et al. 2022). Then::

    MFU = model FLOPs per token × tokens/s ÷ (peak FLOP/s of one device × devices)

where a device is one GPU, or one machine's CPU (all its cores: the ranks of one machine
share them), and the peak is the user's ``--peak-tflops`` or the one ``disttrain info``
measures (:func:`disttrain.launch.info.measure_peak_tflops`).
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from disttrain.train.data import DataInfo
from disttrain.train.moe import MoEFeedForward
from disttrain.train.transformer import CausalSelfAttention


def attention_shape(module: nn.Module) -> tuple[int, int] | None:
    """(L, H): the attention layers of ``module`` and their width; None if it has none.
    disttrain's transformers, torch's ``MultiheadAttention`` and Hugging Face causal LMs
    (their config's layers, heads and head size) are recognized."""
    ours = [m for m in module.modules() if isinstance(m, CausalSelfAttention)]
    if ours:
        return len(ours), ours[0].qkv.in_features
    torch_mha = [m for m in module.modules() if isinstance(m, nn.MultiheadAttention)]
    if torch_mha:
        return len(torch_mha), torch_mha[0].embed_dim
    config = getattr(module, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if not all(isinstance(v, int) and v > 0 for v in (layers, heads, hidden)):
        return None
    assert isinstance(layers, int) and isinstance(heads, int) and isinstance(hidden, int)
    head_dim = getattr(config, "head_dim", None)
    return layers, heads * (head_dim if isinstance(head_dim, int) else hidden // heads)


def matmul_parameters(module: nn.Module) -> float:
    """N: trainable parameters that multiply activations per token (see the module
    docstring); fractional for mixtures of experts (top_k / n_experts of each expert)."""
    tables = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    used = {id(p) for m in module.modules() if not isinstance(m, nn.Embedding)
            for p in m.parameters(recurse=False)}  # e.g. an output head tied to a table
    total = float(sum(p.numel() for p in module.parameters()
                      if p.requires_grad and (id(p) not in tables or id(p) in used)))
    for moe in (m for m in module.modules() if isinstance(m, MoEFeedForward)):
        experts = sum(p.numel() for p in moe.experts.parameters() if p.requires_grad)
        total -= experts * (1 - moe.config.top_k / moe.config.n_experts)
    return total


def model_flops_per_token(module: nn.Module, seq_len: int) -> float | None:
    """6·N + 12·L·H·T for the transformer ``module`` on sequences of ``seq_len`` tokens;
    None for a model without attention (its samples are not token sequences)."""
    shape = attention_shape(module)
    if shape is None:
        return None
    layers, width = shape
    return 6 * matmul_parameters(module) + 12 * layers * width * seq_len


def devices_used(world_size: int, local_world_size: int, device_type: str,
                 gpus_per_node: int) -> int:
    """The devices the ranks of a run compute on: one per GPU they use, one per machine
    when they run on CPUs (the ranks of a machine share its cores)."""
    nodes = max(1, math.ceil(world_size / max(local_world_size, 1)))
    if device_type != "cuda":
        return nodes
    return nodes * max(1, min(local_world_size, gpus_per_node))


def local_world_size(world_size: int) -> int:
    """Ranks on this machine: what the launcher says (torchrun's ``LOCAL_WORLD_SIZE``,
    Slurm's and MPI's own variables), else all of them (``disttrain run -n N`` and the
    benchmark start every rank here)."""
    from disttrain.launch.env import PlacementError, launcher_of, resolve_placement

    if launcher_of(os.environ) is None:
        return world_size
    try:
        return resolve_placement(os.environ).local_world_size
    except (PlacementError, ValueError):
        return world_size


def mfu(flops_per_token: float | None, tokens_per_s: float | None,
        peak_tflops: float | None, devices: int) -> float | None:
    """Model FLOPs utilization, a fraction; None when a factor is unknown."""
    if flops_per_token is None or tokens_per_s is None or not peak_tflops:
        return None
    return flops_per_token * tokens_per_s / (peak_tflops * 1e12 * max(devices, 1))


@dataclass(frozen=True)
class Throughput:
    """What turns a run's samples/s into tokens/s and MFU (None where it does not apply:
    a model without attention, samples that are not token sequences, no peak given)."""

    tokens_per_sample: int | None = None
    flops_per_token: float | None = None
    devices: int = 1
    peak_tflops: float | None = None

    def tokens_per_s(self, samples_per_s: float) -> float | None:
        return None if self.tokens_per_sample is None else samples_per_s * self.tokens_per_sample

    def mfu(self, samples_per_s: float) -> float | None:
        return mfu(self.flops_per_token, self.tokens_per_s(samples_per_s), self.peak_tflops,
                   self.devices)


def throughput_of(module: nn.Module, info: DataInfo, world_size: int, device: torch.device,
                  peak_tflops: float | None) -> Throughput:
    """The :class:`Throughput` of training ``module`` (the whole model) on ``info``'s data
    with ``world_size`` ranks on ``device``-type devices."""
    if info.task != "lm":
        return Throughput()
    seq_len = info.input_shape[-1]
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    return Throughput(seq_len, model_flops_per_token(module, seq_len),
                      devices_used(world_size, local_world_size(world_size), device.type, gpus),
                      peak_tflops)


def peak_tflops_value(text: str) -> float | str:
    """``--peak-tflops``: a positive number of TFLOP/s, or ``auto``."""
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a positive number of TFLOP/s or auto, "
                                         f"got {text!r}")
    return value


def measured_peak(device: str, dtype: str = "float32") -> tuple[float, str]:
    """``--peak-tflops auto``: the matmul peak of one device of the kind ``device`` names
    (``disttrain info``'s benchmark), measured here before any rank starts (the ranks
    would share what is measured); returns it and the device measured."""
    from disttrain.launch.info import measure_peak_tflops
    from disttrain.train.device import resolve_device

    where = resolve_device(device)
    name = "cpu" if where.type == "cpu" else f"cuda:{where.index or 0}"
    return measure_peak_tflops(name, dtype), name
