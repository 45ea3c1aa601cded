"""How many intra-op threads a rank runs: the cores this process may use, shared by the ranks
of its node that share them; the same rule under every launcher.

    cores     the CPUs this process may run on (its affinity mask: srun's or mpirun's
              binding, taskset), capped by its cgroup's CPU quota (a container's
              ``--cpus``, Slurm's cgroup), at least 1
    sharing   the ranks on this host with the same affinity mask: counted in the rendezvous
              store by ``disttrain.init()`` (ranks bound to their own cores share nothing);
              ``disttrain run -n`` and ``disttrain launch`` know their ranks share the mask
    threads   max(1, cores // sharing); an explicit OMP_NUM_THREADS wins

torch's default is every core for every rank: two ranks on two cores would run four busy
threads, and the time slicing between them cost a DDP job under ``srun`` two thirds of its
throughput (docs/launching.md). ``disttrain launch`` writes the answer into its workers'
OMP_NUM_THREADS, so a script that never calls ``disttrain.init()`` gets it too; torchrun sets
OMP_NUM_THREADS=1 for several workers of its own, which is then respected like any value.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path

OMP_VAR = "OMP_NUM_THREADS"
CGROUP_ROOT = "/sys/fs/cgroup"


def affinity() -> frozenset[int]:
    """The CPUs this process may run on (all of them where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def cgroup_cpu_limit(root: str = CGROUP_ROOT, self_cgroup: str = "/proc/self/cgroup"
                     ) -> float | None:
    """The CPU quota of this process's cgroup and its ancestors, in cores (cgroup v2
    ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``); None when unlimited or
    unknown."""
    try:
        lines = Path(self_cgroup).read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            limits += _walk(Path(root), path, _v2_limit)
        elif "cpu" in controllers.split(","):
            base = next((Path(root) / n for n in (controllers, "cpu,cpuacct", "cpu")
                         if (Path(root) / n).is_dir()), None)
            if base is not None:
                limits += _walk(base, path, _v1_limit)
    return min(limits) if limits else None


def _walk(base: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """``read(directory)`` for the cgroup ``path`` under ``base`` and each of its ancestors."""
    found = []
    parts = [p for p in path.strip("/").split("/") if p]
    for depth in range(len(parts), -1, -1):
        value = read(base.joinpath(*parts[:depth]))
        if value is not None:
            found.append(value)
    return found


def _v2_limit(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_limit(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def usable_cores(cpus: frozenset[int] | None = None, limit: float | None = None) -> int:
    """The cores this process may use: its affinity mask, capped by its cgroup quota."""
    count = len(cpus if cpus is not None else affinity())
    quota = limit if limit is not None else cgroup_cpu_limit()
    if quota is not None:
        count = min(count, max(1, math.floor(quota + 1e-9)))
    return max(1, count)


def threads_per_rank(sharing: int, env: Mapping[str, str] | None = None,
                     cores: int | None = None) -> int:
    """Threads for one of ``sharing`` ranks on the same cores (see the module docstring)."""
    explicit = (os.environ if env is None else env).get(OMP_VAR, "").strip()
    if explicit.isdigit() and int(explicit) > 0:
        return int(explicit)
    cores = usable_cores() if cores is None else cores
    return max(1, cores // max(1, sharing))


def mask_key(cpus: frozenset[int] | None = None) -> str:
    """A short name for an affinity mask (``0-3,8``): equal exactly for equal masks."""
    ids = sorted(cpus if cpus is not None else affinity())
    runs: list[str] = []
    start = prev = ids[0] if ids else 0
    for cpu in [*ids[1:], -2]:
        if cpu != prev + 1:
            runs.append(f"{start}-{prev}" if prev != start else str(start))
            start = cpu
        prev = cpu
    return ",".join(runs)


def set_threads(threads: int) -> None:
    """Apply ``threads`` to torch's intra-op pool (what OMP_NUM_THREADS sets at start-up)."""
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
