"""Desync detection: before a collective, ranks compare what they are about to do.

Opt-in (``CommConfig(debug_checks=True)``), like TORCH_DISTRIBUTED_DEBUG=DETAIL: every rank
shares (sequence number, operation, element count, dtype, reduce op, root) with every other
rank through a small naive all-gather; any difference raises, on every rank, an error that
names the ranks and what differed. It costs one extra small collective per call.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from disttrain.comm.algorithms import COLLECTIVES
from disttrain.comm.context import CollectiveContext
from disttrain.comm.ops import ReduceOp

_FIELDS = ("sequence number", "operation", "element count", "dtype", "reduce op", "root")


class CollectiveMismatchError(ValueError):
    """Ranks called different collectives, or the same one with different arguments."""


def signature_of(t: torch.Tensor, op: ReduceOp | None = None,
                 root: int = -1) -> tuple[int, ...]:
    """What every rank must agree on for a collective: size, dtype, reduce op, root."""
    op_code = -1 if op is None else _OP_CODES[op]
    return (t.numel(), _dtype_code(t.dtype), op_code, root)


def _dtype_code(dtype: torch.dtype) -> int:
    code = _DTYPE_CODES.get(dtype)
    if code is None:
        code = _DTYPE_CODES[dtype] = _crc(str(dtype))
    return code


def verify_signature(ctx: CollectiveContext, op: str, seq: int, signature: Sequence[int]) -> None:
    # a fixed width: ranks calling different collectives must still exchange equal sizes
    mine = [seq, _crc(op), *signature, *[-1] * (len(_FIELDS) - 2 - len(signature))]
    width = len(_FIELDS)
    p, me = ctx.world_size, ctx.rank
    device = ctx.transport.device_type  # NCCL moves CUDA tensors only
    table = torch.zeros(p, width, dtype=torch.int64, device=device)
    table[me] = torch.tensor(mine, dtype=torch.int64, device=device)
    # each pair in the order both agree on (NCCL runs a pair's messages in posting order)
    ctx.wait_all([q for r in range(p) if r != me for q in ctx.exchange(table[me], table[r], r)])
    rows = table.tolist()
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in range(p):
        groups.setdefault(tuple(rows[r]), []).append(r)
    if len(groups) == 1:
        return
    fields = sorted({_FIELDS[i] for i in range(width) if len({row[i] for row in rows}) > 1})
    detail = "; ".join(f"{_ranks(ranks)}: {_describe(list(row))}" for row, ranks in groups.items())
    raise CollectiveMismatchError(
        f"collective mismatch at {op} #{seq} on rank {me}: the ranks differ in "
        f"{', '.join(fields)} ({detail}). Every rank must call the same collectives in the "
        f"same order with the same sizes, dtypes, reduce op and root.")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _describe(row: list[int]) -> str:
    seq, op, numel, dtype, reduce_op, root = row
    text = f"{_OP_NAMES.get(op, 'op?')} #{seq}"
    if dtype in _DTYPE_NAMES:
        text += f", {numel} elements of {_DTYPE_NAMES[dtype]}"
    if reduce_op >= 0:
        text += f", op={list(ReduceOp)[reduce_op].value}"
    return text + (f", root={root}" if root >= 0 else "")


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


_OP_NAMES = {_crc(name): name for name in (*COLLECTIVES, "send", "recv")}
_OP_CODES = {o: i for i, o in enumerate(ReduceOp)}
_DTYPE_CODES: dict[torch.dtype, int] = {}
_DTYPE_NAMES = {_crc(str(d)): str(d).removeprefix("torch.")
                for d in vars(torch).values() if isinstance(d, torch.dtype)}
