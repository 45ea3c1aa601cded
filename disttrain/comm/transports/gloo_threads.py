"""Gloo's TCP I/O threads scheduled for what the process does: at ``SCHED_IDLE`` for
collectives, so that they never take a core from the thread they wait for.

Gloo (torch.distributed's CPU backend) moves the bytes of every message on one I/O thread
per device, named ``gloo_tcp_loop``. It sleeps in ``epoll_wait`` until a socket is readable,
then takes that connection's mutex with ``try_lock``. A thread posting a send or a receive
holds the same mutex while it writes into the socket; if the I/O thread finds it taken, it
returns to ``epoll_wait``, which (level-triggered, the bytes are still unread) reports the
same socket at once: it spins until the mutex is free.

Where the I/O thread shares a core with the holder, that spin lasts a scheduler tick, as
far as the traces show: the holder is runnable but preempted (the I/O thread woke up on its
core and took it), and the spinner never sleeps, so the holder gets the core back only at
the next tick (4 ms at ``HZ=250``). On this project's 2-core test machine (``perf`` over a
ZeRO-1 run on 2 Gloo ranks: each rank's I/O thread on a CPU for 0.85 s of the recording,
91 % of it in ``epoll_wait``; threads waiting 3-4 ms for a core, each wait ending on a
tick) it made whole runs bimodal: ZeRO-1 on 2 ranks took 11.9 ms a step in most runs and
5.1-8.2 ms in the others (docs/architecture.md, "Gloo's I/O threads").

``SCHED_IDLE`` removes the case: an idle-class thread never preempts a normal one, and a
normal thread that wakes preempts it at once. On a core with nothing else to run it runs as
soon as it wakes, as before. The price: while every core computes, incoming bytes wait for
a core to come free. That is what a collective wants, where every rank waits at the same
points anyway, and what a pipeline does not: a stage's send moves only once its I/O thread
has read the receiver's "ready" message, so with the thread idle the send waits for the
stage's next computation to end. Measured on the test machine (docs/architecture.md, "Gloo's
I/O threads"): a step of DDP or ZeRO on 2 and 4 Gloo ranks takes 25-60 % less time at
SCHED_IDLE, one of GPipe, 1F1B or model parallelism 10-50 % more; SCHED_BATCH (no
preemption on wake-up, a fair share of a busy core) lands close to idle on both.

So ``DISTTRAIN_GLOO_IO_THREADS`` chooses:

    auto     (default) by what the process does: SCHED_IDLE once a collective strategy
             says it runs (``Communicator.expect_workload("collectives")``: the strategy
             registry's ``workload`` field, applied as the loop builds the strategy, and
             the DDP and ZeRO engines, the collectives benchmark), normal once anything
             sends point-to-point (``Communicator.isend``/``irecv``: pipelines, parameter
             servers), for good: a process that does both keeps normal
    idle     SCHED_IDLE for every process
    batch    SCHED_BATCH for every process
    normal   SCHED_OTHER, as Gloo starts them

The setting is per process and covers every Gloo group of the process (torch's own too),
so this module, not a Communicator, owns what auto chose: the communicators of a process
share its threads. It is applied again whenever a disttrain transport is made, so the
threads of groups created since are covered. Linux only: elsewhere (or without the right
to change a thread's policy, such as leaving SCHED_IDLE without root) nothing changes.
"""

from __future__ import annotations

import logging
import os

from disttrain.comm.transport import check_workload

log = logging.getLogger(__name__)

ENV = "DISTTRAIN_GLOO_IO_THREADS"
POLICIES = ("auto", "idle", "batch", "normal")
THREAD_NAME = "gloo_tcp_loop"  # the name Gloo gives its TCP device's event loop thread


_SCHED = {"idle": "SCHED_IDLE", "batch": "SCHED_BATCH", "normal": "SCHED_OTHER"}
_chosen: str | None = None  # what auto chose for this process so far (None: nothing yet)


def policy_from_env() -> str:
    """The policy ``DISTTRAIN_GLOO_IO_THREADS`` names (default ``auto``)."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in POLICIES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r} is not a policy; set it to one of: "
                         f"{', '.join(POLICIES)} (or unset it for auto)")
    return value


def resolve(workload: str | None) -> str | None:
    """The policy for this process after it announced ``workload`` (None: nothing new, as
    when a transport is made); None while auto has nothing to go by."""
    global _chosen
    if workload is not None:
        check_workload(workload)
    policy = policy_from_env()
    if policy != "auto":
        return policy
    if workload == "p2p":
        _chosen = "normal"  # for good: a pipeline's sends need their I/O thread at once
    elif workload == "collectives" and _chosen is None:
        _chosen = "idle"
    return _chosen


def io_threads() -> list[int]:
    """Thread ids of this process's Gloo I/O threads (empty where /proc is missing)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    found = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == THREAD_NAME:
                    found.append(int(tid))
        except OSError:  # the thread ended while we looked
            continue
    return found


def tune_io_threads(workload: str | None = None) -> list[int]:
    """Put this process's Gloo I/O threads under the policy for ``workload`` (see
    :func:`resolve`); returns the ids of the threads changed."""
    policy = resolve(workload)
    target = None if policy is None else getattr(os, _SCHED[policy], None)
    if target is None:
        return []
    changed = []
    for tid in io_threads():
        try:
            if os.sched_getscheduler(tid) != target:
                os.sched_setscheduler(tid, target, os.sched_param(0))
                changed.append(tid)
        except OSError as exc:  # gone meanwhile, or not allowed: harmless, only slower
            log.debug("left Gloo I/O thread %d as it was: %s", tid, exc)
    return changed


__all__ = ["ENV", "POLICIES", "io_threads", "policy_from_env", "resolve",
           "tune_io_threads"]
