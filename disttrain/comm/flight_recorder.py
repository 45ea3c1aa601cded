"""Flight recorder: each rank remembers its last collectives, to diagnose a stuck job later.

Like torch's NCCL flight recorder: a bounded ring buffer of records (sequence number, op,
algorithm, bytes, queue/start/end times, state). ``dump()`` gives plain dicts; ``write()``
stores them as JSON, e.g. when a collective times out.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from disttrain import private_files


@dataclass(slots=True)
class CollectiveRecord:
    seq: int
    op: str
    algorithm: str
    nbytes: int
    queued_at: float
    started_at: float | None = None
    ended_at: float | None = None
    state: str = "queued"  # queued → running → completed | failed
    error: str = ""


class FlightRecorder:
    def __init__(self, capacity: int = 256) -> None:
        if capacity < 1:
            raise ValueError(f"flight recorder capacity must be ≥ 1, got {capacity}")
        self._records: deque[CollectiveRecord] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def queued(self, seq: int, op: str, algorithm: str, nbytes: int) -> CollectiveRecord:
        record = CollectiveRecord(seq, op, algorithm, nbytes, time.time())
        self._records.append(record)  # atomic (GIL); dump() copies under the lock
        return record

    @staticmethod
    def started(record: CollectiveRecord) -> None:
        record.started_at, record.state = time.time(), "running"

    @staticmethod
    def ended(record: CollectiveRecord, error: BaseException | None = None) -> None:
        record.ended_at = time.time()
        record.state = "failed" if error is not None else "completed"
        record.error = "" if error is None else f"{type(error).__name__}: {error}"

    def dump(self) -> list[dict[str, Any]]:
        with self._lock:
            records = list(self._records)  # one C call under the GIL: appends cannot interleave
        return [asdict(r) for r in records]

    def recent(self, since: float) -> list[dict[str, Any]]:
        """Like :meth:`dump`, but only the records queued at or after ``since`` (a
        ``time.time()``): what a per-step report needs, without copying the whole ring."""
        with self._lock:
            records = list(self._records)
        picked = []
        for record in reversed(records):  # newest first; stop at the first older record
            if record.queued_at < since:
                break
            picked.append(record)
        return [asdict(r) for r in reversed(picked)]

    def write(self, path: str | Path, **meta: Any) -> Path:
        """Store the records and ``meta`` as JSON at ``path``: atomically, and never through
        a link someone planted there (:func:`disttrain.private_files.atomic_write`)."""
        path = Path(path)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        text = json.dumps({**meta, "records": self.dump()}, indent=1) + "\n"
        return private_files.write_text(path, text, mode=0o600)

