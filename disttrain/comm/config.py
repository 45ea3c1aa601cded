"""CommConfig: how a Communicator behaves (timeouts, default algorithm, streaming, debug)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from disttrain.comm import algorithms


@dataclass(frozen=True)
class CommConfig:
    """How a Communicator behaves. Validated on creation."""

    timeout_s: float = 120.0  # every blocking wait gives up after this long
    algorithm: str = "auto"  # default algorithm for every collective
    chunk_bytes: int | None = None  # ring streaming sub-chunk; None: from the cost model
    debug_checks: bool = False  # compare op/shape/dtype across ranks before each collective
    flight_recorder_size: int = 256
    # the torch transport matches messages by NCCL's rules (test mode, disttrain.comm.
    # nccl_rules); "bound": as NCCL does on a group bound to a device (one queue per group);
    # default: DISTTRAIN_NCCL_RULES=1 (or =bound) in the environment
    nccl_rules: bool | str = field(default_factory=lambda: nccl_rules_from_env(os.environ))

    def __post_init__(self) -> None:
        if (isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float))
                or not 0 < self.timeout_s < math.inf):
            raise ValueError(f"timeout_s must be a positive, finite number of seconds, "
                             f"got {self.timeout_s!r}")
        if self.chunk_bytes is not None and (not _is_int(self.chunk_bytes)
                                             or self.chunk_bytes <= 0):
            raise ValueError(f"chunk_bytes must be a positive int (or None), "
                             f"got {self.chunk_bytes!r}")
        if not isinstance(self.debug_checks, bool):
            raise ValueError(f"debug_checks must be True or False, got {self.debug_checks!r}")
        if not isinstance(self.nccl_rules, bool) and self.nccl_rules != "bound":
            raise ValueError(f"nccl_rules must be True, False or 'bound', "
                             f"got {self.nccl_rules!r}")
        if not _is_int(self.flight_recorder_size) or self.flight_recorder_size < 1:
            raise ValueError(f"flight_recorder_size must be an int ≥ 1, "
                             f"got {self.flight_recorder_size!r}")
        known = {name for table in algorithms.ALGORITHMS.values() for name in table}
        if self.algorithm != "auto" and self.algorithm not in known:
            raise ValueError(f"algorithm={self.algorithm!r} is unknown; choose 'auto' or one of: "
                             f"{', '.join(sorted(known))}")


def nccl_rules_from_env(env: Any) -> bool | str:
    """Whether ``DISTTRAIN_NCCL_RULES`` turns the NCCL-rules test mode on (1/true/yes/on),
    modelling groups bound to a device (``bound``), or off."""
    value = env.get("DISTTRAIN_NCCL_RULES", "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    if value == "bound":
        return "bound"
    raise ValueError(f"DISTTRAIN_NCCL_RULES={value!r}: set it to 1 (on), bound (on, groups "
                     f"bound to a device) or 0 (off)")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
