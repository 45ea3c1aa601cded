"""Argument checks run before any byte moves: each error names the argument and the fix."""

from __future__ import annotations

from typing import Any

import torch


def tensor_arg(name: str, tensor: Any, device_type: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} is not contiguous; pass {name}.contiguous() "
                         "(collectives write into the tensor's memory in place)")
    if tensor.device.type != device_type:
        raise ValueError(f"{name} is on {tensor.device}, but this communicator's transport "
                         f"moves {device_type} tensors; move it with .to('{device_type}')")
    if tensor.is_sparse:
        raise ValueError(f"{name} is sparse; pass a dense tensor")
    return tensor


def rank_arg(name: str, value: Any, world_size: int, *, self_rank: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int rank, got {value!r}")
    if not 0 <= value < world_size:
        raise ValueError(f"{name}={value} is out of range for a communicator of {world_size} "
                         f"rank(s); valid ranks are 0..{world_size - 1}")
    if self_rank is not None and value == self_rank:
        raise ValueError(f"{name}={value} is this rank itself; point-to-point needs another rank")
    return value


def same_dtype(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    if a.dtype != b.dtype:
        raise ValueError(f"{a_name} has dtype {a.dtype} but {b_name} has {b.dtype}; "
                         "they must match")


def numel_ratio(big_name: str, big: torch.Tensor, small_name: str, small: torch.Tensor,
                world_size: int) -> None:
    if big.numel() != world_size * small.numel():
        raise ValueError(
            f"{big_name} must hold world_size × {small_name}.numel() = {world_size} × "
            f"{small.numel()} = {world_size * small.numel()} elements, but has {big.numel()}")


def splits_arg(name: str, splits: list[int] | None, rows: int, world_size: int) -> list[int]:
    """Row counts per rank along dim 0 (equal when None)."""
    if splits is None:
        if rows % world_size:
            raise ValueError(f"dim 0 has {rows} rows, not divisible by world_size={world_size}; "
                             f"pass {name} explicitly for uneven splits")
        return [rows // world_size] * world_size
    splits = list(splits)
    if len(splits) != world_size or any((not isinstance(s, int)) or s < 0 for s in splits):
        raise ValueError(f"{name} must be {world_size} non-negative ints, got {splits!r}")
    if sum(splits) != rows:
        raise ValueError(f"{name} sums to {sum(splits)} rows but the tensor has {rows} rows "
                         "along dim 0")
    return splits
