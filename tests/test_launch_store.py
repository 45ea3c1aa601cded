"""Node rank 0's rendezvous store listens on one address (loopback on one node), and workers
are spawned without running Python between fork and exec."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from disttrain.launch import ranks, store
from disttrain.launch.cli import build_config, configure
from disttrain.launch.config import LaunchConfig, LaunchError

SCRIPT = str(Path(__file__).parent / "launch_scripts" / "plain.py")


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp*) of sockets listening on ``port``."""
    found = []
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        if table.exists():
            for row in table.read_text().splitlines()[1:]:
                address, hex_port = row.split()[1].rsplit(":", 1)
                if row.split()[3] == "0A" and int(hex_port, 16) == port:
                    found.append(address)
    return found


def test_bind_address_is_where_the_workers_connect():
    assert store.bind_address(LaunchConfig(SCRIPT)) == "127.0.0.1"
    multi = dict(nnodes=2, master_addr="10.0.0.1", master_port=29500)
    assert store.bind_address(LaunchConfig(SCRIPT, **multi)) == "10.0.0.1"
    assert store.bind_address(LaunchConfig(SCRIPT, **multi, store_bind_addr="0.0.0.0")) == \
        "0.0.0.0"
    with pytest.raises(ValueError, match="--store-bind-addr must be an address"):
        LaunchConfig(SCRIPT, store_bind_addr=" ")


def test_cli_flag_reaches_the_config():
    parser = argparse.ArgumentParser()
    configure(parser.add_subparsers())
    args = parser.parse_args(["launch", "--nnodes", "2", "--node-rank", "0", "--master-addr",
                              "gw.example", "--master-port", "29500", "--store-bind-addr",
                              "10.1.2.3", SCRIPT])
    assert build_config(args).store_bind_addr == "10.1.2.3"


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_store_serves_clients_on_loopback_only():
    listener = store.open_listener("127.0.0.1", 0)
    port = listener.getsockname()[1]
    server = store.host_store(listener, timeout_s=30)
    client = dist.TCPStore("127.0.0.1", port, None, False)
    client.set("key", "value")
    assert server.get("key") == b"value"
    assert _listening(port) == ["0100007F"]


def test_listener_errors_say_what_to_change():
    with pytest.raises(LaunchError, match=r"not an address of this machine.*--store-bind-addr"):
        store.open_listener("192.0.2.1", 0)  # TEST-NET-1: never a local address
    with store.open_listener("127.0.0.1", 0) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(LaunchError, match=f"--master-port {port} is already in use"):
            store.open_listener("127.0.0.1", port)
    with pytest.raises(LaunchError, match=r"cannot resolve 'no-such-host\.invalid'"):
        store.open_listener("no-such-host.invalid", 0)


def test_workers_are_spawned_without_preexec_fn(monkeypatch):
    """preexec_fn runs Python in the forked child, which may deadlock when the launcher
    has threads (the store's server thread does): the parent-death signal is set by the
    exec wrapper instead, and the worker's own command follows it unchanged."""
    seen = {}

    class Recorder:
        def __init__(self, argv, **kwargs):
            seen.update(argv=argv, **kwargs)

    monkeypatch.setattr(ranks.subprocess, "Popen", Recorder)
    ranks.Worker(0, 0, [sys.executable, "train.py", "--lr", "1"], {})
    assert seen.get("preexec_fn") is None and seen["start_new_session"]
    if sys.platform.startswith("linux"):
        assert seen["argv"][-3:] == ["train.py", "--lr", "1"]
        assert seen["argv"][seen["argv"].index(ranks._DEATHSIG) + 1] == str(
            ranks.os.getpid())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_deathsig_wrapper_sets_the_signal_and_keeps_the_pid():
    """Through the wrapper, the exec'd program has the same pid and PR_GET_PDEATHSIG says
    SIGTERM (15)."""
    probe = ("import ctypes, os; v = ctypes.c_int(); "
             "ctypes.CDLL(None).prctl(2, ctypes.byref(v)); print(os.getpid(), v.value)")
    child = subprocess.Popen(ranks.with_parent_death_signal([sys.executable, "-c", probe]),
                             stdout=subprocess.PIPE, text=True)
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0
    assert out.split() == [str(child.pid), "15"]

