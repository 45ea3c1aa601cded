"""PSConfig: the options every server and worker of one job share, validated on creation.

Servers and workers must be built with equal configs (the HELLO handshake compares a
fingerprint of the mode, the bound and the key layout and rejects a worker that differs).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from disttrain.parallel.parameter_server.partition import Partition

MODES = ("sync", "async", "ssp")


@dataclass(frozen=True)
class PSConfig:
    """How a parameter-server job trains.

    * ``mode``: ``sync`` (BSP: every clock waits for every worker), ``async`` (ASGD: every
      worker step is applied when it arrives) or ``ssp`` (stale synchronous parallel: steps
      are applied on arrival as in async, but a worker may run at most ``staleness`` clocks
      ahead of the slowest; ``staleness=0`` is sync). See :mod:`.consistency`.
    * ``sparse_params``: names (``model.named_parameters()``) of embedding tables whose rows
      travel sparsely: a worker pulls and pushes only the rows a batch touches.
    * ``timeout_s``: every wait gives up after this long; a server declares a worker dead when
      it has sent nothing for this long (call :meth:`PSWorker.heartbeat` in longer pauses).
      None: 90% of the communicator's timeout. It must stay below the communicator's
      timeout, because Gloo breaks every connection of the process when its own fires.
      Start-up (a worker's HELLO, the server waiting for it) may take up to 90% of the
      communicator's timeout whatever this is: loading a model or checkpoint takes time.
    * ``max_message_elems``: the largest payload a server accepts in one message.
    * ``straggler``: ``{worker rank: factor}`` slows those workers' steps to ``factor`` × their
      own work (compute, pull and push; sleeping the difference before each push) for
      straggler experiments.
    """

    mode: str = "sync"
    staleness: int = 2  # ssp only
    sparse_params: tuple[str, ...] = ()
    timeout_s: float | None = None
    max_message_elems: int = 1 << 26
    straggler: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is unknown; choose one of {', '.join(MODES)}")
        if not _is_int(self.staleness) or self.staleness < 0:
            raise ValueError(f"staleness must be an int ≥ 0 (clocks a worker may run ahead of "
                             f"the slowest in ssp mode), got {self.staleness!r}")
        names = tuple(self.sparse_params)
        if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
            raise ValueError(f"sparse_params must be distinct parameter names, got "
                             f"{self.sparse_params!r}")
        object.__setattr__(self, "sparse_params", names)
        if self.timeout_s is not None and (not _is_number(self.timeout_s)
                                           or not 0 < self.timeout_s < math.inf):
            raise ValueError(f"timeout_s must be a positive, finite number of seconds (or "
                             f"None), got {self.timeout_s!r}")
        if not _is_int(self.max_message_elems) or self.max_message_elems < 1:
            raise ValueError(f"max_message_elems must be an int ≥ 1, "
                             f"got {self.max_message_elems!r}")
        object.__setattr__(self, "straggler", _check_straggler(self.straggler))

    @property
    def bound(self) -> int | None:
        """How many clocks a worker may be ahead of the slowest: 0 (sync), s (ssp), None."""
        if self.mode == "async":
            return None
        return 0 if self.mode == "sync" else self.staleness

    @property
    def on_arrival(self) -> bool:
        """Is each worker's push its own update, applied when it arrives (async, ssp with
        s > 0)? Otherwise (sync, ssp with s = 0, which is BSP) the W pushes of a clock are
        averaged into one update. Applied on arrival, W updates make one synchronous step:
        give the servers the learning rate divided by W for ``lr`` to mean the same."""
        return self.mode == "async" or (self.mode == "ssp" and self.staleness > 0)

    def fingerprint(self, part: Partition) -> int:
        """What servers and workers must agree on: the key layout, the mode and its bound."""
        return part.fingerprint(f"{self.mode}/{self.bound}")

    def resolve_timeout(self, comm_timeout_s: float) -> float:
        """The timeout to use with a communicator whose own timeout is ``comm_timeout_s``."""
        if self.timeout_s is None:
            return 0.9 * comm_timeout_s
        if self.timeout_s >= comm_timeout_s:
            raise ValueError(f"PSConfig.timeout_s={self.timeout_s:g} must be below the "
                             f"communicator's timeout_s={comm_timeout_s:g}: when Gloo's timeout "
                             f"fires first it breaks every connection of the process. Lower "
                             f"PSConfig.timeout_s or raise CommConfig.timeout_s")
        return self.timeout_s

    @staticmethod
    def startup_timeout(comm_timeout_s: float) -> float:
        """How long HELLO may take: servers may be slow to build the model or restore."""
        return 0.9 * comm_timeout_s

    def straggler_factor(self, rank: int) -> float:
        return self.straggler.get(rank, 1.0)


def parse_straggler(text: str) -> dict[int, float]:
    """``"3:2"`` or ``"3:2,4:1.5"`` (the ``--straggler RANK:FACTOR`` flag) → ``{3: 2.0, …}``."""
    result: dict[int, float] = {}
    for item in (part.strip() for part in text.split(",")):
        rank, sep, factor = item.partition(":")
        try:
            if not sep:
                raise ValueError
            parsed_rank, parsed_factor = int(rank), float(factor)
        except ValueError:
            raise ValueError(f"straggler {item!r} is not RANK:FACTOR (e.g. '3:2' slows rank 3 "
                             f"to twice its compute time)") from None
        if parsed_rank in result:
            raise ValueError(f"straggler rank {parsed_rank} is given twice in {text!r}")
        result[parsed_rank] = parsed_factor
    return _check_straggler(result)


def _check_straggler(value: Any) -> dict[int, float]:
    if not isinstance(value, Mapping):
        raise ValueError(f"straggler must be a mapping {{rank: factor}}, got {value!r}")
    checked: dict[int, float] = {}
    for rank, factor in value.items():
        if not _is_int(rank) or rank < 0:
            raise ValueError(f"straggler rank must be an int ≥ 0, got {rank!r}")
        if not _is_number(factor) or not 1.0 <= factor < math.inf:
            raise ValueError(f"straggler factor for rank {rank} must be a finite number ≥ 1 "
                             f"(2 = twice as slow), got {factor!r}")
        checked[rank] = float(factor)
    return checked


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
