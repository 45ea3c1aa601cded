"""Gloo's TCP I/O threads at ``SCHED_IDLE``, so that they never take a core from the thread
they wait for.

Gloo (torch.distributed's CPU backend) moves the bytes of every message on one I/O thread
per device, named ``gloo_tcp_loop``. It sleeps in ``epoll_wait`` until a socket is readable,
then takes that connection's mutex with ``try_lock``. A thread posting a send or a receive
holds the same mutex while it writes into the socket; if the I/O thread finds it taken, it
returns to ``epoll_wait``, which (level-triggered, the bytes are still unread) reports the
same socket at once: it spins until the mutex is free.

Where the I/O thread shares a core with the holder, that spin lasts a scheduler tick. The
holder is runnable but preempted (the I/O thread woke up on its core and took it); the
spinner never sleeps, so the holder gets the core back only when the scheduler next takes
it from the spinner, at the tick (4 ms at ``HZ=250``). Seen on this project's 2-core test
machine (``perf sched`` over a ZeRO-1 run on 2 Gloo ranks: the I/O threads spent 0.85 s of
a 1.8 s run in ``epoll_wait``, ranks' threads waited 3-4 ms for a core, each wait ending on
a tick), it made whole runs bimodal: ZeRO-1 on 2 ranks took 11.9 ms a step in most runs
and 5.1-8 ms in the others (docs/benchmarks.md, "Gloo's I/O thread").

``SCHED_IDLE`` removes the case: an idle-class thread never preempts a normal one, and a
normal thread that wakes preempts it at once. On a core with nothing else to run it runs as
soon as it wakes, as before. The price: while every core is busy with normal threads (all
of them computing), incoming bytes wait for a core to come free, so communication meant to
overlap computation on a fully busy machine waits for the computation instead.
``DISTTRAIN_GLOO_IO_THREADS`` chooses:

    idle     (default) SCHED_IDLE, as above
    batch    SCHED_BATCH: the I/O thread does not preempt on wake-up but keeps its fair
             share of a busy core; most of idle's gain on the test machine, no waiting
             for a free core
    normal   leave Gloo's threads as they are

The setting is per process and covers every Gloo group of the process (torch's own too);
it is applied whenever a disttrain transport is made, so threads of groups created since
are covered. Linux only: elsewhere (or without the right to change a thread's policy)
nothing changes.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

ENV = "DISTTRAIN_GLOO_IO_THREADS"
POLICIES = ("idle", "batch", "normal")
THREAD_NAME = "gloo_tcp_loop"  # the name Gloo gives its TCP device's event loop thread


def policy_from_env() -> str:
    """The policy ``DISTTRAIN_GLOO_IO_THREADS`` names (default ``idle``)."""
    value = os.environ.get(ENV, "idle").strip().lower() or "idle"
    if value not in POLICIES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r} is not a policy; set it to one of: "
                         f"{', '.join(POLICIES)} (or unset it for idle)")
    return value


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


def tune_io_threads(policy: str | None = None) -> list[int]:
    """Put this process's Gloo I/O threads under ``policy`` (default: from the environment);
    returns the ids of the threads changed. ``normal`` changes nothing."""
    policy = policy_from_env() if policy is None else policy
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is unknown; choose one of: {', '.join(POLICIES)}")
    target = getattr(os, "SCHED_IDLE" if policy == "idle" else "SCHED_BATCH", None)
    if policy == "normal" or target is None:
        return []
    changed = []
    for tid in io_threads():
        try:
            if os.sched_getscheduler(tid) != target:
                os.sched_setscheduler(tid, target, os.sched_param(0))
                changed.append(tid)
        except OSError as exc:  # gone meanwhile, or not allowed (a seccomp filter): harmless
            log.debug("left Gloo I/O thread %d as it was: %s", tid, exc)
    return changed


__all__ = ["ENV", "POLICIES", "io_threads", "policy_from_env", "tune_io_threads"]
