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

from disttrain.comm.context import CollectiveContext

_FIELDS = ("sequence number", "operation", "element count", "dtype", "reduce op", "root")


class CollectiveMismatchError(ValueError):
    """Ranks called different collectives, or the same one with different arguments."""


def verify_signature(ctx: CollectiveContext, op: str, seq: int, signature: Sequence[int]) -> None:
    mine = [seq, zlib.crc32(op.encode()), *signature]
    width = len(mine)
    p, me = ctx.world_size, ctx.rank
    table = torch.zeros(p, width, dtype=torch.int64)
    table[me] = torch.tensor(mine, dtype=torch.int64)
    pending = [ctx.irecv(table[r], r) for r in range(p) if r != me]
    pending += [ctx.isend(table[me], r) for r in range(p) if r != me]
    ctx.wait_all(pending)
    rows = table.tolist()
    reference = rows[0]
    differing = [r for r in range(p) if rows[r] != reference]
    if not differing:
        return
    fields = sorted({_FIELDS[i] if i < len(_FIELDS) else f"field {i}"
                     for r in differing for i in range(width) if rows[r][i] != reference[i]})
    detail = "; ".join(f"rank {r}: {_describe(rows[r])}" for r in range(p))
    raise CollectiveMismatchError(
        f"collective mismatch at {op} #{seq} on rank {me}: ranks {differing} differ from rank 0 "
        f"in {', '.join(fields)}. Every rank must call the same collectives in the same order "
        f"with the same sizes and dtypes. Per rank: {detail}")


def _describe(row: list[int]) -> str:
    seq, _op, numel, _dtype, reduce_op, root = (row + [0] * 6)[:6]
    return f"#{seq} numel={numel} reduce_op={reduce_op} root={root}"
