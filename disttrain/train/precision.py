"""The autocast context a training step runs its forward pass in, by precision name.

``fp32`` runs as is. ``bf16`` autocasts matmuls and convolutions to bfloat16 while parameters,
gradients and the optimizer stay float32; bfloat16 keeps float32's exponent range, so no loss
scaling is needed. disttrain.parallel.mixed_precision provides the helper when it is present;
otherwise torch.autocast is used directly (the same thing on CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch


def autocast_factory(precision: str, device_type: str = "cpu"
                     ) -> Callable[[], AbstractContextManager[Any]]:
    """A zero-argument function returning a fresh autocast context for one forward pass."""
    if precision == "fp32":
        return nullcontext
    if precision != "bf16":
        raise ValueError(f"precision must be 'fp32' or 'bf16', got {precision!r}")
    try:
        from disttrain.parallel.mixed_precision import autocast
    except ImportError:  # an installation without the parallel package: same thing
        return lambda: torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    return lambda: autocast(device_type, "bf16")
