"""After a failure, who is to blame? Survivors check in, and silent ranks are told apart.

When a rank dies, Gloo breaks the connections of every peer that was talking to it, so the
peer a survivor was waiting for is not necessarily the culprit: it may itself be waiting
for a stuck or dead rank. Each survivor therefore *checks in* through the rendezvous store
and looks at who did not::

    survivor ──append "3,"──► store key  in      ◄── the others' check-ins
             ──read in, verdicts every 50 ms, until one of:
                 everyone checked in                   → nobody is to blame
                 a silent rank is a known fact:        → that rank, at once
                   dead or stopped (its pid on this host, liveness.local_state),
                   or another survivor's verdict about it (from the rank's own host)
                 the store does not answer             → the ranks on other hosts
                   (a partition, or the store's host is down): they are unreachable
                 the grace period ends                 → whoever did not check in

A rank that is alive but busy elsewhere (in a long compute phase, or in another collective)
checks in late; it is named only if it has not done so by the end of the grace period,
which is then exactly what the message says. Every store call is bounded by the grace
period (:func:`disttrain.comm.liveness.bounded`), so a diagnosis never outlasts it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from disttrain.comm.liveness import (
    DEAD,
    REMOTE,
    STOPPED,
    ProcessInfo,
    bounded,
    describe,
    host_key,
    local_state,
)

_POLL_S = 0.05
_MIN_CALL_S = 0.2  # every store call gets at least this long, even at the deadline


@dataclass(frozen=True)
class Verdict:
    """Who is to blame (group ranks), and how each is known when it is a fact."""

    missing: tuple[int, ...]
    notes: dict[int, str] = field(default_factory=dict)

    def describe(self, rank: int) -> str | None:
        return self.notes.get(rank)


class _Store:
    """The store calls of one check-in, each bounded by the deadline; after the first one
    that fails, the store counts as unreachable and is not called again."""

    def __init__(self, store: Any, deadline: float) -> None:
        self.store, self.deadline, self.reachable = store, deadline, True

    def call(self, method: str, *args: Any) -> Any:
        if not self.reachable:
            raise ConnectionError("the rendezvous store did not answer")
        budget = max(_MIN_CALL_S, self.deadline - time.monotonic())
        try:
            return bounded(lambda: getattr(self.store, method)(*args), budget)
        except Exception:
            self.reachable = False
            raise

    def read(self, key: str) -> str:
        """The value of ``key`` ("" when unset), without waiting for it to appear."""
        if not self.call("check", [key]):
            return ""
        return bytes(self.call("get", key)).decode(errors="replace")


def check_in(store: Any, prefix: str, me: int, members: Sequence[int],
             table: Sequence[ProcessInfo | None] | None, grace_s: float) -> Verdict | None:
    """Check in as ``members[me]`` under ``prefix`` and return the verdict (see the module
    docstring); ``table[i]`` is ``members[i]``'s process, when known. None: nothing can be
    said (the store is unreachable and no process table tells the hosts apart)."""
    calls = _Store(store, time.monotonic() + grace_s)
    here = host_key().hex()
    notes: dict[int, str] = {}
    try:
        calls.call("append", prefix + "in", f"{me},")
    except Exception:
        pass  # unreachable: judged below from what this host knows
    missing = [r for r in range(len(members)) if r != me]
    while True:
        for r in missing:
            info = table[r] if table is not None else None
            state = local_state(info, here)
            if state in (STOPPED, DEAD) and r not in notes:
                notes[r] = describe(state, info)
                _tell(calls, prefix, r, notes[r])
        if calls.reachable:
            missing = _still_missing(calls, prefix, missing, notes)
        if not missing:
            return Verdict(())
        known = tuple(r for r in missing if r in notes)
        if known:
            return Verdict(known, {r: notes[r] for r in known})
        if not calls.reachable:
            return _unreachable(missing, table, here)
        if time.monotonic() >= calls.deadline:
            return Verdict(tuple(missing))
        time.sleep(_POLL_S)


def _tell(calls: _Store, prefix: str, rank: int, note: str) -> None:
    """Share a fact about ``rank`` with survivors on other hosts."""
    try:
        calls.call("append", prefix + "verdicts", f"{rank}:{' '.join(note.split())}\n")
    except Exception:
        pass


def _still_missing(calls: _Store, prefix: str, missing: list[int],
                   notes: dict[int, str]) -> list[int]:
    """``missing`` minus those that checked in; facts other hosts shared go into ``notes``."""
    try:
        arrived = {int(r) for r in calls.read(prefix + "in").split(",") if r.strip()}
        for line in calls.read(prefix + "verdicts").splitlines():
            rank, _, note = line.partition(":")
            if rank.strip().isdigit():
                notes.setdefault(int(rank), note)
    except Exception:
        return missing
    return [r for r in missing if r not in arrived]


def _unreachable(missing: list[int], table: Sequence[ProcessInfo | None] | None,
                 here: str) -> Verdict | None:
    """The store does not answer: ranks still running on this host are not to blame; the
    ones elsewhere cannot be reached."""
    if table is None:
        return None
    far = tuple(r for r in missing if local_state(table[r], here) == REMOTE)
    if not far:
        return None
    note = ("could not be reached: the rendezvous store does not answer either (a network "
            "partition, or that host is down)")
    return Verdict(far, {r: f"on {_host(table[r])}: {note}" for r in far})


def _host(info: ProcessInfo | None) -> str:
    return info.host if info is not None else "another host"
