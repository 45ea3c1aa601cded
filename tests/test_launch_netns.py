"""Across machines: two network namespaces joined by a veth pair play two hosts (10.213.0.1
and 10.213.0.2); ``disttrain launch --nnodes 2 --node-rank K`` runs in each and their
workers all-reduce across the link. Skipped, with the reason, where namespaces cannot be
made (not root, no ``ip``, no permission)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any

import pytest

from tests.launch_scripts.harness import LAUNCH_TIMEOUT_S, SCRIPTS, json_lines

pytestmark = pytest.mark.timeout(240)
HOSTS = ("10.213.0.1", "10.213.0.2")


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)


@pytest.fixture
def two_hosts():
    """Namespace names and their veth interfaces; removed afterwards."""
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command (iproute2) is not installed")
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    tag = f"{os.getpid() % 100000}"
    names = (f"dt{tag}a", f"dt{tag}b")
    links = (f"dtv{tag}a", f"dtv{tag}b")
    made = []
    try:
        for name in names:
            done = _ip("netns", "add", name)
            if done.returncode != 0:
                pytest.skip(f"`ip netns add` failed: {done.stderr.strip()}")
            made.append(name)
        steps = [("link", "add", links[0], "type", "veth", "peer", "name", links[1])]
        for name, link, host in zip(names, links, HOSTS):
            steps += [("link", "set", link, "netns", name),
                      ("-n", name, "addr", "add", f"{host}/24", "dev", link),
                      ("-n", name, "link", "set", link, "up"),
                      ("-n", name, "link", "set", "lo", "up")]
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                pytest.skip(f"`ip {' '.join(step)}` failed: {done.stderr.strip()}")
        yield names, links
    finally:
        for name in made:
            _ip("netns", "del", name)  # takes its end of the veth pair with it


def launch_on_both(names: list[str], port: str, target: list[str], ranks_per_node: int,
                   drop_env: tuple[str, ...] = ("GLOO_SOCKET_IFNAME",),
                   cwd: str | None = None) -> dict[int, Any]:
    """`disttrain launch --nnodes 2` once inside each namespace, master on the first; every
    launch must exit 0. Returns each rank's JSON report (one JSON line per rank on stdout).
    ``drop_env``: variables init() must work out by itself (e.g. the veth interface)."""
    procs = []
    try:
        for node_rank, name in enumerate(names):
            argv = ["ip", "netns", "exec", name, sys.executable, "-m", "disttrain", "launch",
                    "--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", HOSTS[0],
                    "--master-port", port, "-n", str(ranks_per_node), *target]
            env = {**os.environ, "DISTTRAIN_TIMEOUT": "60"}
            for var in drop_env:
                env.pop(var, None)
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, env=env, cwd=cwd, start_new_session=True))
        outputs = [p.communicate(timeout=LAUNCH_TIMEOUT_S) for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    for proc, (_, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-3000:]
    return {**json_lines(outputs[0][0]), **json_lines(outputs[1][0])}


def test_all_reduce_across_two_hosts(two_hosts):
    names, links = two_hosts
    # each namespace has its own, empty port space; init() must find the veth by itself
    reports = launch_on_both(names, "29511", [str(SCRIPTS / "report_placement.py")], 1)
    assert sorted(reports) == [0, 1]
    for rank, report in reports.items():
        assert (report["rank"], report["world_size"], report["sum"]) == (rank, 2, 3.0)
        assert report["master_addr"] == HOSTS[0]
        assert report["gloo_ifname"] == links[rank]  # the interface towards the master
