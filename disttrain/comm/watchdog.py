"""NCCL's watchdog against disttrain's own timeouts: who acts first when a rank is late.

ProcessGroupNCCL runs a watchdog thread that counts the process group's timeout for every
NCCL operation, and, in torch's default error handling (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``),
tears the whole process down (SIGABRT) when one expires. disttrain bounds every wait itself
(the communicator's ``timeout_s``) and then names the late or lost rank after the survivors
check in (:mod:`disttrain.comm.checkin`). With both clocks equal, the watchdog would race the
diagnosis; and an operation left posted on purpose would abort the process later: a
parameter server's receive from a worker it lost and goes on without, a pipeline stage's
orphaned receives after a neighbour failed.

The policy disttrain sets on NCCL groups it creates, chosen so that its own error comes
first and nothing abandoned kills a survivor:

* the group's timeout is the communicator's longest wait (timeout plus check-in) plus
  :data:`MARGIN_S`, so disttrain's error, naming the rank, is raised and reported before
  the watchdog counts any operation as late;
* ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (clean up only): an expired operation aborts the
  NCCL communicator it ran on (a pair's, for a point-to-point message) without tearing
  the process down. A rank whose communicator failed stops by disttrain's own failure
  path (error record, named root cause, bounded exit), not by a signal.

A value the user set in the environment is kept (with a warning when it tears the process
down). Sub-groups (``Communicator.new_group``) get the same longer timeout. On Gloo the
group's timeout stays the communicator's: Gloo has no watchdog, and an operation torch
still runs after the communicator gave up ends about then too.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping

from disttrain.comm.context import longest_wait_s

log = logging.getLogger(__name__)

ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
CLEAN_UP_ONLY = "2"  # abort the failed NCCL communicator, keep the process
TEAR_DOWN = ("1", "3")  # torch's modes that end the process with SIGABRT
MARGIN_S = 30.0  # after disttrain's error: time to report it before the watchdog acts


def group_timeout_s(backend: str, comm_timeout_s: float) -> float:
    """The process group's own timeout for a communicator with ``comm_timeout_s``."""
    if backend != "nccl":
        return comm_timeout_s
    return longest_wait_s(comm_timeout_s) + MARGIN_S


def apply(backend: str, environ: MutableMapping[str, str]) -> None:
    """Set NCCL's error handling for disttrain's policy (module doc), before the group is
    made; a value already set is kept."""
    if backend != "nccl":
        return
    mode = environ.get(ERROR_HANDLING)
    if mode is None:
        environ[ERROR_HANDLING] = CLEAN_UP_ONLY
    elif mode.strip() in TEAR_DOWN:
        log.warning("%s=%s: NCCL's watchdog will end this process (SIGABRT) when an "
                    "operation left posted expires, e.g. a parameter server's receive from "
                    "a lost worker; disttrain's policy is %s", ERROR_HANDLING, mode,
                    CLEAN_UP_ONLY)
