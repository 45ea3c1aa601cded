"""The gradient-ready ordering DDP and ZeRO share: one launch order everywhere, one end of backward.

DDP (:mod:`~disttrain.parallel.ddp.reducer`) and ZeRO stages 2 and 3
(:mod:`~disttrain.parallel.zero.stage2`, :mod:`~disttrain.parallel.zero.stage3`) reduce
gradients *during* backward, from hooks that fire as autograd produces them, so that the
communication of the last layers' gradients runs while backward still computes the first
layers'. Two rules make that correct; this module holds both.

**Why one launch order on every rank.** Ranks do not name their collectives: the k-th
collective a rank calls on a communicator is paired with the k-th collective of every other
rank (Gloo and NCCL match by call order, and the Communicator runs collectives in call
order). But the order in which gradients become ready is *not* the same everywhere:
autograd may schedule independent branches differently, and a parameter may get a gradient
on some ranks only (a branch or a gate some ranks take). Launching each group of gradients
the moment it is complete would pair different groups across ranks: wrong sums when their
sizes match, a hang or a size error when they do not. So the groups are numbered (DDP's and
ZeRO-2's buckets, last layers first) and launched strictly in that order; a group complete
before its predecessors waits for them (:class:`InOrderLauncher`)::

    ready on rank 0:   b1  b0  b2          launched:  ─   b0 b1  b2
    ready on rank 1:   b0  b2  b1          launched:  b0  ─   b1 b2
                                                      same sequence on both: b0 b1 b2

Only the *order* is the same everywhere; the *moment* of a launch still depends on the
rank, which is harmless as long as the engine issues no other collective on that
communicator during backward. ZeRO-3 does (it all-gathers each unit before its backward), so
it launches a unit's reduction at a point of the autograd graph instead (the unit's inputs
have their gradient), a point every rank reaches at the same place in its sequence.

**How the end of backward is detected.** Parameters have hooks for "my gradient was
accumulated" but autograd has none for "backward is over". The engine running a backward
does take callbacks, run once after its last node (``queue_callback``, as torch DDP uses):
the first hook that fires in a backward queues one (:class:`EndOfBackward`). There, every
group not launched yet is launched, in order, with zeros for the gradients this rank never
received, so every rank issues exactly one reduction per group per backward whatever its
gradients were; DDP then waits for them, ZeRO leaves the waiting to ``step()``::

    forward ─▶ backward: hook(p) ─▶ first hook: queue end-of-backward callback
                         group complete ─▶ launch it and every complete successor, in order
                         ... communication runs while backward goes on ...
               last autograd node ─▶ callback: launch the rest in order (zeros for missing
                                     gradients) ─▶ start over for the next backward

DDP and ZeRO-2 use both classes; ZeRO-3 uses :class:`EndOfBackward` (its leftovers go in
reverse unit order). Both are small state machines, tested without processes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["EndOfBackward", "InOrderLauncher"]


class EndOfBackward:
    """Runs ``callback`` once at the end of each backward in which :meth:`arm` was called."""

    def __init__(self, callback: Callable[[], None]) -> None:
        self._callback = callback
        self.armed = False

    def arm(self) -> None:
        """Call from any hook that fires during backward; the first call queues the callback
        on the running backward (the autograd engine runs it after the last node)."""
        if not self.armed:
            self.armed = True
            torch.autograd.Variable._execution_engine.queue_callback(self._run)

    def _run(self) -> None:
        self.armed = False  # first: the next backward must arm again even if this raises
        self._callback()

    def reset(self) -> None:
        """Forget a callback that will never run (its backward raised)."""
        self.armed = False


class InOrderLauncher:
    """Launch items 0, 1, …, n−1 in that order as they become ready, within one backward.

    An item that is ready before its predecessors waits for them, so the order of launches
    is the same on every rank even if readiness is observed in different orders.
    :meth:`finish` (at the end of backward) launches whatever is left, still in order, and
    starts over for the next backward: every item is launched exactly once per backward.
    """

    def __init__(self, count: int, launch: Callable[[int], None]) -> None:
        self._ready = [False] * count
        self._launch = launch
        self.next = 0  # items < next were launched in this backward

    def launched(self, index: int) -> bool:
        return index < self.next

    @property
    def all_launched(self) -> bool:
        return self.next == len(self._ready)

    def mark_ready(self, index: int) -> None:
        """``index`` is complete: launch it now if every item before it was launched, then
        any complete successors; otherwise it waits for its predecessors."""
        self._ready[index] = True
        while self.next < len(self._ready) and self._ready[self.next]:
            self.next += 1  # first: a launch that raises must not be retried
            self._launch(self.next - 1)

    def finish(self) -> None:
        """Launch every item not launched yet, in order; then start over."""
        while self.next < len(self._ready):
            self.next += 1
            self._launch(self.next - 1)
        self.reset()

    def reset(self) -> None:
        self._ready = [False] * len(self._ready)
        self.next = 0


def all_reduce_flat_gradients(params: list[torch.nn.Parameter], comm: Any, op: str = "sum",
                              algorithm: str | None = None) -> None:
    """Reduce the gradients of ``params`` (one dtype) over ``comm`` in one flat all-reduce,
    in place; a parameter without a gradient on this rank contributes zeros and receives the
    result. Every rank passes the same parameters in the same order."""
    if not params:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in params])
    comm.all_reduce(flat, op, algorithm=algorithm)
    offset = 0
    for p in params:
        reduced = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
        if p.grad is None:
            p.grad = reduced.clone()
        else:
            p.grad.copy_(reduced)
