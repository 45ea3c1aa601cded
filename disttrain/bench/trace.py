"""Timelines: one Chrome-trace JSON per run, every rank a row (open in Perfetto or
chrome://tracing), as Horovod's timeline shows each rank's work.

Each rank reports its optimizer steps (from the training loop's step hook) and its
collectives (from :class:`~disttrain.comm.flight_recorder.FlightRecorder`: queued, started
and ended on the wall clock, which every local process shares). They become complete events
(``"ph": "X"``, microseconds) on process ``rank``: thread 0 holds the steps, thread 1 the
collectives, whose ``args`` carry the op, the algorithm, the bytes and the state::

    rank 0  step ▕███████████▏▕███████████▏
            comm      ▕all_reduce▏    ▕all_reduce▏
    rank 1  step ▕██████████▏ ...
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

Event = dict[str, Any]
STEP_TID, COMM_TID = 0, 1


def _meta(rank: int) -> list[Event]:
    return [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": STEP_TID,
             "args": {"name": "compute (optimizer steps)"}},
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": COMM_TID,
             "args": {"name": "collectives (disttrain.comm)"}}]


def rank_events(rank: int, steps: list[tuple[int, float, float]],
                collectives: list[dict[str, Any]], origin: float) -> list[Event]:
    """One rank's spans, in microseconds since ``origin`` (seconds, wall clock)."""
    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    events = _meta(rank)
    for step, start, end in steps:
        events.append({"name": f"step {step}", "cat": "compute", "ph": "X", "pid": rank,
                       "tid": STEP_TID, "ts": us(start), "dur": us(end) - us(start)})
    for c in collectives:
        start = c.get("started_at") or c["queued_at"]
        end = c.get("ended_at") or start
        events.append({"name": c["op"], "cat": "collective", "ph": "X", "pid": rank,
                       "tid": COMM_TID, "ts": us(start), "dur": max(us(end) - us(start), 0.0),
                       "args": {"seq": c["seq"], "algorithm": c["algorithm"],
                                "bytes": c["nbytes"], "state": c["state"],
                                "queued_us": us(c["queued_at"])}})
    return events


def chrome_trace(reports: list[dict[str, Any]]) -> list[Event]:
    """Merge every rank's report (rank order) into one event list on a common time origin."""
    starts = [s[1] for r in reports for s in r["steps"]]
    starts += [c["queued_at"] for r in reports for c in r["collectives"]]
    origin = min(starts) if starts else 0.0
    events: list[Event] = []
    for rank, report in enumerate(reports):
        events += rank_events(rank, report["steps"], report["collectives"], origin)
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
