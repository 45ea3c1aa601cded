"""Reduce operations (sum, prod, min, max, avg) as names, torch equivalents and in-place kernels."""

from __future__ import annotations

from enum import Enum

import torch
import torch.distributed as dist


class ReduceOp(str, Enum):
    """The reductions every collective supports. ``avg`` is ``sum`` followed by ``/ world_size``."""

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"


def parse_op(op: str | ReduceOp) -> ReduceOp:
    """Accept ``"sum"``, ``ReduceOp.SUM`` or any case of the name; reject anything else clearly."""
    if isinstance(op, ReduceOp):
        return op
    try:
        return ReduceOp(str(op).lower())
    except ValueError:
        names = ", ".join(o.value for o in ReduceOp)
        raise ValueError(f"op={op!r} is not a reduce op; use one of: {names}") from None


def combine_(acc: torch.Tensor, other: torch.Tensor, op: ReduceOp) -> None:
    """acc ← acc ⊕ other, in place. ``avg`` combines as ``sum``; the caller divides once at
    the end."""
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        acc.add_(other)
    elif op is ReduceOp.PROD:
        acc.mul_(other)
    elif op is ReduceOp.MIN:
        torch.minimum(acc, other, out=acc)
    else:
        torch.maximum(acc, other, out=acc)


def finish_(tensor: torch.Tensor, op: ReduceOp, world_size: int) -> None:
    """Apply the final step of a reduction (the division of ``avg``)."""
    if op is ReduceOp.AVG and world_size > 1:
        tensor.div_(world_size)


def check_dtype(tensor: torch.Tensor, op: ReduceOp) -> None:
    """Reject combinations with no sensible meaning before any byte moves."""
    if op is ReduceOp.AVG and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(
            f"op='avg' needs a floating-point tensor, got {tensor.dtype}; "
            "use op='sum' and divide, or cast the tensor to a float dtype"
        )
    if tensor.dtype == torch.bool and op in (ReduceOp.SUM, ReduceOp.PROD):
        raise ValueError("op='sum'/'prod' on a bool tensor is ambiguous; "
                         "use 'max' (or) / 'min' (and)")


def to_torch(op: ReduceOp) -> dist.ReduceOp.RedOpType:
    """The torch.distributed reduce op for a disttrain op."""
    return {
        ReduceOp.SUM: dist.ReduceOp.SUM,
        ReduceOp.PROD: dist.ReduceOp.PRODUCT,
        ReduceOp.MIN: dist.ReduceOp.MIN,
        ReduceOp.MAX: dist.ReduceOp.MAX,
        ReduceOp.AVG: dist.ReduceOp.SUM,  # Gloo lacks AVG on older torch: sum, then divide
    }[op]
