"""Threads per rank, the same rule under every launcher (launch/threads.py): the cores this
process may use (affinity, cgroup quota), shared by the ranks of the host on the same cores;
an explicit OMP_NUM_THREADS wins. The rule without processes, then two ranks started the
way mpirun starts them, which kept torch's default (every core) before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from disttrain.launch import threads
from disttrain.launch.config import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_the_rule_shares_usable_cores_and_respects_an_explicit_value():
    assert threads.threads_per_rank(2, {}, cores=8) == 4
    assert threads.threads_per_rank(3, {}, cores=8) == 2
    assert threads.threads_per_rank(4, {}, cores=2) == 1  # never 0
    assert threads.threads_per_rank(2, {"OMP_NUM_THREADS": "3"}, cores=8) == 3
    assert threads.threads_per_rank(2, {"OMP_NUM_THREADS": ""}, cores=8) == 4
    assert threads.usable_cores(frozenset(range(16)), limit=2.5) == 2  # a container's --cpus
    assert threads.usable_cores(frozenset({3}), limit=None) == 1
    assert threads.usable_cores(frozenset(range(4)), limit=0.5) == 1


def test_masks_are_named_exactly():
    assert threads.mask_key(frozenset({0, 1, 2, 3, 8, 10, 11})) == "0-3,8,10-11"
    assert threads.mask_key(frozenset({5})) == "5"


@pytest.mark.parametrize("version", [1, 2])
def test_cgroup_quotas_are_read_up_the_hierarchy(tmp_path, version):
    if version == 2:
        (tmp_path / "self").write_text("0::/job/step\n")
        for path, value in (("job", "300000 100000"), ("job/step", "max 100000")):
            (tmp_path / path).mkdir(parents=True)
            (tmp_path / path / "cpu.max").write_text(value + "\n")
    else:
        (tmp_path / "self").write_text("4:memory:/x\n2:cpu,cpuacct:/job\n")
        group = tmp_path / "cpu,cpuacct" / "job"
        group.mkdir(parents=True)
        (group / "cpu.cfs_quota_us").write_text("150000\n")
        (group / "cpu.cfs_period_us").write_text("100000\n")
        (tmp_path / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
    limit = threads.cgroup_cpu_limit(str(tmp_path), str(tmp_path / "self"))
    assert limit == (3.0 if version == 2 else 1.5)
    assert threads.cgroup_cpu_limit(str(tmp_path), str(tmp_path / "missing")) is None


RANK = ("import json, torch, disttrain; comm = disttrain.init(); "
        "print(json.dumps({'rank': comm.rank, 'threads': torch.get_num_threads()}), "
        "flush=True); disttrain.shutdown()")


def _placement_env(launcher: str, rank: int) -> dict[str, str]:
    if launcher == "slurm":
        return {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS": "2",
                "SLURM_TASKS_PER_NODE": "2", "SLURM_NODEID": "0", "SLURM_STEP_ID": "0",
                "SLURM_JOB_ID": str(os.getpid()), "SLURM_JOB_NODELIST": "localhost"}
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no affinity masks here")
@pytest.mark.parametrize("launcher", ["slurm", "mpi"])
def test_ranks_srun_or_mpirun_starts_share_the_cores(tmp_path, launcher):
    """Two ranks on this host with srun's (or OpenMPI's) variables and no OMP_NUM_THREADS:
    each runs usable cores // 2 threads, as under disttrain launch. Under srun they kept
    torch's default, every core (under mpirun MKL's default already divides by the local
    MPI ranks)."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(
        ("OMP_NUM_THREADS", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "SLURM_", "OMPI_",
         "DISTTRAIN_", "TORCHELASTIC"))}
    procs = []
    for rank in range(2):
        env = {**base, **_placement_env(launcher, rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "DISTTRAIN_INIT_TIMEOUT": "60",
               "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen([sys.executable, "-c", RANK], env=env, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outputs = [p.communicate(timeout=120) for p in procs]
    for proc, (_, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-2000:]
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    expected = max(1, threads.usable_cores() // 2)
    assert [r["threads"] for r in reports] == [expected, expected], reports
