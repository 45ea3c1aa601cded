"""Backward-pass plumbing shared by stages 2 and 3: rank-independent reduction order.

The communicator pairs collectives across ranks by call order, so during backward every
rank must issue the same reductions in the same order, even when a parameter gets a
gradient on some ranks only (a branch or gate used by some ranks). Two rules give that:

* which gradients a rank has never changes its sequence of collectives, and a missing
  gradient counts as zeros. Stage 2 launches buckets in a fixed order (one complete early
  waits for its predecessors): the *moment* of a launch depends on the rank, which is
  harmless because stage 2 issues no other collective during backward. Stage 3 also
  all-gathers during backward, so a reduction's moment must be rank-independent too: it
  launches a unit at a point of the autograd graph (its inputs' gradient is complete);
* one callback runs at the end of every backward (queued on autograd's engine by the
  first hook that fires, as torch DDP does) and launches, in a fixed order, every group
  not launched yet, so every rank issues one reduction per group per backward::

      backward ─▶ hooks: launch in order what is ready ─▶ end of backward (callback):
                  launch the rest in order, zeros for missing gradients ─▶ reset
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

from disttrain.comm import Communicator, Work
from disttrain.parallel.zero.sharding import ShardLayout


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

    def mark_ready(self, index: int) -> None:
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


def stage_grads(params: Sequence[nn.Parameter], layout: ShardLayout, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """A padded flat buffer (``layout``) of the parameters' gradients in ``dtype``, zeros where
    a parameter has none (it got no gradient on this rank); the ``.grad`` are dropped.

    Slices are flat, not parameter-shaped: a stage-3 unit that forward never called still
    has its 0-element placeholders as parameters when the end of backward stages it."""
    staging = torch.empty(layout.padded_total, dtype=dtype, device=device)
    staging[layout.total:].zero_()  # padding contributes zeros
    with torch.no_grad():
        for p, start, numel in zip(params, layout.offsets(), layout.numels):
            view = staging[start:start + numel]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
                p.grad = None
    return staging


class Reduced(Protocol):
    """A bucket or unit: what its reductions add up into."""

    grad_shard: torch.Tensor | None


class Reductions:
    """Gradient reduce-scatters in flight, oldest first; at most ``limit`` staging buffers
    alive (the oldest is waited for before another starts), and each result added to its
    group's ``grad_shard`` (micro-batches accumulate there)."""

    def __init__(self, comm: Communicator, algorithm: str | None, limit: int) -> None:
        self.comm, self.algorithm, self.limit = comm, algorithm, limit
        self.pending: list[tuple[Reduced, Work | None, torch.Tensor, torch.Tensor]] = []
        self.peak_staging_bytes = 0  # largest sum of staging buffers alive at once

    def start(self, group: Reduced, staging: torch.Tensor, shard_size: int) -> None:
        """Reduce-scatter (average) ``staging`` asynchronously into ``group``'s shard."""
        out = staging.new_empty(shard_size)
        work = self.comm.reduce_scatter(out, staging, "avg", algorithm=self.algorithm,
                                        async_op=True)
        self.pending.append((group, work, out, staging))
        self.peak_staging_bytes = max(self.peak_staging_bytes, sum(
            item[3].numel() * item[3].element_size() for item in self.pending))
        while len(self.pending) >= self.limit or (
                self.pending and _done(self.pending[0][1])):
            self._accumulate(self.pending.pop(0))

    def finish(self) -> None:
        """Wait for every reduction and add it to its group's gradient shard."""
        while self.pending:
            self._accumulate(self.pending.pop(0))

    def discard(self) -> None:
        """Wait for every reduction (their buffers must outlive them) and drop the results."""
        for _group, work, _out, _staging in self.pending:
            if work is not None:
                work.wait()
        self.pending.clear()

    @staticmethod
    def _accumulate(item: tuple[Reduced, Work | None, torch.Tensor, torch.Tensor]) -> None:
        group, work, out, _staging = item
        if work is not None:
            work.wait()
        group.grad_shard = out if group.grad_shard is None else group.grad_shard.add_(out)


def _done(work: Work | None) -> bool:
    return work is None or work.is_completed()
