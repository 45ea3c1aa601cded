"""Memory per device: model states by the ZeRO paper's formula, plus activations.

Model states (parameters, gradients, optimizer state) come from
:func:`disttrain.parallel.zero.memory.formula`, the same function the ZeRO tests check
against measured tensors. With Ψ parameters, N devices, 2-byte parameters and gradients
and K = 12 (mixed-precision Adam), Ψ = 7.5B and N = 64 give the paper's Figure 1::

    DDP     16Ψ           120   GB
    ZeRO-1  4Ψ + 12Ψ/N     31.4 GB
    ZeRO-2  2Ψ + 14Ψ/N     16.6 GB
    ZeRO-3  16Ψ/N           1.9 GB

Activations are what autograd saves per sample (measured by the profile) times the
samples a device holds at its peak: the local batch for data parallelism, and for a
pipeline stage the micro-batches in flight (m for GPipe, p − s for 1F1B on stage s).
Temporary buffers are added where a strategy keeps them: ZeRO-3 holds two gathered units
(the running one and the prefetched next).
"""

from __future__ import annotations

from disttrain.parallel.presets import PRESETS
from disttrain.parallel.zero.memory import ModelStateBytes, formula

GB = 1e9


def model_states(stage: int, params: int, devices: int, element_bytes: int,
                 k_bytes: int) -> ModelStateBytes:
    """Model-state bytes per device at ZeRO ``stage`` (0: replicated, as DDP keeps them)."""
    return formula(stage, params, devices, param_bytes=element_bytes,
                   grad_bytes=element_bytes, optimizer_bytes=k_bytes)


def zero_paper_table(psi: int = 7_500_000_000, devices: int = 64,
                     k_bytes: int = 12) -> dict[str, float]:
    """GB per device for DDP and ZeRO 1-3 (fp16/bf16 parameters and gradients), by the
    data-parallel preset of each stage."""
    stages = {p.zero: n for n, p in PRESETS.items() if p.kind == "data"}
    return {stages[s]: model_states(s, psi, devices, 2, k_bytes).total / GB
            for s in sorted(stages)}


def activations(saved_bytes_per_sample: float, samples: float, element_bytes: int) -> float:
    """Saved activations of ``samples`` samples, in the training precision (the profile is
    measured in fp32)."""
    return saved_bytes_per_sample * samples * element_bytes / 4
