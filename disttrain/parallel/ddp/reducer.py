"""The gradient reducer: per-parameter hooks that fill buckets and all-reduce them during backward.

One synced backward, on every rank::

    forward ── arm() ──▶ backward: AccumulateGrad(p) ─▶ hook(p): copy grad into its bucket view
                                                          bucket full? launch in index order
                                                          ─▶ compressor.start(bucket)  (async)
                         ... the all-reduce of bucket 0 runs on the comm thread while
                             backward computes the gradients of bucket 1, 2, ...
                         end of backward (queued callback) ─▶ finalize():
                             unused parameters: error, or zero-fill + launch
                             wait for every bucket, in order ─▶ .grad = the mean over ranks

Buckets are launched strictly in bucket-index order (bucket i only after buckets < i), and
the end of backward is a callback queued by the first hook: both come from
:mod:`disttrain.parallel.backward`, which says why every rank must issue its collectives in
one order even when hooks fire in a rank-dependent order. After the first synced backward each
``param.grad`` *is* a view into its bucket, so later steps accumulate in place and need no
copy (unless the optimizer's ``zero_grad`` sets grads to ``None``, the torch default: then
the first hook of each step copies the fresh gradient into the bucket and re-points
``.grad``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from disttrain.comm import Communicator
from disttrain.comm.transports import ShmUnavailableError
from disttrain.comm.work import CompletedWork
from disttrain.parallel.backward import EndOfBackward, InOrderLauncher
from disttrain.parallel.ddp.buckets import Bucket, Zeros, build_buckets, plain_zeros
from disttrain.parallel.ddp.compression import Compressor, NoCompression, PendingReduction

log = logging.getLogger(__name__)


class UnusedParametersError(RuntimeError):
    """A synced backward left parameters without a gradient (``find_unused_parameters=False``)."""


@dataclass
class SyncTiming:
    """Wall-clock times (``time.time()``) of the last synced backward, for overlap reports."""

    armed_at: float = 0.0
    launched_at: list[float] = field(default_factory=list)  # per bucket, in launch order
    backward_end: float = 0.0  # the end-of-backward callback started
    synced_at: float = 0.0  # every bucket reduced: grads are final

    @property
    def exposed_s(self) -> float:
        """Communication time *not* hidden behind backward: waited for after it ended."""
        return max(0.0, self.synced_at - self.backward_end)


@dataclass(frozen=True)
class OverlapReport:
    """Communication of one synced backward: busy time, the part waited for, the part hidden."""

    comm_s: float  # time the communicator spent on this step's collectives
    exposed_s: float  # time spent waiting for them after backward ended
    hidden_fraction: float  # 1 − exposed / comm, in [0, 1]


def overlap_report(timing: SyncTiming, records: Iterable[dict[str, Any]]) -> OverlapReport:
    """Overlap of the step described by ``timing``, from flight-recorder ``records`` (dicts
    with queued_at/started_at/ended_at): collectives queued between arming and the end of
    the sync run one after another on the comm thread, so their busy times add up."""
    comm_s = 0.0
    for r in records:
        if (timing.armed_at <= r["queued_at"] <= timing.synced_at and r.get("started_at")
                and r.get("ended_at")):
            comm_s += r["ended_at"] - r["started_at"]
    exposed = timing.exposed_s
    hidden = 1.0 - min(exposed, comm_s) / comm_s if comm_s > 0 else 0.0
    return OverlapReport(comm_s, exposed, hidden)


class GradReducer:
    """Averages the gradients of ``params`` over ``comm`` in buckets, overlapping backward."""

    def __init__(self, named_params: Sequence[tuple[str, torch.nn.Parameter]],
                 comm: Communicator, compressor: Compressor, *, first_bucket_bytes: int,
                 bucket_bytes: int, find_unused_parameters: bool,
                 algorithm: str | None) -> None:
        self.names = [name for name, _ in named_params]
        self.params = [p for _, p in named_params]
        self.comm, self.compressor, self.algorithm = comm, compressor, algorithm
        self.find_unused_parameters = find_unused_parameters
        in_place = type(compressor) is NoCompression and algorithm in (None, "auto", "shm")
        self.buckets: list[Bucket] = build_buckets(
            self.params, first_bucket_bytes, bucket_bytes,
            _shared_zeros(comm) if in_place else plain_zeros)
        self._slots: list[tuple[int, torch.Tensor]] = [(0, self.params[0])] * len(self.params)
        for bucket in self.buckets:
            for i, view in zip(bucket.param_indices, bucket.views):
                self._slots[i] = (bucket.index, view)
        self._sizes = [len(b.param_indices) for b in self.buckets]
        self._armed = False
        self._ready = bytearray(len(self.params))
        self._remaining = list(self._sizes)
        self._launcher = InOrderLauncher(len(self.buckets), self._launch)
        self._end = EndOfBackward(self._finalize)
        self._pending: list[PendingReduction] = []
        self.timing = SyncTiming()
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook_for(i))
                       for i, p in enumerate(self.params)]

    # ------------------------------------------------------------------ per step
    def arm(self) -> None:
        """Expect one synced backward: called by the forward pass outside ``no_sync``."""
        self._ready = bytearray(len(self.params))
        self._remaining = list(self._sizes)
        self._launcher.reset()
        self._end.reset()
        self._pending = []
        self._armed = True
        self.timing = SyncTiming(armed_at=time.time())

    def disarm(self) -> None:
        self._armed = False

    @property
    def launched(self) -> int:
        """How many buckets of the current (or last) backward have been launched."""
        return len(self.timing.launched_at)

    def _hook_for(self, index: int):  # type: ignore[no-untyped-def]
        def hook(param: torch.Tensor) -> None:
            if self._armed:
                self._mark_ready(index, param)
        return hook

    def _mark_ready(self, index: int, param: torch.Tensor) -> None:
        self._end.arm()
        if self._ready[index]:
            raise RuntimeError(
                f"DataParallel: parameter {self.names[index]!r} received a gradient twice in "
                f"one backward (reentrant activation checkpointing, or two backward passes "
                f"after one forward); use checkpoint(..., use_reentrant=False) or one "
                f"backward per forward")
        self._ready[index] = 1
        bucket_index, view = self._slots[index]
        grad = param.grad
        if grad is not view:  # a fresh gradient tensor (grads were None): move it in
            assert grad is not None
            view.copy_(grad)
            param.grad = view
        self._remaining[bucket_index] -= 1
        if self._remaining[bucket_index] == 0:
            self._launcher.mark_ready(bucket_index)  # launched once the ones before it are

    def _launch(self, index: int) -> None:
        self._pending.append(self._start(self.buckets[index]))
        self.timing.launched_at.append(time.time())

    def _start(self, bucket: Bucket) -> PendingReduction:
        """Launch one bucket. The last one of a plain (uncompressed) all-reduce is a
        synchronous call: backward has nothing left to overlap it with, and when the
        progress thread is idle (always with one bucket) it runs right here, saving the two
        thread wake-ups of a hand-off (tens of µs, more than a small all-reduce in shared
        memory); otherwise the Communicator queues it behind the earlier buckets and waits."""
        if bucket.index == len(self.buckets) - 1 and type(self.compressor) is NoCompression:
            self.comm.all_reduce(bucket.flat, "avg", algorithm=self.algorithm)
            return CompletedWork()
        return self.compressor.start(bucket, self.comm, self.algorithm)

    # ------------------------------------------------------------------ end of backward
    def _finalize(self) -> None:
        """Runs once at the end of a synced backward (autograd's queued callback)."""
        self._armed = False
        self.timing.backward_end = time.time()
        all_launched = self._launcher.all_launched  # then every parameter was ready
        unused = [] if all_launched else [i for i, ok in enumerate(self._ready) if not ok]
        had_no_grad = [i for i in unused if self.params[i].grad is None]
        for i in unused:  # zero-fill so the buckets complete and every rank issues the same
            self._fill_unused(i)
        self._launcher.finish()  # every bucket is complete now: launch the rest, in order
        used_map = self._launch_used_map(had_no_grad) if self.find_unused_parameters else None
        for pending in self._pending:
            pending.wait()
        if used_map is not None:
            for i in had_no_grad:  # no rank computed a gradient: leave .grad as None (torch DDP)
                if used_map[i] == 0:
                    self.params[i].grad = None
        self.timing.synced_at = time.time()
        if unused and not self.find_unused_parameters:
            raise UnusedParametersError(self._unused_message(unused))

    def _fill_unused(self, index: int) -> None:
        param = self.params[index]
        bucket_index, view = self._slots[index]
        if param.grad is None:
            view.zero_()
        elif param.grad is not view:
            view.copy_(param.grad)
        param.grad = view
        self._ready[index] = 1
        self._remaining[bucket_index] -= 1

    def _launch_used_map(self, had_no_grad: list[int]) -> torch.Tensor:
        """1 for every parameter this rank has a gradient for; max over ranks (waited below,
        after the buckets: it is queued behind them, in the same order on every rank)."""
        used = torch.ones(len(self.params), dtype=torch.float32)
        used[had_no_grad] = 0
        work = self.comm.all_reduce(used, "max", async_op=True)
        assert work is not None
        self._pending.append(work)
        return used

    def _unused_message(self, unused: list[int]) -> str:
        names = [self.names[i] for i in unused]
        shown = ", ".join(repr(n) for n in names[:10]) + (" ..." if len(names) > 10 else "")
        return (f"DataParallel: {len(names)} parameter(s) received no gradient in this backward "
                f"on rank {self.comm.rank}: {shown}. Every parameter that requires grad must "
                f"take part in computing the loss on every step. If some are unused on purpose "
                f"(or only on some steps or ranks), pass find_unused_parameters=True to "
                f"DataParallel (costs one small all-reduce per step), or freeze them with "
                f"param.requires_grad_(False) before wrapping the model")

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def _shared_zeros(comm: Communicator) -> Zeros:
    """Buckets in shared memory where the transport all-reduces them in place (``shm``, for
    buckets above its one-shot size): autograd then accumulates gradients straight into
    memory the other ranks read, and the all-reduce skips its copy in
    (docs/shm_transport.md). Elsewhere, or when /dev/shm is full: ordinary buffers."""
    failed = False

    def zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        nonlocal failed  # every rank fails alike (the rendezvous agrees), so they stay in step
        if device.type == "cpu" and not failed:
            try:
                return comm.shared_zeros(numel, dtype, only_if_useful=True)
            except ShmUnavailableError as exc:
                failed = True
                log.warning("gradient buckets stay in private memory: %s", exc)
        return plain_zeros(numel, dtype, device)

    return zeros
