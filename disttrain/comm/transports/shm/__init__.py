"""Shared memory: the ``shm`` transport and the ``shm`` collectives that run on it.

Ranks on one machine move every byte through one POSIX shared-memory segment instead of
loopback TCP (docs/shm_transport.md). Read in this order, from the bottom up:

==================  ====================================================================
``segment.py``      the segment: its layout in cache lines (pure arithmetic), creation,
                    attachment and unlinking, and sharing one among a group's ranks over
                    torch.distributed (:class:`ShmUnavailableError` when they cannot)
``sync.py``         waiting on shared memory: futexes, the poll-yield-sleep
                    :class:`~.sync.Waiter` with its deadline and liveness watch, and the
                    collective area (two sets of per-rank slots and a counter barrier)
``mailbox.py``      point-to-point messages through per-pair rings of slots
                    (``isend``/``irecv``)
``transport.py``    :class:`SharedMemoryTransport` and :class:`ShmConfig`, which tie the
                    pieces together, and the shared buffers of
                    ``Communicator.shared_zeros`` (all-reduced where they lie)
``collectives.py``  algorithm ``shm`` (registered in ``disttrain.comm.algorithms``): what
                    every collective shares (barrier steps with named errors, rank-ordered
                    reductions, byte counts) and every collective but all_reduce
``all_reduce.py``   its all_reduce: one-shot, reduce-scatter + all-gather, and in place on
                    shared buffers
==================  ====================================================================
"""

from disttrain.comm.transports.shm.transport import (
    SharedMemoryTransport,
    ShmConfig,
    ShmUnavailableError,
)

__all__ = ["SharedMemoryTransport", "ShmConfig", "ShmUnavailableError"]
