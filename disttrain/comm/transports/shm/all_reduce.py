"""``shm`` all-reduce: one-shot for small tensors, reduce-scatter + all-gather for large.

::

    one-shot (≤ one_shot_max_bytes)       reduce-scatter + all-gather (larger), per round:
    r: copy x → slot[r]                   r: copy chunk (all but seg_r) → slot[r]
    ── barrier ──                         ── barrier ──
    r: x = slot[0] ⊕ … ⊕ slot[p−1]        r: acc = x0[seg_r] ⊕ … ⊕ x(p−1)[seg_r]
       (every rank, identical order)         published in slot[r][seg_r]
                                          ── barrier ──
                                          r: copy slot[i][seg_i] → chunk[seg_i], i ≠ r

The one-shot path is what small all-reduces (most of data-parallel training of small and
medium models) cost, so it does the least: slot views cut to this size are cached by the
area, one copy in, one barrier, p−1 kernel calls straight into the user's tensor, one
counter update. Large rounds are bound by memory traffic: two-operand in-place kernels
(``acc ⊕= part``) move a third less than three-operand ones, so ranks 0 and 1 accumulate
in their own segment of ``x`` (rank 1 starts from ``x1 ⊕ x0``, the same bits as ``x0 ⊕ x1``
for +, ×) and copy the result into the slot; ranks ≥ 2 accumulate in their slot, which they
then copy back. Either way rank order is kept, so results equal ``((x0 ⊕ x1) ⊕ x2) …``.

A large tensor that lives in a shared buffer (``Communicator.shared_zeros``) needs no slots:
every rank reads the others' copies where they lie (:func:`_in_place`), which saves the copy
in and the copy that publishes each reduced segment. Before the first step every rank
declares which path it takes, on which buffer and slice, and after it checks that all
declared the same (a mismatch raises ValueError on every rank).
"""

from __future__ import annotations

import torch

from disttrain.comm.algorithms.chunking import segment_bounds, sub_chunks
from disttrain.comm.context import CollectiveContext
from disttrain.comm.ops import ReduceOp
from disttrain.comm.transports.shm.collectives import (
    COMMUTATIVE,
    KERNELS,
    area_of,
    count,
    per_round,
    reduce_into,
    step,
)
from disttrain.comm.transports.shm.sync import CollectiveArea


def all_reduce(ctx: CollectiveContext, tensor: torch.Tensor, op: ReduceOp) -> None:
    area = area_of(ctx)
    if ctx.world_size == 1 or tensor.numel() == 0:
        return
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes <= area.one_shot_max_bytes:
        _one_shot(ctx, area, tensor, op)
        return
    shared = ctx.transport.buffers.find(tensor)  # type: ignore[attr-defined]
    what = _what(nbytes, tensor.dtype, op)
    intent = (0, 0, what) if shared is None else (shared[0].index + 1, shared[1], what)
    area.declare(intent)  # checked after the first step: every rank must take the same path
    if shared is not None:
        buffer, offset = shared
        _in_place(ctx, area, buffer.views(offset, nbytes, tensor.dtype), intent, op)
        return
    for k, (a, b) in enumerate(sub_chunks(0, tensor.numel(), per_round(area, tensor))):
        _two_phase(ctx, area, tensor[a:b], op, intent if k == 0 else None)


def _one_shot(ctx: CollectiveContext, area: CollectiveArea, x: torch.Tensor,
              op: ReduceOp) -> None:
    n, p = x.numel(), ctx.world_size
    slots = area.heads(area.begin_round(), x.dtype, n)
    slots[ctx.rank].copy_(x)
    step(ctx, area)
    reduce_into(x, slots, op)
    nbytes = n * x.element_size()
    ctx.stats.count(ctx.op, nbytes, (p - 1) * nbytes)


def _two_phase(ctx: CollectiveContext, area: CollectiveArea, chunk: torch.Tensor,
               op: ReduceOp, intent: tuple[int, int, int] | None) -> None:
    """One round of reduce-scatter + all-gather over ``chunk`` (≤ one slot). Rank r never
    needs its own segment in shared memory as an input, so it copies in only the others'."""
    p, me, m = ctx.world_size, ctx.rank, chunk.numel()
    slots = area.slots(area.begin_round(), chunk.dtype)
    bounds = segment_bounds(m, p)
    s0, s1 = bounds[me]
    slots[me][:s0].copy_(chunk[:s0])
    slots[me][s1:m].copy_(chunk[s1:])
    step(ctx, area)
    if intent is not None:
        _agree(ctx, area, intent)
    in_place = s1 > s0 and _accumulate(chunk[s0:s1], slots, s0, s1, me, op)
    if in_place:
        slots[me][s0:s1].copy_(chunk[s0:s1])  # publish the reduced segment
    step(ctx, area)
    for r in range(p):
        r0, r1 = bounds[r]
        if r1 > r0 and (r != me or not in_place):
            chunk[r0:r1].copy_(slots[r][r0:r1])
    es = chunk.element_size()
    count(ctx, m * es, ((p - 1) * (s1 - s0) + m - (s1 - s0)) * es)


def _accumulate(mine: torch.Tensor, slots: list[torch.Tensor], s0: int, s1: int, me: int,
                op: ReduceOp) -> bool:
    """Reduce segment [s0, s1) of every rank in rank order. True: the result is in ``mine``
    (this rank's own segment of the tensor); False: it is in ``slots[me][s0:s1]``."""
    kernel, p = KERNELS[op], len(slots)
    if me == 0 or (me == 1 and op in COMMUTATIVE):
        first = 1 if me == 0 else 0  # rank 1: x1 ⊕ x0, bit-equal to x0 ⊕ x1
        kernel(mine, slots[first][s0:s1], out=mine)
        for r in range(2, p):
            kernel(mine, slots[r][s0:s1], out=mine)
        return True
    parts = [mine if r == me else slots[r][s0:s1] for r in range(p)]
    reduce_into(slots[me][s0:s1], parts, op)
    return False


def _in_place(ctx: CollectiveContext, area: CollectiveArea, regions: list[torch.Tensor],
              intent: tuple[int, int, int], op: ReduceOp) -> None:
    """All-reduce of a tensor in a shared buffer: ``regions[r]`` is rank r's copy of it.

    Rank r reduces segment r of every region in rank order, in place into rank 0's region
    (rank 1, for commutative ops, into its own: x1 ⊕ x0 has the bits of x0 ⊕ x1); only rank
    r touches segment r of any region until the second step. Then every rank copies the
    reduced segments it does not already hold. The third step keeps a rank from writing its
    region (the next backward) while a slower rank still copies out of it::

        ── step (inputs in place; intents agree) ──
        r: R_dst[seg_r] = R0[seg_r] ⊕ R1[seg_r] ⊕ … ⊕ R(p−1)[seg_r]
        ── step ──
        r: R_r[seg_i] = R_dst(i)[seg_i] for every i whose result is elsewhere
        ── step ──
    """
    p, me, n = ctx.world_size, ctx.rank, regions[0].numel()
    area.begin_round()  # a round without slots: keeps every rank's round count equal
    step(ctx, area)
    _agree(ctx, area, intent)
    swap = op in COMMUTATIVE  # segment 1's result stays in rank 1's region

    def home(r: int) -> torch.Tensor:
        return regions[1] if r == 1 and swap else regions[0]

    bounds = segment_bounds(n, p)
    s0, s1 = bounds[me]
    if s1 > s0:
        dst, kernel = home(me), KERNELS[op]
        other = regions[0] if dst is regions[1] else regions[1]
        kernel(dst[s0:s1], other[s0:s1], out=dst[s0:s1])
        for r in range(2, p):
            kernel(dst[s0:s1], regions[r][s0:s1], out=dst[s0:s1])
    step(ctx, area)
    mine = regions[me]
    for r, (r0, r1) in enumerate(bounds):
        if r1 > r0 and home(r) is not mine:
            mine[r0:r1].copy_(home(r)[r0:r1])
    step(ctx, area)
    es = mine.element_size()
    count(ctx, n * es, ((p - 1) * (s1 - s0) + n - (s1 - s0)) * es)


_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool)
_OPS = tuple(ReduceOp)


def _what(nbytes: int, dtype: torch.dtype, op: ReduceOp) -> int:
    """Bytes, dtype and op in one 48-bit word of the intent: bits 0-37, 38-43, 44-47."""
    code = _DTYPES.index(dtype) if dtype in _DTYPES else 63
    return nbytes % (1 << 38) | code << 38 | _OPS.index(op) << 44


def _describe(what: int) -> str:
    code, op = what >> 38 & 63, _OPS[what >> 44 & 15]
    dtype = str(_DTYPES[code]).removeprefix("torch.") if code < len(_DTYPES) else "other"
    return f"{what % (1 << 38)} bytes of {dtype}, {op.value}"


def _agree(ctx: CollectiveContext, area: CollectiveArea, intent: tuple[int, int, int]) -> None:
    """Raise on every rank unless all declared the same intent: a rank passing an ordinary
    tensor while another passes a shared one (or another size, dtype or op) would otherwise
    read garbage or hang. Every rank has taken the same steps and rounds by then, so the
    communicator stays usable."""
    intents = area.intents()
    if all(i == intent for i in intents):
        return

    def said(i: tuple[int, int, int] | None) -> str:
        if i is None:
            return "no large all_reduce"
        return (f"an ordinary tensor, {_describe(i[2])}" if i[0] == 0 else
                f"shared buffer #{i[0] - 1} at byte {i[1]}, {_describe(i[2])}")

    listing = "; ".join(f"rank {r}: {said(i)}" for r, i in enumerate(intents))
    raise ValueError(
        f"{ctx.op} #{ctx.seq} (shm) on rank {ctx.rank}: the ranks passed different tensors "
        f"or ops ({listing}). Pass the same size, dtype and op on every rank, and either "
        f"tensors from Communicator.shared_zeros (allocated in the same order on every rank, "
        f"the same slice on every rank) or ordinary tensors, on every rank alike")
