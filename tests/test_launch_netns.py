"""Across machines: two network namespaces joined by a veth pair play two hosts (10.213.0.1
and 10.213.0.2); ``disttrain launch --nnodes 2 --node-rank K`` runs in each and their
workers all-reduce across the link. Skipped, with the reason, where namespaces cannot be
made (not root, no ``ip``, no permission)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
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


def test_a_partition_ends_both_nodes_naming_the_other_side(two_hosts, tmp_path):
    """2 nodes × 2 ranks all-reduce in a loop; the link between them goes down. Both
    launchers exit within timeout + 10 s of the cut, each naming the other node's ranks in
    its headline; node 1, whose rendezvous store sat beyond the cut, no longer waits for
    the kernel to give up on it (about 15 minutes), and no process is left in either
    namespace."""
    names, links = two_hosts
    timeout_s = 5.0
    env = {**os.environ, "DISTTRAIN_TIMEOUT": str(timeout_s), "DISTTRAIN_INIT_TIMEOUT": "60"}
    env.pop("GLOO_SOCKET_IFNAME", None)
    procs, errors = [], []
    try:
        for node_rank, name in enumerate(names):
            errors.append(open(tmp_path / f"node{node_rank}.err", "w"))
            argv = ["ip", "netns", "exec", name, sys.executable, "-m", "disttrain", "launch",
                    "--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", HOSTS[0],
                    "--master-port", "29513", "-n", "2", str(SCRIPTS / "loop.py")]
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=errors[-1],
                                          text=True, env=env, start_new_session=True))
        for proc in procs:  # both ranks of each node have all-reduced once
            assert proc.stdout is not None
            ready = 0
            for line in proc.stdout:
                ready += line.rstrip().endswith("] ready")
                if ready == 2:
                    break
            assert ready == 2, (tmp_path / "node0.err").read_text()[-3000:]
        cut = time.monotonic()
        for name, link in zip(names, links):
            assert _ip("-n", name, "link", "set", "dev", link, "down").returncode == 0
        ended = [None, None]
        while any(e is None for e in ended) and time.monotonic() - cut < 120:
            for i, proc in enumerate(procs):
                if ended[i] is None and proc.poll() is not None:
                    ended[i] = time.monotonic() - cut
            time.sleep(0.1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        for f in errors:
            f.close()
    reports = [(tmp_path / f"node{n}.err").read_text() for n in (0, 1)]
    for node_rank, (took, report) in enumerate(zip(ended, reports)):
        # the timeout and the launcher's 10 s to stop the rest, plus a loaded machine's
        # margin; a launcher that never gave up would wait for the 120 s cut-off
        assert took is not None and took < timeout_s + 10 + 20, (took, report[-3000:])
        others = "[2, 3]" if node_rank == 0 else "[0, 1]"
        assert f"disttrain launch: ranks {others} failed first; they did not respond (on " \
               "another node)" in report, report[-3000:]
        assert procs[node_rank].returncode != 0
    assert "could not be reached: the rendezvous store does not answer" in reports[1]
    for name in names:
        assert _ip("netns", "pids", name).stdout.split() == [], name
    print(f"partition: node 0 ended {ended[0]:.1f}s, node 1 {ended[1]:.1f}s after the cut")


def test_a_single_host_job_keeps_gloo_on_loopback(tmp_path):
    """The host name resolves to a LAN address (a private /etc/hosts and host name, in
    mount and UTS namespaces of their own), where Gloo would listen by itself: every
    connection of a job whose ranks all run here stays on 127.0.0.1."""
    from disttrain.launch.netif import route_source_address

    lan = route_source_address("192.0.2.1")
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) for a private /etc/hosts")
    if lan is None or lan.startswith("127."):
        pytest.skip("this host has no non-loopback IPv4 address to resolve its name to")
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{lan} lanhost44\n")
    launch = f"{sys.executable} -m disttrain launch -n 2 {SCRIPTS / 'gloo_addresses.py'}"
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])  # this tree's disttrain
    done = subprocess.run(["unshare", "--mount", "--uts", "sh", "-c",
                           f"mount --bind {hosts} /etc/hosts && hostname lanhost44 && "
                           f"exec {launch}"], capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S, env=env, cwd=tmp_path)
    if "unshare: " in done.stderr or "mount: " in done.stderr:
        pytest.skip(f"no private /etc/hosts here: {done.stderr.strip()[:200]}")
    assert done.returncode == 0, done.stderr[-3000:]
    reports = json_lines(done.stdout)
    assert sorted(reports) == [0, 1]
    for report in reports.values():
        assert report["addresses"] == ["127.0.0.1"], report
