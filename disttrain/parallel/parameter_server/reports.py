"""What a parameter-server run reports: per server and per worker, returned at the end, and
the sums over every rank that the training loop's ``ps-*`` strategies put in their extras."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from disttrain.parallel.parameter_server.config import PSConfig
from disttrain.parallel.parameter_server.consistency import StalenessHistogram
from disttrain.parallel.parameter_server.final import Survivors
from disttrain.parallel.parameter_server.roles import PSRoles


@dataclass
class ServerReport:
    """What one server did: its final version and clock, the staleness of every applied
    update, requests served and rejected (by status), its bytes on the wire, and the workers
    the run went on without (``lost``: rank → how this server lost it, or which other
    server reported it)."""

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
    lost: dict[int, str] = field(default_factory=dict)  # lost worker rank → what happened

    @property
    def histogram(self) -> StalenessHistogram:
        return StalenessHistogram(self.staleness)


@dataclass
class WorkerReport:
    """One worker's run: steps, bytes on the wire (counted by comm.stats) next to what
    pushing and pulling every parameter every step would have sent, where time went, and
    the clocks a straggler experiment slowed this worker on."""

    worker: int
    rank: int
    steps: int
    bytes_sent: int
    bytes_recv: int
    dense_equivalent_bytes: int
    compute_s: float
    comm_s: float
    straggler_sleep_s: float
    slow_clocks: tuple[int, ...] = ()
    lost_workers: tuple[int, ...] = ()  # ranks of the workers the run went on without


def gather_extras(team: Survivors, roles: PSRoles, config: PSConfig, mine: list[float],
                  staleness: dict[int, int]) -> dict[str, Any]:
    """Every surviving rank: sum over them (two all-reduces) the workers' rates, bytes,
    sleeps, compute and step times and the servers' traffic and staleness histograms.
    ``mine``: rate, wire bytes/step, dense bytes/step, straggler sleep, compute s/step, server
    bytes sent, received, then one mean step time per worker (zero but in this worker's
    slot, and a lost worker's). Means are over the surviving workers."""
    comm = team.comm
    top = torch.tensor([max(staleness, default=-1)], dtype=torch.float64)
    comm.all_reduce(top, op="max")
    bins = [0.0] * (int(top) + 1)
    for k, n in staleness.items():
        bins[k] = float(n)
    sums = torch.tensor(mine + bins, dtype=torch.float64)
    comm.all_reduce(sums)
    rate, wire, dense, sleep, compute, sent, recv, *rest = sums.tolist()
    step_s, hist = rest[:roles.num_workers], rest[roles.num_workers:]
    w = len(team.workers)
    histogram = {k: int(n) for k, n in enumerate(hist) if n}
    updates = sum(histogram.values())
    return {"samples_per_s": rate, "mode": config.mode, "workers": roles.num_workers,
            "lost_workers": list(team.lost),
            "servers": roles.num_servers, "staleness_bound": config.bound,
            "worker_bytes_per_step": wire / w, "dense_bytes_per_step": dense / w,
            "straggler": {str(r): f for r, f in config.straggler.items()},
            "straggler_every": config.straggler_every,
            "straggler_sleep_s": sleep, "server_bytes_sent": sent, "server_bytes_recv": recv,
            "compute_s_per_step": compute / w, "worker_step_s": step_s,
            "staleness": {str(k): n for k, n in histogram.items()},
            "staleness_mean": sum(k * n for k, n in histogram.items()) / updates
            if updates else 0.0, "staleness_max": max(histogram, default=0)}
