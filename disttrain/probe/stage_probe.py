"""What one pipeline message costs here, through disttrain's own stage links.

The simulation charges a message between two pipeline stages α + bytes · β of the
calibrated transport. On a host CPU a message also runs both stages' Python (the 128-byte
header packed and checked, the receive posted and waited for), and when the receiver sat
idle while the other stages computed, it must be woken and its next computation starts on
cold caches. On this project's 2-vCPU host, model parallelism on shared memory paid 0.6-1
ms per message where shared memory's α is 0.11 ms, about what Gloo's messages cost
(docs/benchmarks.md), while a stage that is busy with other micro-batches when a message
arrives (GPipe, 1F1B) pays much less.

:func:`stage_message` times both in two forked processes, as model parallelism runs them:
one micro-batch down the two stages and its gradient back up through
:class:`~disttrain.parallel.pipeline.link.StageLink`. Rounds in which each stage computes
``work`` before each of its messages (the receiver idles meanwhile) give the cold price;
rounds with no computation the hot one. After each cold round both stages run ``work``
twice more, back to back: the round minus those two runs of each stage is its two
messages, woken receivers and computations after idling included. (The work is timed in
the children, around the rounds, not once in the parent before the fork: the children
compute 2-20 % slower than the parent at other moments, which reads the wake-up at
0.6-1.25 ms where the rounds' own difference reads 0.3-0.6 ms on LeNet.) The simulation
charges every message the hot price (at least α) and the receiver's next computation the
difference, in proportion to how long it sat idle (:mod:`~disttrain.simulate.pipeline`).

:func:`stage_work` measures the other side of a message in a pipeline with micro-batches in
flight: what each stage does on its own thread for it (packing and posting it, taking it
in, the schedule's Python per micro-batch), on disttrain's real pipeline runtime. Each
stage of a 2-stage GPipe spends 0.37-0.52 ms per micro-batch so, on Gloo and on shared
memory alike. It is charged to the stages because a link overlaps the sender's computation:
with all of a message on the link, GPipe and 1F1B on shared memory, whose α is small, are
predicted at 0.73-0.84 of their runs. It runs GPipe and 1F1B in alternating steps, on 2
stages and on 4 (the validation's rank counts): on 4 Gloo ranks of 2 cores 1F1B's runs take
5-40 % longer than GPipe's, which a simulation charging both schedules the same work per
message cannot show; its stages spend 20-24 µs more of their own time per message than GPipe's
on 2 stages and 54-66 µs more on 4 (a 2-vCPU Intel host), and GPipe's own 0.16-0.18 ms on
4 stages against 0.13-0.14 ms on 2.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from disttrain.bench.ranks import rank_comm
from disttrain.parallel.pipeline import build_pipeline
from disttrain.parallel.pipeline.link import TRAIN, Direction, StageLink
from disttrain.probe.contention import TIMEOUT_S, forked_ranks

log = logging.getLogger(__name__)
ROUNDS = 30
WARM_UP = 5
PAYLOAD_BYTES = 4096  # small enough that β · bytes is noise on any transport here


def _child(rank: int, ranks: int, store: str, report: Callable[[Any], None],
           work: Callable[[], object], nbytes: int, transport: str) -> None:
    act, grad = Direction.ACTIVATION, Direction.GRADIENT
    first, last = rank == 0, rank == ranks - 1
    try:
        with rank_comm(rank, ranks, store, transport, TIMEOUT_S) as comm:
            link = StageLink(comm, rank)
            payload = torch.zeros(max(1, nbytes // 4))
            rounds: dict[bool, list[float]] = {True: [], False: []}
            solo: list[float] = []  # work twice, right after each cold round
            for call in range(2 * (ROUNDS + WARM_UP)):
                cold = call < ROUNDS + WARM_UP
                link.begin(TRAIN, {act: int(not last), grad: int(not first)},
                           {act: int(not first), grad: int(not last)})
                start = time.perf_counter()
                if not first:
                    link.recv(act, call=call, mode=TRAIN, microbatch=0)
                if cold:
                    work()  # forward
                if not last:
                    link.send(act, payload, call=call, mode=TRAIN, microbatch=0, rows=1)
                    link.recv(grad, call=call, mode=TRAIN, microbatch=0)
                if cold:
                    work()  # backward
                if not first:
                    link.send(grad, payload, call=call, mode=TRAIN, microbatch=0, rows=1)
                link.flush()
                rounds[cold].append(time.perf_counter() - start)
                if cold:
                    start = time.perf_counter()
                    work()
                    work()
                    solo.append(time.perf_counter() - start)
        # stage 0 starts first and finishes last: its rounds are the critical path
        report((rank, rounds[True][WARM_UP:], rounds[False][WARM_UP:], solo[WARM_UP:]))
    except Exception as exc:  # reported to the parent, which falls back to 0
        report(f"{type(exc).__name__}: {exc}")


def stage_message(work: Callable[[], object], transport: str = "torch",
                  nbytes: int = PAYLOAD_BYTES, bind: bool = False) -> tuple[float, float]:
    """(seconds of a message between two pipeline stages that are busy, extra seconds when
    its receiver sat idle while the sender ran ``work``) on ``transport``. A round is 2
    messages; the cold one also runs ``work`` twice on each stage, and each stage's two
    runs of ``work`` right after it are taken off it (the median over rounds); ``bind`` as
    :func:`~disttrain.probe.contention.forked_ranks`. Both at least 0; (0, 0), logged,
    if the processes fail or fork is unavailable."""
    try:
        rounds = {rank: rest for rank, *rest in
                  forked_ranks(_child, 2, work, nbytes, transport, bind=bind)}
    except Exception as exc:
        log.warning("could not measure a pipeline message (%s); assuming its calibrated "
                    "α-β cost", exc)
        return 0.0, 0.0
    (cold, hot, solo), other = rounds[0], rounds[1][2]
    busy = max(0.0, statistics.median(hot) / 2)
    messages = [(c - a - b) / 2 for c, a, b in zip(cold, solo, other, strict=True)]
    return busy, max(0.0, statistics.median(messages) - busy)


MICROBATCHES = 8  # as disttrain bench runs its pipelines
STEPS = 20
SCHEDULES = ("gpipe", "1f1b")


def _work_child(rank: int, ranks: int, store: str, report: Callable[[Any], None],
                module: torch.nn.Module, x: torch.Tensor, transport: str) -> None:
    def loss(out: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
        return out.float().pow(2).mean()

    logging.getLogger("disttrain.parallel.pipeline").setLevel(logging.WARNING)  # its plan
    try:
        with rank_comm(rank, ranks, store, transport, TIMEOUT_S) as comm:
            pipes = {name: build_pipeline(module, comm, schedule=name,
                                          microbatches=MICROBATCHES) for name in SCHEDULES}
            batch = torch.cat([x] * MICROBATCHES)
            targets = torch.zeros(len(batch))
            own: dict[str, list[float]] = {name: [] for name in SCHEDULES}
            for _ in range(WARM_UP + STEPS):
                for name, pipe in pipes.items():  # alternately: the machine's drift hits both
                    for param in pipe.parameters():
                        param.grad = None
                    pipe.train_step(batch if pipe.is_first else None,
                                    targets if pipe.is_last else None, loss)
                    step = pipe.last_step
                    assert step is not None
                    own[name].append(step.wall_s - step.busy_s - step.wait_s)
        report((rank, {name: steps[WARM_UP:] for name, steps in own.items()}))
    except Exception as exc:  # reported to the parent, which falls back to 0
        report(f"{type(exc).__name__}: {exc}")


def _message_ends(rank: int, ranks: int) -> int:
    """Messages a stage sends or takes in per step: an activation and a gradient each way
    per micro-batch, one way only at either end of the pipeline."""
    return 2 * MICROBATCHES * (1 if rank in (0, ranks - 1) else 2)


def stage_work(module: torch.nn.Module, x: torch.Tensor, transport: str = "torch",
               ranks: int = 2, bind: bool = False) -> dict[str, float]:
    """Seconds a pipeline stage works on its own thread per message it sends or receives,
    by schedule (``{"gpipe": …, "1f1b": …}``; ``Overheads.stage_work_s`` is GPipe's on 2
    stages, ``Overheads.crossing_by_ranks`` 1F1B's excess): ``module`` split into
    ``ranks`` stages by disttrain's pipeline runtime in as many forked processes, GPipe and
    1F1B over :data:`MICROBATCHES` micro-batches of ``x`` in alternating steps; each stage's
    step less its layers and loss (the stage's busy time) and less its waits for the
    others, the median of :data:`STEPS` steps, is what it spends packing, posting, taking
    in and dispatching messages and micro-batches. Summed over the stages and divided by
    the messages they handle (:func:`_message_ends`); ``bind`` as
    :func:`~disttrain.probe.contention.forked_ranks`. ``{}``, logged, if the processes
    fail (a model of fewer layers than ``ranks`` has no such pipeline).

    In 1F1B's steady state a stage alternates forwards and backwards, so its connections
    carry activations one way and gradients the other at once, where GPipe's flow one way
    at a time; on 4 Gloo ranks of this project's 2-vCPU hosts that costs 1F1B's stages
    more of their own time (docs/simulate.md, "Why the model is built this way")."""
    try:
        per_rank = forked_ranks(_work_child, ranks, module, x, transport, bind=bind)
    except Exception as exc:
        log.warning("could not measure a pipeline stage's own work on %d stages (%s); "
                    "charging none", ranks, exc)
        return {}
    ends = sum(_message_ends(rank, ranks) for rank, _ in per_rank)
    return {name: max(0.0, sum(statistics.median(steps[name]) for _, steps in per_rank) / ends)
            for name in SCHEDULES}
