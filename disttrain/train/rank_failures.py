"""Which rank of a local run failed first, and how: the verdict ``disttrain run -n N`` prints.

Each rank that fails sends its traceback and what its communicator found out (the ranks it
blames, the operation it was in). A rank that dies sends nothing; its exit status says how
(``was killed by SIGKILL``). A rank that falls silent (SIGSTOP, a hang) sends nothing
either and does not exit: the survivors' errors name it, and the kernel says whether it is
stopped. The root cause is the first failure that is not a consequence of another rank's,
else the rank the survivors blame, else the first failure seen.
"""

from __future__ import annotations

import signal
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from disttrain.comm.liveness import DEAD, STOPPED, process_state

# A rank whose error ends in one of these failed because another rank did: a dead or
# failed peer (disttrain.comm's errors, Gloo's broken connections) or a wait that ran out.
CONSEQUENCES = ("PeerFailedError", "CommTimeoutError", "BarrierTimeoutError", "InitError",
                "RendezvousError", "PSPeerFailedError", "PSTimeoutError",
                "Connection closed by peer", "Connection reset by peer", "Broken pipe")


class RankFailedError(RuntimeError):
    """A rank raised, died or timed out; ``rank`` and ``kind`` say which and how."""

    def __init__(self, rank: int, kind: str, detail: str, *,
                 suspects: Sequence[int] = (), operation: str | None = None) -> None:
        super().__init__(f"rank {rank} {kind}: {detail}")
        self.rank, self.kind, self.detail = rank, kind, detail
        self.suspects = tuple(suspects)  # the ranks this one blames
        self.operation = operation  # what it was doing, e.g. "all_reduce #2 (ring)"

    @property
    def is_consequence(self) -> bool:
        return any(marker in self.detail for marker in CONSEQUENCES)


def facts_of(exc: BaseException, comm: Any | None) -> dict[str, Any]:
    """What a failing rank tells its parent besides the traceback (JSON-able)."""
    suspects = [int(r) for r in getattr(exc, "suspects", ()) or ()]
    op, seq = getattr(exc, "op", ""), getattr(exc, "seq", -1)
    operation = f"{op} #{seq}" if op and seq is not None and seq >= 0 else (op or None)
    if operation is None and comm is not None:
        operation = last_operation(comm)
    return {"suspects": suspects, "operation": operation}


def last_operation(comm: Any) -> str | None:
    """The newest entry of ``comm``'s flight recorder: ``all_reduce #2 (ring) failed``."""
    try:
        records = comm.flight_recorder.dump()
    except Exception:
        return None
    if not records:
        return None
    last = records[-1]
    return f"{last.get('op')} #{last.get('seq')} ({last.get('algorithm')}) {last.get('state')}"


def from_report(rank: int, text: str, facts: Mapping[str, Any] | None) -> RankFailedError:
    """The error for a rank that reported ``text`` (a traceback) and ``facts``."""
    last = text.strip().splitlines()[-1] if text.strip() else "unknown error"
    facts = facts or {}
    return RankFailedError(rank, "failed", last, suspects=facts.get("suspects") or (),
                           operation=facts.get("operation"))


def died(rank: int, exitcode: int | None) -> RankFailedError:
    """The error for a rank whose process ended without a result."""
    if exitcode is not None and exitcode < 0:
        try:
            how = f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"was killed by signal {-exitcode}"
    else:
        how = f"exited with code {exitcode} without a result"
    return RankFailedError(rank, "died", how)


def root_cause(failed: Sequence[RankFailedError],
               pids: Mapping[int, int] | None = None) -> RankFailedError:
    """The first failure (in the order seen) that is not a consequence of another rank's;
    else the rank the others blame (with its state from ``pids``, its process ids); else
    the first failure seen. A survivor blocked on the failed rank may report before it,
    and must not be named instead."""
    own = [e for e in failed if not e.is_consequence]
    culprit = own[0] if own else _blamed(failed, pids or {})
    culprit = culprit or failed[0]
    if culprit.kind == "died":  # say what its peers were doing when it went
        operation = next((e.operation for e in failed if e.operation), None)
        if operation and culprit.operation is None:
            culprit = RankFailedError(culprit.rank, culprit.kind,
                                      f"{culprit.detail}; its peers were in {operation}",
                                      operation=operation)
    return culprit


def _blamed(failed: Sequence[RankFailedError],
            pids: Mapping[int, int]) -> RankFailedError | None:
    votes = Counter(r for e in failed for r in e.suspects)
    if not votes:
        return None
    rank = min(votes, key=lambda r: (-votes[r], r))
    reported = next((e for e in failed if e.rank == rank), None)
    if reported is not None and not reported.is_consequence:
        return reported
    accuser = next(e for e in failed if rank in e.suspects)
    state = process_state(pids[rank]) if rank in pids else None
    kind = {STOPPED: "was stopped (SIGSTOP or a debugger) and did not respond",
            DEAD: "died"}.get(state or "", "did not respond")
    return RankFailedError(rank, kind, f"named by rank {accuser.rank}: {accuser.detail}",
                           operation=accuser.operation)
