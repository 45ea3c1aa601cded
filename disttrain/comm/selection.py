"""Which algorithm runs a collective: an explicit name, the configured default, or ``auto``.

An explicit name always wins (if it can run on the transport); ``CommConfig(algorithm=…)``
applies where the collective has that algorithm (``CommConfig(algorithm="ring")`` still
broadcasts); otherwise ``auto``: ``shm`` on the shared-memory transport, ``native`` on NCCL
(its kernels beat anything driven from Python, and the calibrated costs are CPU ones), else
the α-β-γ cost model's pick among the runnable algorithms. Every rank must decide alike,
which is why ``auto`` decides by sizes that every rank knows and by costs that every rank
agreed on (:mod:`disttrain.comm.agreement`).

The transport, configuration and costs of a communicator never change, so decisions are
remembered: choosing costs a dictionary lookup on every call after the first.
"""

from __future__ import annotations

from disttrain.comm import algorithms
from disttrain.comm.config import CommConfig
from disttrain.comm.cost_model import LinkCosts, choose
from disttrain.comm.transport import Transport
from disttrain.comm.transports.shm import collectives as shm_algorithms

_REMEMBERED = 512  # (op, algorithm, bytes) decisions kept

# builds sub-communicators and has no closed form: only ever chosen by name
AUTO_NEVER = frozenset({"hierarchical"})


class AlgorithmChooser:
    """The algorithm-picking policy of one communicator."""

    def __init__(self, transport: Transport, config: CommConfig, costs: LinkCosts) -> None:
        self._transport, self._config, self._costs = transport, config, costs
        self._known: dict[tuple[str, str | None, int], str] = {}

    def __call__(self, op: str, algorithm: str | None, nbytes: int) -> str:
        """The algorithm for ``op`` of ``nbytes``; ValueError (listing the choices) when
        ``algorithm`` is unknown or cannot run here."""
        key = (op, algorithm, nbytes)
        name = self._known.get(key)
        if name is None:
            name = self._decide(op, algorithm, nbytes)
            if len(self._known) >= _REMEMBERED:
                self._known.clear()
            self._known[key] = name
        return name

    def _decide(self, op: str, algorithm: str | None, nbytes: int) -> str:
        runnable = [a for a in algorithms.names(op) if self.can_run(a)]
        name = algorithm
        if name is None:
            default = self._config.algorithm
            name = default if default in runnable else "auto"
        if name == "auto":
            if "shm" in runnable:
                return "shm"
            if self._transport.device_type == "cuda" and "native" in runnable:
                return "native"  # NCCL's own kernels: the cost model is Gloo's, on CPUs
            candidates = [a for a in runnable if a not in AUTO_NEVER]
            return choose(op, self._transport.world_size, nbytes, self._costs, candidates)
        algorithms.get(op, name)  # raises a ValueError listing the choices
        if name not in runnable and self._transport.bound_to_device and name != "shm":
            raise ValueError(f"algorithm={name!r} cannot run on a process group bound to a "
                             f"device (init_process_group(device_id=...)): NCCL runs all its "
                             f"point-to-point messages on one stream there; use 'native' or "
                             f"'auto', or create the group without device_id")
        if name not in runnable:
            raise ValueError(f"algorithm={name!r} cannot run on the {self._transport.name!r} "
                             f"transport; choose one of: {', '.join(['auto', *runnable])}")
        return name

    def can_run(self, name: str) -> bool:
        if self._transport.bound_to_device and name not in ("native", "shm"):
            return False  # one queue for every peer: disttrain's algorithms need pairs
        if name == "native":
            return self._transport.native_group is not None
        if name == "shm":
            return shm_algorithms.supports(self._transport)
        if name == "hierarchical":  # shared memory inside a node: host memory only
            return self._transport.device_type == "cpu"
        return True
