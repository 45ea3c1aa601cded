"""Interleaved 1F1B (Narayanan et al. 2021, *Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM*, §2.2.2) as pure data, with its own paper simulation.

Each of the p ranks holds v *chunks* (model pieces) instead of one stage: the model is cut
into p·v virtual stages and rank r holds virtual stages r, r + p, r + 2p, …, so a
micro-batch goes round the ranks v times. A chunk's forward and backward take 1/v of a
whole stage's, and the pipeline fills and drains in (p − 1) chunk-slots instead of (p − 1)
stage-slots, which divides the bubble by v:

    bubble = (p − 1) / (v·m + p − 1)

at the price of v times as many messages. The order is Megatron-LM's: the k-th forward of
a rank runs chunk ``(k // p) % v`` of micro-batch ``(k // (p·v))·p + k % p`` (groups of p
micro-batches go through chunk 0, then chunk 1, …), backwards visit the chunks in reverse,
and rank r runs ``2(p − r − 1) + (v − 1)·p`` warm-up forwards before alternating (all of
them when m = p). m must be a multiple of p.

The runtime does not execute this schedule yet: its messages wrap from the last rank back
to the first (virtual stage p − 1 feeds p), which the chain-shaped :class:`StageLink` does
not model. :func:`simulate_interleaved` checks it on paper: dependency order, no deadlock,
every (micro-batch, chunk) once, and the idle time of each rank.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkAction:
    """Forward (``"F"``) or backward (``"B"``) of one micro-batch through one chunk."""

    kind: str
    microbatch: int
    chunk: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}.{self.chunk}"


@dataclass(frozen=True)
class InterleavedSchedule:
    """Every rank's compute order; rank r's chunk c is virtual stage ``c·p + r``."""

    num_ranks: int
    num_chunks: int
    num_microbatches: int
    ranks: tuple[tuple[ChunkAction, ...], ...]

    def virtual_stage(self, rank: int, chunk: int) -> int:
        return chunk * self.num_ranks + rank

    def __str__(self) -> str:
        head = (f"interleaved 1f1b (p={self.num_ranks}, v={self.num_chunks}, "
                f"m={self.num_microbatches})")
        return "\n".join([head] + [f"rank {r}: " + " ".join(map(str, actions))
                                   for r, actions in enumerate(self.ranks)])


def interleaved_1f1b(num_ranks: int, num_chunks: int, num_microbatches: int
                     ) -> InterleavedSchedule:
    """Megatron-LM's interleaved 1F1B order for p ranks of v chunks and m micro-batches."""
    p, v, m = num_ranks, num_chunks, num_microbatches
    for name, value in (("num_ranks", p), ("num_chunks", v), ("num_microbatches", m)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer ≥ 1, got {value!r}")
    if m % p:
        raise ValueError(f"interleaved 1F1B sends micro-batches round the ranks in groups of "
                         f"p = {p}: use a multiple of {p} micro-batches, not {m}")
    return InterleavedSchedule(p, v, m, tuple(_rank_order(r, p, v, m) for r in range(p)))


def _rank_order(rank: int, p: int, v: int, m: int) -> tuple[ChunkAction, ...]:
    total = m * v

    def nth(kind: str, k: int) -> ChunkAction:
        chunk = (k // p) % v
        return ChunkAction(kind, (k // (p * v)) * p + k % p,
                           chunk if kind == "F" else v - 1 - chunk)

    warmup = total if m == p else min(2 * (p - rank - 1) + (v - 1) * p, total)
    order = [nth("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [nth("F", warmup + k), nth("B", k)]
    order += [nth("B", k) for k in range(total - warmup, total)]
    return tuple(order)


class InterleavedScheduleError(ValueError):
    """The schedule cannot run: a deadlock, or an action missing or repeated."""


@dataclass(frozen=True)
class InterleavedTimeline:
    """When each rank ran each action (start, end), and the step's length."""

    runs: tuple[tuple[tuple[ChunkAction, float, float], ...], ...]
    makespan: float

    def idle_fraction(self, rank: int) -> float:
        busy = sum(end - start for _, start, end in self.runs[rank])
        return 1.0 - busy / self.makespan


def simulate_interleaved(schedule: InterleavedSchedule, forward: float = 1.0,
                         backward: float = 1.0) -> InterleavedTimeline:
    """Run every rank's list in order with free messages: an action starts when its rank is
    free and its inputs exist (the forward on the previous virtual stage; the backward on
    the next one, or this chunk's own forward on the last virtual stage). A chunk takes
    ``forward / v`` and ``backward / v``. Raises on a deadlock (naming what each rank waits
    for) or a (micro-batch, chunk) run twice or never."""
    p, v, _m = schedule.num_ranks, schedule.num_chunks, schedule.num_microbatches
    _check_complete(schedule)
    last = p * v - 1
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro-batch, virtual stage) → end
    free, position = [0.0] * p, [0] * p
    runs: list[list[tuple[ChunkAction, float, float]]] = [[] for _ in range(p)]
    while any(position[r] < len(schedule.ranks[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while position[r] < len(schedule.ranks[r]):
                action = schedule.ranks[r][position[r]]
                ready = _ready(action, schedule.virtual_stage(r, action.chunk), last, done)
                if ready is None:
                    break
                length = (forward if action.kind == "F" else backward) / v
                start = max(free[r], ready)
                free[r] = start + length
                done[(action.kind, action.microbatch, schedule.virtual_stage(r, action.chunk))] = (
                    free[r])
                runs[r].append((action, start, free[r]))
                position[r] += 1
                progressed = True
        if not progressed:
            waiting = {r: str(schedule.ranks[r][position[r]]) for r in range(p)
                       if position[r] < len(schedule.ranks[r])}
            raise InterleavedScheduleError(f"deadlock: every rank waits (rank: next action) "
                                           f"{waiting}")
    return InterleavedTimeline(tuple(tuple(r) for r in runs), max(free))


def _ready(action: ChunkAction, stage: int, last: int,
           done: dict[tuple[str, int, int], float]) -> float | None:
    """When ``action``'s inputs exist on virtual ``stage`` (None: not yet)."""
    mb = action.microbatch
    if action.kind == "F":
        needs = [] if stage == 0 else [("F", mb, stage - 1)]
    else:
        needs = [("F", mb, stage)] + ([] if stage == last else [("B", mb, stage + 1)])
    times = [done.get(need) for need in needs]
    if any(t is None for t in times):
        return None
    return max((t for t in times if t is not None), default=0.0)


def _check_complete(schedule: InterleavedSchedule) -> None:
    expected = {(kind, mb, c) for kind in "FB" for mb in range(schedule.num_microbatches)
                for c in range(schedule.num_chunks)}
    for r, actions in enumerate(schedule.ranks):
        seen = [(a.kind, a.microbatch, a.chunk) for a in actions]
        if len(seen) != len(set(seen)) or set(seen) != expected:
            extra = sorted(set(seen) - expected)
            missing = sorted(expected - set(seen))
            raise InterleavedScheduleError(
                f"rank {r} must run every (micro-batch, chunk) forward and backward once: "
                f"{len(seen) - len(set(seen))} repeated, missing {missing[:4]}, unknown "
                f"{extra[:4]}")
