"""Slurm's view of a task (``srun``): rank, world size, node list, without calling scontrol.

``srun`` starts one process per task and tells each its place through SLURM_PROCID (the
global rank), SLURM_LOCALID (the index on its node), SLURM_NTASKS and the node list in
Slurm's compressed hostlist syntax, e.g. ``node[01-03,07],gpu5``. Rank 0 runs on the first
node of the step, so that node is the master; the port comes from MASTER_PORT or, failing
that, from the job id, so every task computes the same one without talking to the others.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from typing import NamedTuple

NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_PORT_BASE, _PORT_SPAN = 20000, 20000  # derived ports fall in 20000..39999


class SlurmTask(NamedTuple):
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None
    master_addr: str | None
    master_port: int | None


def _error(message: str) -> ValueError:
    from disttrain.launch.env import PlacementError  # env imports this module

    return PlacementError(message)


def _int(env: Mapping[str, str], name: str, fix: str) -> int:
    try:
        return int(env[name].strip())
    except ValueError:
        raise _error(f"{name}={env[name]!r} is not an integer; {fix}") from None


def task_from_env(env: Mapping[str, str]) -> SlurmTask:
    """This task's place, from the variables srun sets (MASTER_ADDR/PORT override)."""
    rank = _int(env, "SLURM_PROCID", "srun sets it to the task's global rank")
    size_var = "SLURM_NTASKS" if "SLURM_NTASKS" in env else "SLURM_NPROCS"
    if size_var not in env:
        raise _error("SLURM_PROCID is set but SLURM_NTASKS is not; run the script with srun "
                     "(which sets both), or set RANK/WORLD_SIZE instead")
    world = _int(env, size_var, "srun sets it to the number of tasks")
    local_rank = _int(env, "SLURM_LOCALID", "srun sets it") if "SLURM_LOCALID" in env else 0
    local_world = _local_world_size(env)
    addr = env.get("MASTER_ADDR") or _first_node(env)
    port = None
    if env.get("MASTER_PORT"):
        port = _int(env, "MASTER_PORT", "set it to a free TCP port on the first node")
    elif env.get("SLURM_JOB_ID"):
        port = derived_port(_int(env, "SLURM_JOB_ID", "Slurm sets it to the job id"))
    if addr is None and world > 1:
        raise _error("under Slurm the master is the first node of SLURM_STEP_NODELIST, "
                     "SLURM_JOB_NODELIST or SLURM_NODELIST, but none is set; set MASTER_ADDR "
                     "to the address of the node running task 0")
    return SlurmTask(rank, world, local_rank, local_world, addr, port)


def derived_port(job_id: int) -> int:
    """A rendezvous port every task of job ``job_id`` derives alike (20000..39999)."""
    return _PORT_BASE + job_id % _PORT_SPAN


def _first_node(env: Mapping[str, str]) -> str | None:
    for name in NODELIST_VARS:
        if env.get(name):
            hosts = expand_nodelist(env[name])
            return hosts[0] if hosts else None
    return None


def _local_world_size(env: Mapping[str, str]) -> int | None:
    """Tasks on this node, from SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE ("2(x3),1")."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return None
    try:
        per_node = expand_tasks_per_node(spec)
        node = int(env.get("SLURM_NODEID", "0"))
        return per_node[node] if 0 <= node < len(per_node) else per_node[0]
    except (ValueError, IndexError):
        return None


def expand_tasks_per_node(spec: str) -> list[int]:
    """``"2(x3),1"`` → ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not match:
            raise ValueError(f"cannot read tasks-per-node item {item!r} in {spec!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed hostlist: ``"node[01-03,07],gpu5"`` → ``["node01", "node02",
    "node03", "node07", "gpu5"]``. Zero padding is kept; several bracket groups in one name
    (``rack[1-2]-n[1-2]``) expand to every combination, in order."""
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        hosts += _expand_one(item)
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets."""
    items: list[str] = []
    depth = start = 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in node list {text!r}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in node list {text!r}")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_one(pattern: str) -> list[str]:
    parts = re.split(r"\[([^\]]*)\]", pattern)  # literal, range, literal, range, ..., literal
    choices: list[list[str]] = []
    for i, part in enumerate(parts):
        choices.append(_expand_ranges(part, pattern) if i % 2 else [part])
    return ["".join(combo) for combo in itertools.product(*choices)]


def _expand_ranges(ranges: str, pattern: str) -> list[str]:
    out: list[str] = []
    for item in ranges.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", item)
        if not match:
            raise ValueError(f"cannot read range {item!r} in node list pattern {pattern!r}")
        lo_text, hi_text = match.group(1), match.group(2) or match.group(1)
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise ValueError(f"range {item!r} in {pattern!r} runs backwards")
        width = len(lo_text)
        out += [str(n).zfill(width) for n in range(lo, hi + 1)]
    return out
