"""Ring attention: causal attention over a sequence split across the ranks of a ring, key and
value blocks passed from rank to rank (Liu et al. 2023, "Ring Attention with Blockwise
Transformers"; Megatron-Core's context parallelism).

Each rank keeps its queries. Its key/value block goes round the ring, one hop a step; while
a block travels to the next rank, this rank attends to the block it holds (the transfer is
posted before the compute and waited after it)::

    step s:   rank r holds KV of rank (r − s) mod cp        cp = 3
              posts  isend(KV → r + 1), irecv(KV ← r − 1)   r0 ── KV ──▶ r1 ── KV ──▶ r2
              attends its queries to the KV it holds        ▲                          │
              waits                                         └─────────── KV ───────────┘

The partial results are combined by the running log-sum-exp (the online softmax of
Milakov & Gimelshein 2018, as flash attention does it): a block that gives output o_i with
log-sum-exp l_i for a query updates the query's (o, l) to

    l' = log(e^l + e^l_i),   o' = o·e^(l − l') + o_i·e^(l_i − l')

Which queries meet which keys at each step is :func:`~.layout.ring_schedule` (the zig-zag
split keeps every step half a block on every rank). Nothing of size T × T is kept: a step
holds one block's scores, and backward recomputes them from the saved log-sum-exp.

Backward sends the key/value blocks round the ring again, and with each block the sum of
its gradients so far (dK, dV): the block of rank b collects its gradient on ranks b + 1,
b + 2, ... in turn and reaches rank b again after the last step, where b adds its own part::

    round s (before step s)   send KV_s → r + 1, and dKV of the block handled at s − 1
    final round               send dKV of the last block → r + 1 (that block's owner)

Bytes per rank per layer (B sequences, T tokens, cp ranks, hidden width H, e bytes): each
KV block is 2·B·(T/cp)·H·e; forward sends cp − 1 of them, backward cp − 1 blocks and cp − 1
gradient blocks: 3·(cp − 1)·2·B·(T/cp)·H·e (:mod:`.theory`).

NCCL's rules (docs/gpu.md): a pair's messages match in posting order, one at a time. With
cp ≥ 3 the pair (r, r + 1) carries messages one way only, posted in one order on both ends;
with cp = 2 both ranks are each other's neighbour, so in every round the lower rank posts
its sends first and the higher its receives first. The ring's first contacts would form a
cycle: :func:`~.api.apply_context_parallel` connects each rank to its two neighbours first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from disttrain.comm import Communicator
from disttrain.comm.work import Work
from disttrain.parallel.context.layout import RingStep, ring_schedule
from disttrain.parallel.mixed_precision import at_least_fp32

__all__ = ["ring_attention", "ring_neighbours"]

KV_TAG, DKV_TAG = 0, 1  # Gloo matches by tag; NCCL ignores tags (the posting order serves)


def ring_neighbours(comm: Communicator) -> list[int]:
    """The ranks this rank exchanges with in the ring: its left and right neighbours."""
    p, r = comm.world_size, comm.rank
    return sorted({(r - 1) % p, (r + 1) % p} - {r})


def _exchange(comm: Communicator, sends: Sequence[tuple[torch.Tensor, int]],
              recvs: Sequence[tuple[torch.Tensor, int]]) -> list[Work]:
    """Post ``sends`` (tensor, tag) to the right neighbour and ``recvs`` from the left one;
    sends first, unless both neighbours are one rank above this one (cp = 2, rank 1)."""
    p, r = comm.world_size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    post_sends = [lambda t=t, tag=tag: comm.isend(t, right, tag) for t, tag in sends]
    post_recvs = [lambda t=t, tag=tag: comm.irecv(t, left, tag) for t, tag in recvs]
    order = post_recvs + post_sends if left == right and r > right else post_sends + post_recvs
    return [post() for post in order]


def _wait(works: list[Work]) -> None:
    for work in works:
        work.wait()


def _rows(part: slice, chunk: int) -> slice:
    """A slice of chunks as a slice of positions."""
    return slice(part.start * chunk, part.stop * chunk)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:  # the diagonal block: positions increase along both axes alike
        above = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    return scores


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of attention: its output and each query's log-sum-exp over the block."""
    scores = _scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v), lse


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, o: torch.Tensor,
           l_block: torch.Tensor) -> None:
    """Fold one block's (o, l) into the running (out, lse) of queries ``rows``, in place."""
    old = lse[..., rows]
    new = torch.logaddexp(old, l_block)
    out[..., rows, :] = (out[..., rows, :] * torch.exp(old - new).unsqueeze(-1)
                         + o * torch.exp(l_block - new).unsqueeze(-1))
    lse[..., rows] = new


class _RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries to every rank's keys (module docstring)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                comm: Communicator) -> torch.Tensor:
        steps = ring_schedule(comm.rank, comm.world_size)
        chunk, scale = q.shape[-2] // 2, q.shape[-1] ** -0.5
        kv = torch.stack((k, v))  # one message per hop
        out = lse = None
        for s, step in enumerate(steps):
            works, arriving = [], None
            if s + 1 < len(steps):  # the next block travels while this one is used
                arriving = torch.empty_like(kv)
                works = _exchange(comm, [(kv, KV_TAG)], [(arriving, KV_TAG)])
            rows, keys = _rows(step.queries, chunk), _rows(step.keys, chunk)
            o, l_block = _attend(q[..., rows, :], kv[0][..., keys, :], kv[1][..., keys, :],
                                 step.causal, scale)
            if out is None or lse is None:  # step 0 covers every query
                out, lse = at_least_fp32(o), at_least_fp32(l_block)
            else:
                _merge(out, lse, rows, o, l_block)
            _wait(works)
            kv = arriving if arriving is not None else kv
        assert out is not None and lse is not None
        # laid out (B, T, heads, D) as the flash kernel lays its output: the caller's
        # (B, T, H) view of it is no copy, and the out projection keeps this very tensor
        result = out.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.comm, ctx.steps = comm, steps
        return result

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                         torch.Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        comm: Communicator = ctx.comm
        steps: list[RingStep] = ctx.steps
        chunk, scale = q.shape[-2] // 2, q.shape[-1] ** -0.5
        delta = (at_least_fp32(dout) * out).sum(-1)  # D_i = Σ_j dO_ij O_ij
        dq = torch.zeros_like(q, dtype=lse.dtype)
        kv = torch.stack((k, v))
        # gradients add up in at least fp32, and travel so (dKV messages: max(e, 4) bytes)
        own = torch.zeros_like(kv, dtype=lse.dtype)  # this rank's block, its own part
        carried: torch.Tensor | None = None  # dKV of the block handled last step
        for s, step in enumerate(steps):
            sends: list[tuple[torch.Tensor, int]] = []
            recvs: list[tuple[torch.Tensor, int]] = []
            arriving = collected = None
            if carried is not None:  # pass the last block's gradient on with the block
                collected = torch.empty_like(own)
                sends.append((carried, DKV_TAG))
                recvs.append((collected, DKV_TAG))
            if s + 1 < len(steps):
                arriving = torch.empty_like(kv)
                sends.append((kv, KV_TAG))
                recvs.append((arriving, KV_TAG))
            works = _exchange(comm, sends, recvs)
            rows, keys = _rows(step.queries, chunk), _rows(step.keys, chunk)
            dk, dv = _block_grads(q, kv, dout, lse, delta, dq, rows, keys, step.causal, scale)
            _wait(works)
            block = own if s == 0 else (collected if collected is not None else
                                        torch.zeros_like(own))
            block[0][..., keys, :] += dk
            block[1][..., keys, :] += dv
            carried = block if s > 0 else None
            kv = arriving if arriving is not None else kv
        if carried is not None:  # the last block's gradient goes home, ours comes home
            collected = torch.empty_like(own)
            _wait(_exchange(comm, [(carried, DKV_TAG)], [(collected, DKV_TAG)]))
            own += collected
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None


def _block_grads(q: torch.Tensor, kv: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                 delta: torch.Tensor, dq: torch.Tensor, rows: slice, keys: slice,
                 causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's backward (flash attention's): P from the saved log-sum-exp,
    dV = Pᵀ dO, dS = P ∘ (dO Vᵀ − D), dQ += dS K·scale (in place), dK = dSᵀ Q·scale."""
    qr, k, v, do = q[..., rows, :], kv[0][..., keys, :], kv[1][..., keys, :], dout[..., rows, :]
    p = torch.exp(_scores(qr, k, causal, scale) - lse[..., rows].unsqueeze(-1))
    dv = torch.matmul(p.transpose(-2, -1), do)
    ds = p * (torch.matmul(do, v.transpose(-2, -1)) - delta[..., rows].unsqueeze(-1))
    dq[..., rows, :] += torch.matmul(ds, k) * scale
    return torch.matmul(ds.transpose(-2, -1), qr) * scale, dv


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   comm: Communicator) -> torch.Tensor:
    """Causal attention of this rank's queries ``(B, heads, T/cp, D)`` (its two zig-zag
    chunks, :mod:`.layout`) to the keys and values of every rank of ``comm``; the output is
    shaped like ``q``. Collective over ``comm``, forward and backward."""
    if q.shape[-2] % 2:
        raise ValueError(f"ring attention holds two zig-zag chunks per rank, so the local "
                         f"sequence must be even; got {q.shape[-2]} tokens")
    out: torch.Tensor = _RingAttention.apply(q, k, v, comm)
    return out
