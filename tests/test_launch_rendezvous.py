"""Meeting and blaming, without launching ranks: derived-port collisions, ranks that never
join, and the check-in verdict on dead, stopped and unreachable peers (comm.checkin)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from disttrain.comm import liveness
from disttrain.comm.checkin import check_in
from disttrain.launch import rendezvous
from disttrain.launch.placement import PORT_BASE, PORT_SPAN, Placement

pytestmark = pytest.mark.timeout(120)


def _free_run(length: int, start: int = PORT_BASE + 12345) -> int:
    """A port in the derived range followed by ``length - 1`` free ones."""
    for first in range(start, PORT_BASE + PORT_SPAN - length, 97):
        socks = []
        try:
            for port in range(first, first + length):
                sock = socket.socket()
                sock.bind(("127.0.0.1", port))
                socks.append(sock)
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
        return first
    raise RuntimeError("no free ports")


def _placement(rank: int, port: int, rendezvous_id: str) -> Placement:
    return Placement(rank, 2, rank, 2, "127.0.0.1", port, "slurm", rendezvous_id)


def test_a_taken_derived_port_moves_the_rendezvous_to_the_next_candidate():
    """Candidate 0 is held by something that is not a store, candidate 1 by another job's
    store: rank 0 serves on candidate 2, and rank 1 finds it there (not in the others)."""
    first = _free_run(3)
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", first))
    squatter.listen()
    other = rendezvous.open_store(_placement(0, first, "slurm-1.0"), 10, agent_store=False)
    assert other.port == first + 1  # that job moved once already
    stores: dict[int, Any] = {}

    def meet(rank: int) -> None:
        store = rendezvous.open_store(_placement(rank, first, "slurm-1.1"), 30,
                                      agent_store=False)
        rendezvous.join(store, rank, 2, 30)
        stores[rank] = store

    try:
        threads = [threading.Thread(target=meet, args=(r,)) for r in (1, 0)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert sorted(stores) == [0, 1]
        assert stores[0].port == stores[1].port == first + 2
        assert stores[1].get(rendezvous.ID_KEY) == b"slurm-1.1"
        assert not other.check([liveness.PROC_KEY + "0"])  # nothing leaked into the other job
    finally:
        squatter.close()


def test_every_candidate_taken_is_a_clear_error():
    first = _free_run(8)
    held = []
    try:
        for port in range(first, first + 8):
            sock = socket.socket()
            sock.bind(("127.0.0.1", port))
            sock.listen()
            held.append(sock)
        with pytest.raises(rendezvous.RendezvousError, match="is in use on this machine; set "
                                                             "MASTER_PORT to a free port"):
            rendezvous.open_store(_placement(0, first, "slurm-2.0"), 5, agent_store=False)
    finally:
        for sock in held:
            sock.close()


IMPOSTOR = """
import os, sys, time
import torch.distributed as dist
port, label = int(sys.argv[1]), sys.argv[2]
os.setgid(54321)
os.setuid(54321)  # the listening socket below is another user's
store = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
store.set("disttrain/rendezvous_id", label)  # copied from the public job id
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="playing another user needs root")
def test_a_store_another_user_serves_with_this_job_s_id_is_refused():
    """Another user of the master's host listens first on candidate 0 with a store labelled
    with this job's (public) id. Rank 0 refuses, naming the port and the user, instead of
    serving on candidate 1 while the other ranks join the impostor; a rank on this host
    does not join the impostor either."""
    first = _free_run(2)
    impostor = subprocess.Popen([sys.executable, "-c", IMPOSTOR, str(first), "slurm-44.0"],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert impostor.stdout is not None and impostor.stdout.readline() == "ready\n"
        with pytest.raises(rendezvous.RendezvousError,
                           match=f"port {first} .* held by another user \\(uid 54321\\)"):
            rendezvous.open_store(_placement(0, first, "slurm-44.0"), 5, agent_store=False)
        with pytest.raises(rendezvous.RendezvousError, match="no rendezvous store of"):
            rendezvous.open_store(_placement(1, first, "slurm-44.0"), 2, agent_store=False)
    finally:
        impostor.kill()
        impostor.wait()


def test_rank_0_s_error_names_the_port_it_serves_on(tmp_path):
    """The job's first derived port is taken (another job of ours), so rank 0 serves on the
    next; when rank 1 never comes, rank 0's error must name that port, not the first."""
    job, first = _job_with_free_ports(2)
    held = socket.socket()
    held.bind(("127.0.0.1", first))
    held.listen()
    env = {**{k: v for k, v in os.environ.items()
              if not k.startswith(("SLURM_", "MASTER_", "RANK", "WORLD_SIZE", "DISTTRAIN_"))},
           "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": job,
           "MASTER_ADDR": "127.0.0.1", "DISTTRAIN_INIT_TIMEOUT": "2",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    try:
        done = subprocess.run([sys.executable, "-c", "import disttrain; disttrain.init()"],
                              capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    finally:
        held.close()
    lines = [x for x in done.stderr.splitlines() if "could not join the process group" in x]
    assert lines and f"127.0.0.1:{first + 1}: " in lines[-1], done.stderr[-2000:]


def _job_with_free_ports(count: int) -> tuple[str, int]:
    """A Slurm job id whose step 0 derives a first port with ``count`` free ports from it."""
    from disttrain.launch.placement import derived_port

    for j in range(os.getpid(), os.getpid() + 10**5):
        first = derived_port(f"slurm-{j}.0")
        if first + count <= PORT_BASE + PORT_SPAN and _free_run(count, first) == first:
            return str(j), first
    raise RuntimeError("no job id with free derived ports")


def test_ranks_that_never_join_are_named_and_whole_nodes_too():
    store = dist.HashStore()
    with pytest.raises(rendezvous.RendezvousError, match=r"^ranks \[1, 2\] did not start"):
        rendezvous.join(store, 0, 3, timeout_s=0.3)
    store = dist.HashStore()
    liveness.publish(store, 1)
    store.add(rendezvous.COUNT_KEY, 1)
    with pytest.raises(rendezvous.RendezvousError, match=r"ranks \[2, 3\] \(all of node 1\)"):
        rendezvous.join(store, 0, 4, timeout_s=0.3, ranks_per_node=2)


# ------------------------------------------------------------------ the check-in verdict
@pytest.fixture
def child():
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def _info(pid: int) -> liveness.ProcessInfo:
    return liveness.ProcessInfo("here", liveness.host_key().hex(), pid,
                                liveness.process_start_time(pid))


def test_a_stopped_peer_is_named_at_once(child):
    child.send_signal(19)  # SIGSTOP
    time.sleep(0.1)
    table = [liveness.this_process(), _info(child.pid), None]
    started = time.monotonic()
    verdict = check_in(dist.HashStore(), "p/", 0, (0, 1, 2), table, grace_s=30)
    assert verdict is not None and verdict.missing == (1,)
    assert verdict.notes[1].startswith("was stopped (SIGSTOP or a debugger; pid")
    assert time.monotonic() - started < 10  # not the 30 s grace


def test_a_dead_peer_is_named_and_other_hosts_learn_it_through_the_store(child):
    info = _info(child.pid)
    child.kill()
    child.wait()
    store = dist.HashStore()
    assert check_in(store, "p/", 0, (0, 1), [None, info], 30).missing == (1,)
    # on another host the pid means nothing: the first survivor's verdict travels
    remote = liveness.ProcessInfo("far", "elsewhere", child.pid, 0)
    verdict = check_in(store, "p/", 2, (0, 1, 2), [liveness.this_process(), remote, None], 30)
    assert verdict is not None and verdict.missing == (1,)
    assert verdict.notes[1].startswith("died (pid")


def test_everyone_checked_in_and_a_silent_rank_after_the_grace():
    store = dist.HashStore()
    store.append("p/in", "1,")
    assert check_in(store, "p/", 0, (0, 1), None, 30).missing == ()
    verdict = check_in(dist.HashStore(), "p/", 0, (0, 1), None, grace_s=0.3)
    assert verdict is not None and verdict.missing == (1,) and not verdict.notes


class _HangingStore:
    """A store whose host does not answer: every call blocks (as a TCPStore call to a
    partitioned host does, for about 15 minutes)."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args: time.sleep(3600)


def test_an_unreachable_store_names_the_ranks_on_other_hosts_within_the_grace():
    here = liveness.this_process()
    far = liveness.ProcessInfo("node1", "other-host", 1234, 1)
    started = time.monotonic()
    verdict = check_in(_HangingStore(), "p/", 0, (0, 1, 2, 3), [here, here, far, far], 1.0)
    assert time.monotonic() - started < 15  # the 1 s grace and a loaded machine, not an hour
    assert verdict is not None and verdict.missing == (2, 3)  # rank 1 runs here: not blamed
    assert "on node1: could not be reached" in verdict.notes[2]
    assert check_in(_HangingStore(), "p/", 0, (0, 1), None, 0.5) is None  # cannot tell
