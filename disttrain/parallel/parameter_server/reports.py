"""What a parameter-server run reports: per server and per worker, returned at the end."""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.parallel.parameter_server.consistency import StalenessHistogram


@dataclass
class ServerReport:
    """What one server did: its final version and clock, the staleness of every applied
    update, requests served and rejected (by status), and its bytes on the wire."""

    server: int
    rank: int
    mode: str
    version: int
    clock: int
    staleness: dict[int, int]
    requests: dict[str, int]
    rejected: dict[str, int]
    bytes_sent: int
    bytes_recv: int

    @property
    def histogram(self) -> StalenessHistogram:
        return StalenessHistogram(self.staleness)


@dataclass
class WorkerReport:
    """One worker's run: steps, bytes on the wire (counted by comm.stats) next to what
    pushing and pulling every parameter every step would have sent, and where time went."""

    worker: int
    rank: int
    steps: int
    bytes_sent: int
    bytes_recv: int
    dense_equivalent_bytes: int
    compute_s: float
    comm_s: float
    straggler_sleep_s: float
