"""What one pipeline message costs here, through disttrain's own stage links.

The simulation charges a message between two pipeline stages α + bytes · β of the
calibrated transport. On a host CPU a message also runs both stages' Python (the 128-byte
header packed and checked, the receive posted and waited for) and wakes a receiver that sat
idle while the other stages computed; its first computation after the wait runs on cold
caches. On this project's 2-vCPU host, model parallelism on shared memory paid 0.6-1 ms per
message where shared memory's α is 0.11 ms, about what Gloo's messages cost
(docs/benchmarks.md). :func:`stage_message` times it in ``ranks`` forked processes as model
parallelism runs them: one micro-batch down a chain of stages (each computes, then sends
its activation with :class:`~disttrain.parallel.pipeline.link.StageLink`) and its
gradient back up. Every stage computes ``work`` once each way, so the critical path is
2 · ranks computations and 2 (ranks − 1) messages; what the round takes beyond the
computations, timed alone beforehand, is charged to the messages. The simulation charges
each message at least this on this machine (:mod:`~disttrain.simulate.pipeline`).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from disttrain.simulate.contention import forked_ranks, probe_comm
from disttrain.simulate.overheads import median_time

log = logging.getLogger(__name__)
ROUNDS = 30
WARM_UP = 5
PAYLOAD_BYTES = 4096  # small enough that β · bytes is noise on any transport here


def _child(rank: int, ranks: int, store: str, results: Any, work: Callable[[], object],
           nbytes: int, transport: str) -> None:
    from disttrain.parallel.pipeline.link import TRAIN, Direction, StageLink

    act, grad = Direction.ACTIVATION, Direction.GRADIENT
    first, last = rank == 0, rank == ranks - 1
    try:
        with probe_comm(rank, ranks, store, transport) as comm:
            link = StageLink(comm, rank)
            payload = torch.zeros(max(1, nbytes // 4))
            rounds = []
            for call in range(ROUNDS + WARM_UP):
                link.begin(TRAIN, {act: int(not last), grad: int(not first)},
                           {act: int(not first), grad: int(not last)})
                start = time.perf_counter()
                if not first:
                    link.recv(act, call=call, mode=TRAIN, microbatch=0)
                work()  # forward
                if not last:
                    link.send(act, payload, call=call, mode=TRAIN, microbatch=0, rows=1)
                    link.recv(grad, call=call, mode=TRAIN, microbatch=0)
                work()  # backward
                if not first:
                    link.send(grad, payload, call=call, mode=TRAIN, microbatch=0, rows=1)
                link.flush()
                rounds.append(time.perf_counter() - start)
        # stage 0 starts first and finishes last: its round is the critical path
        results.put((rank, statistics.median(rounds[WARM_UP:])))
    except Exception as exc:  # reported to the parent, which falls back to 0
        results.put(f"{type(exc).__name__}: {exc}")


def stage_message(work: Callable[[], object], transport: str = "torch", ranks: int = 2,
                  nbytes: int = PAYLOAD_BYTES) -> float:
    """Seconds one message between pipeline stages adds to a model-parallel round of
    ``ranks`` stages on ``transport``, each stage running ``work`` before its activation and
    before its gradient: (round − 2 · ranks · work alone) / (2 (ranks − 1)), at least 0.
    0, logged, if the processes fail or fork is unavailable."""
    if ranks < 2:
        raise ValueError(f"a pipeline message needs ≥ 2 stages, got ranks={ranks}")
    alone = median_time(work)
    try:
        rounds = dict(forked_ranks(_child, ranks, work, nbytes, transport))
    except Exception as exc:
        log.warning("could not measure a pipeline message (%s); assuming its calibrated "
                    "α-β cost", exc)
        return 0.0
    return max(0.0, (rounds[0] - 2 * ranks * alone) / (2 * (ranks - 1)))
