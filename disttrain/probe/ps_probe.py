"""What one parameter-server pull and push cost here, through disttrain's own server.

A worker's pull is three messages and its push four (the protocol), but on a host CPU each
also runs the worker's and the server's Python: the event loop, the watcher threads that
wait for messages, decoding and checking the header, adding the gradient, replying.
Measured on this project's 2-vCPU host with one worker and one server, a pull of LeNet's
125 KB took 1.6-2.2 ms and a push 2.5-3.8 ms on either transport (Gloo point-to-point or
shared memory), where the calibrated α-β costs of their messages are 0.6 and 0.8 ms on
shared memory. :func:`ps_exchange` times both in forked processes on the transport the
profile is for: one :class:`~disttrain.parallel.parameter_server.PSWorker` that computes
forward+backward between its pull and its push, as in a step, and one server (sync mode,
SGD). Then it runs the same with two workers: what the second adds to a clock is the part
of an exchange the server serves one worker at a time. On this host that was 3.5-3.9 ms
of a 3.8-4.2 ms exchange on Gloo, 2.8-3.3 of 4.8-5.4 ms on shared memory (two runs each):
with several workers the rest (the worker's own Python, the wake-ups while a message
travels) overlaps the other workers' exchanges. The
simulation charges them on this machine (:mod:`~disttrain.simulate.parameter_server`).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from disttrain.bench.ranks import rank_comm
from disttrain.parallel.parameter_server import (
    PSConfig,
    PSWorker,
    assign_roles,
    run_parameter_server,
)
from disttrain.probe.contention import TIMEOUT_S, forked_ranks

log = logging.getLogger(__name__)
ROUNDS = 30
WARM_UP = 5


def _child(rank: int, ranks: int, store: str, report: Callable[[Any], None],
           module: nn.Module, work: Callable[[], object], transport: str) -> None:
    # the server's INFO lines (its key range, its staleness) are about a real job
    logging.getLogger("disttrain.parallel.parameter_server").setLevel(logging.WARNING)
    try:
        with rank_comm(rank, ranks, store, transport, TIMEOUT_S) as comm:
            # below the communicator's timeout, as PSConfig requires: the server names a
            # silent worker before Gloo's own timeout breaks the connections
            roles = assign_roles(ranks, 1)
            config = PSConfig(mode="sync", timeout_s=TIMEOUT_S / 2)
            if roles.role(rank).kind == "server":
                run_parameter_server(comm, roles, module,
                                     lambda p: torch.optim.SGD(p, lr=0.0), config)
                report(None)
                return
            ps = PSWorker(comm, module, roles, config)
            pulls, pushes, clocks = [], [], []
            for _ in range(ROUNDS + WARM_UP):
                start = time.perf_counter()
                ps.pull()
                pulled = time.perf_counter()
                work()  # the gradients the push sends, after compute as in a step
                computed = time.perf_counter()
                ps.push()
                end = time.perf_counter()
                pushes.append(end - computed)
                pulls.append(pulled - start)
                clocks.append(end - start)
            ps.close()
        report(tuple(statistics.median(t[WARM_UP:]) for t in (pulls, pushes, clocks)))
    except Exception as exc:  # reported to the parent, which falls back to 0
        report(f"{type(exc).__name__}: {exc}")


def _run(workers: int, module: nn.Module, work: Callable[[], object], transport: str
         ) -> list[tuple[float, float, float]]:
    """Each worker's median (pull, push, clock) with ``workers`` workers and one server."""
    return [v for v in forked_ranks(_child, workers + 1, module, work, transport)
            if v is not None]


def ps_exchange(module: nn.Module, work: Callable[[], object], transport: str = "torch"
                ) -> tuple[float, float, float]:
    """(seconds of a pull, seconds of a push, seconds of them served in turn) of
    ``module``'s parameters between one worker that runs ``work`` (forward+backward)
    between them and one server, on ``transport``. The served share is what a second
    worker adds to the clock (the slower worker's), at most the whole pull and push; 0,
    logged, when the run with two workers failed. (0, 0, 0), logged, if the processes fail
    or fork is unavailable."""
    try:
        (pull, push, clock), = _run(1, module, work, transport)
    except Exception as exc:
        log.warning("could not measure a parameter-server exchange (%s); assuming only "
                    "its messages' calibrated cost", exc)
        return 0.0, 0.0, 0.0
    try:
        two = max(c for _, _, c in _run(2, module, work, transport))
    except Exception as exc:
        log.warning("could not measure a parameter-server exchange with two workers (%s); "
                    "assuming each worker's whole exchange is served in turn", exc)
        return float(pull), float(push), 0.0
    return float(pull), float(push), float(min(max(0.0, two - clock), pull + push))
