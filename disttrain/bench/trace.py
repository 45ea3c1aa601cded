"""Timelines: one Chrome-trace JSON per run, every rank a row (open in Perfetto or
chrome://tracing), as Horovod's timeline shows each rank's work.

Each rank reports its optimizer steps (from the training loop's step hook), its compute
phases (forward, backward and optimizer, or one ``train_step`` span for strategies whose step
is a single call such as the pipelines; from the loop's
:class:`~disttrain.train.strategies.base.PhaseRecorder`) and the collectives of every
communicator its strategy sends through (from each
:class:`~disttrain.comm.flight_recorder.FlightRecorder`: queued, started and ended on the
wall clock, which every local process shares). They become complete events (``"ph": "X"``,
microseconds) on process ``rank``: thread 0 holds the steps, thread 1 the phases, and one
thread per communicator (``world``, or a sub-communicator's global ranks such as
``ranks 0,2`` in a pipeline's pp × dp grid) its collectives, whose ``args`` carry the
communicator, the op, the algorithm, the bytes and the state::

    rank 0  step      ▕███████████████▏▕███████████████▏
            phases    ▕fwd▏▕backward▏▕opt▏ ...
            world          ▕all_reduce▏
    rank 1  step      ▕██████████████▏ ...
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

Event = dict[str, Any]
STEP_TID, PHASE_TID, FIRST_COMM_TID = 0, 1, 2


def _thread(rank: int, tid: int, name: str) -> Event:
    return {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}}


def _meta(rank: int, comms: list[str]) -> list[Event]:
    events = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
              _thread(rank, STEP_TID, "optimizer steps"),
              _thread(rank, PHASE_TID, "compute phases")]
    return events + [_thread(rank, FIRST_COMM_TID + i, f"collectives ({label})")
                     for i, label in enumerate(comms)]


def rank_events(rank: int, report: dict[str, Any], origin: float) -> list[Event]:
    """One rank's spans, in microseconds since ``origin`` (seconds, wall clock)."""
    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    def span(name: str, cat: str, tid: int, start: float, end: float) -> Event:
        return {"name": name, "cat": cat, "ph": "X", "pid": rank, "tid": tid, "ts": us(start),
                "dur": max(us(end) - us(start), 0.0)}

    collectives = report["collectives"]
    comms = list(dict.fromkeys(c.get("comm", "world") for c in collectives))
    events = _meta(rank, comms)
    for step, start, end in report["steps"]:
        events.append(span(f"step {step}", "step", STEP_TID, start, end))
    for name, start, end in report.get("phases", []):
        events.append(span(name, "compute", PHASE_TID, start, end))
    for c in collectives:
        start = c.get("started_at") or c["queued_at"]
        label = c.get("comm", "world")
        event = span(c["op"], "collective", FIRST_COMM_TID + comms.index(label), start,
                     c.get("ended_at") or start)
        event["args"] = {"comm": label, "seq": c["seq"], "algorithm": c["algorithm"],
                         "bytes": c["nbytes"], "state": c["state"],
                         "queued_us": us(c["queued_at"])}
        events.append(event)
    return events


def chrome_trace(reports: list[dict[str, Any]]) -> list[Event]:
    """Merge every rank's report (rank order) into one event list on a common time origin."""
    starts = [s[1] for r in reports for s in r["steps"]]
    starts += [c["queued_at"] for r in reports for c in r["collectives"]]
    origin = min(starts) if starts else 0.0
    events: list[Event] = []
    for rank, report in enumerate(reports):
        events += rank_events(rank, report, origin)
    return events


def write_traces(directory: Path, traces: dict[str, list[Event]]) -> list[Path]:
    """``DIR/<strategy>-n<world size>.trace.json`` per run (Chrome's JSON object format)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for label, events in traces.items():
        path = directory / f"{label}.trace.json"
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        paths.append(path)
    return paths
