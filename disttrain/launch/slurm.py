"""Slurm's view of a task (``srun``): rank, world size, node list, without calling scontrol.

``srun`` starts one process per task and tells each its place through SLURM_PROCID (the
global rank), SLURM_LOCALID (the index on its node), SLURM_NTASKS and the node list in
Slurm's compressed hostlist syntax, e.g. ``node[01-03,07],gpu5``. Rank 0 runs on the first
node of the step, so that node is the master. The port comes from MASTER_PORT or is derived
from the job id *and* the step id: two ``srun`` steps of one job may run at the same time
and must not meet on one port (see :mod:`disttrain.launch.placement` for collisions).

Only a task of a step is launched: the batch script of ``sbatch`` also sees SLURM_PROCID=0
and SLURM_NTASKS, but no SLURM_STEP_ID, and it is one process, not a rank of N.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping

from disttrain.launch.placement import (
    PartialPlacement,
    PlacementError,
    derived_port,
    parse_int,
    require,
)

NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
STEP_VARS = ("SLURM_STEP_ID", "SLURM_STEPID")


def step_id(env: Mapping[str, str]) -> str | None:
    """The step this process is a task of (None: not started by srun)."""
    for name in STEP_VARS:
        if env.get(name):
            return env[name].strip()
    return None


def detect(env: Mapping[str, str]) -> bool:
    """Whether this process is a task of an srun step."""
    return step_id(env) is not None


def batch_tasks(env: Mapping[str, str]) -> int | None:
    """SLURM_NTASKS when this is a batch script (sbatch/salloc shell) of several tasks, not
    one of them: the case where starting ranks without srun is the likely mistake."""
    if detect(env) or "SLURM_JOB_ID" not in env:
        return None
    try:
        tasks = int(env.get("SLURM_NTASKS", "1"))
    except ValueError:
        return None
    return tasks if tasks > 1 else None


def task_from_env(env: Mapping[str, str]) -> PartialPlacement:
    """This task's place, from the variables srun sets (MASTER_ADDR/PORT override)."""
    why = f"{_step_var(env)} says srun started this process (srun sets both)"
    require(env, ("SLURM_PROCID",), why)
    rank = parse_int("SLURM_PROCID", env["SLURM_PROCID"], "srun sets it to the task's rank")
    size_var = "SLURM_NPROCS" if env.get("SLURM_NPROCS") and not env.get("SLURM_NTASKS") \
        else "SLURM_NTASKS"
    require(env, (size_var,), why)
    world = parse_int(size_var, env[size_var], "srun sets it to the number of tasks")
    local_rank = (parse_int("SLURM_LOCALID", env["SLURM_LOCALID"], "srun sets it")
                  if env.get("SLURM_LOCALID") else None)
    part = PartialPlacement("slurm", rank, world, local_rank, _local_world_size(env),
                            env.get("MASTER_ADDR") or _first_node(env),
                            addr_hint="export MASTER_ADDR before srun",
                            port_hint="export MASTER_PORT before srun")
    if env.get("MASTER_PORT"):
        part.master_port = parse_int("MASTER_PORT", env["MASTER_PORT"],
                                     "set it to a free TCP port on the first node")
    elif env.get("SLURM_JOB_ID"):
        part.rendezvous_id = f"slurm-{env['SLURM_JOB_ID'].strip()}.{step_id(env)}"
        part.master_port = derived_port(part.rendezvous_id)
    if part.master_addr is None and world > 1:
        raise PlacementError("under Slurm the master is the first node of SLURM_STEP_NODELIST, "
                             "SLURM_JOB_NODELIST or SLURM_NODELIST, but none is set; set "
                             "MASTER_ADDR to the address of the node running task 0")
    return part


def _step_var(env: Mapping[str, str]) -> str:
    return next((f"{n}={env[n]}" for n in STEP_VARS if env.get(n)), "SLURM_STEP_ID")


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
