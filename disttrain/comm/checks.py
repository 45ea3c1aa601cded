"""Argument checks run before any byte moves: each error names the argument and the fix."""

from __future__ import annotations

import math
from typing import Any

import torch

from disttrain.comm.ops import ReduceOp, parse_op

_OPS: dict[str, ReduceOp] = {o.value: o for o in ReduceOp}


def tensor_arg(name: str, tensor: Any, device_type: str) -> torch.Tensor:
    """``tensor`` itself, checked (dense, contiguous, on ``device_type``); errors say the fix.
    The common case costs a few attribute reads: this runs on every collective."""
    if (isinstance(tensor, torch.Tensor) and tensor.is_contiguous() and not tensor.is_sparse
            and (tensor.is_cpu if device_type == "cpu" else tensor.device.type == device_type)):
        return tensor
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


def reduce_op(op: Any) -> ReduceOp:
    """:func:`~disttrain.comm.ops.parse_op`, with the common spellings looked up first (an
    Enum call costs microseconds, and every all-reduce parses its op)."""
    return (_OPS.get(op) if isinstance(op, str) else None) or parse_op(op)


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-d view of a checked tensor that algorithms may write into in place (detached
    only when autograd tracks it: detaching costs a tensor object per call)."""
    t = tensor.detach() if tensor.requires_grad else tensor
    return t if t.dim() == 1 else t.view(-1)


def shape_arg(shape: Any) -> tuple[int, ...]:
    """``shape`` (an int or a sequence of ints ≥ 0) as a tuple; ValueError otherwise."""
    dims = (shape,) if isinstance(shape, int) else (
        tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (shape,))
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in dims):
        raise ValueError(f"shape must be ints ≥ 0, got {shape!r}")
    return dims


def p2p_args(kind: str, peer: Any, tag: Any, world_size: int, rank: int,
             max_tag: int) -> tuple[int, int]:
    """(peer, tag) of a ``kind`` ("send": peer is ``dst``, "recv": ``src``) message."""
    peer = rank_arg("dst" if kind == "send" else "src", peer, world_size, self_rank=rank)
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= max_tag:
        raise ValueError(f"tag must be an int in 0..{max_tag}, got {tag!r}")
    return peer, tag


def group_ranks(ranks: Any, world_size: int) -> list[int]:
    """The member list of ``new_group``: at least one rank, each valid and listed once."""
    ranks = list(ranks)
    if not ranks:
        raise ValueError("new_group needs at least one rank")
    for i, r in enumerate(ranks):
        rank_arg(f"ranks[{i}]", r, world_size)
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"new_group ranks contain duplicates: {ranks}; list each rank once")
    return ranks


def same_rows(output: torch.Tensor, tensor: torch.Tensor) -> None:
    if output.shape[1:] != tensor.shape[1:]:
        raise ValueError(f"output rows have shape {tuple(output.shape[1:])} but tensor rows "
                         f"have {tuple(tensor.shape[1:])}; they must match")


def root_buffer(name: str, value: Any, root: int, op: str) -> Any:
    """``value``, which the root of ``op`` must pass (others may pass None)."""
    if value is None:
        raise ValueError(f"{name} is required on the root (rank {root}) of {op}")
    return value


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


def blocks(out_name: str, out: torch.Tensor, in_name: str, tensor: torch.Tensor,
           out_blocks: int, in_blocks: int) -> None:
    """Same dtype, and ``out`` holds ``out_blocks`` (or ``tensor`` holds ``in_blocks``) times
    the other's elements; (0, 0): any sizes."""
    same_dtype(out_name, out, in_name, tensor)
    if out_blocks > 1:
        numel_ratio(out_name, out, in_name, tensor, out_blocks)
    elif in_blocks > 1:
        numel_ratio(in_name, tensor, out_name, out, in_blocks)


def all_to_all_rows(out: torch.Tensor, tensor: torch.Tensor, out_splits: list[int] | None,
                    in_splits: list[int] | None,
                    world_size: int) -> tuple[list[int], list[int], int]:
    """(output rows per rank, input rows per rank, elements per row) of an all_to_all."""
    same_rows(out, tensor)
    in_rows = splits_arg("input_split_sizes", in_splits,
                         tensor.shape[0] if tensor.dim() else 1, world_size)
    out_rows = splits_arg("output_split_sizes", out_splits,
                          out.shape[0] if out.dim() else 1, world_size)
    return out_rows, in_rows, row_elems(tensor)


def nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements."""
    return t.numel() * t.element_size()


def row_elems(t: torch.Tensor) -> int:
    """Elements per row along dim 0 (a 0-d tensor is one row of one element)."""
    return 1 if t.dim() == 0 else math.prod(t.shape[1:])


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
