"""The autocast context a training step runs its forward pass in, by precision name.

``fp32`` runs as is. ``bf16`` and ``fp16`` autocast matmuls and convolutions to that 16-bit
dtype while parameters, gradients and the optimizer stay float32. bfloat16 keeps float32's
exponent range, so no loss scaling is needed; float16 does not, and the training loop scales
the loss for it (:class:`~disttrain.parallel.mixed_precision.LossScaler`, every rank
agreeing which steps to skip). disttrain.parallel.mixed_precision provides the helper when it
is present; otherwise torch.autocast is used directly (the same thing).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_factory(precision: str, device_type: str = "cpu"
                     ) -> Callable[[], AbstractContextManager[Any]]:
    """A zero-argument function returning a fresh autocast context for one forward pass on
    ``device_type`` (``cpu`` or ``cuda``)."""
    if precision == "fp32":
        return nullcontext
    if precision not in _DTYPES:
        raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp16', got {precision!r}")
    try:
        from disttrain.parallel.mixed_precision import autocast
    except ImportError:  # an installation without the parallel package: same thing
        dtype = _DTYPES[precision]
        return lambda: torch.autocast(device_type=device_type, dtype=dtype)
    return lambda: autocast(device_type, precision)
