"""What ``disttrain launch`` starts, validated before anything is spawned.

Every mistake gets one message saying what to change: no workers (``-n 0``), a missing
script, ``-m`` with a ``.py`` file, a node rank outside ``0..nnodes-1`` or given to a
single-node launch, a multi-node launch without the master's address or port, a port that
is already taken.
"""

from __future__ import annotations

import errno
import importlib.util
import math
import os
import socket
import sys
from dataclasses import dataclass


class LaunchError(RuntimeError):
    """The job could not be started (for a reason found only when trying)."""


@dataclass(frozen=True)
class LaunchConfig:
    """One ``disttrain launch`` on one node."""

    target: str  # a script path, or a module name when ``module``
    nproc_per_node: int = 1
    args: tuple[str, ...] = ()
    module: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None  # None: 127.0.0.1 (single node only)
    master_port: int | None = None  # None: a free port (single node only)
    # Where node rank 0's rendezvous store listens. None: the address the workers connect
    # to (master_addr, else 127.0.0.1), so nothing else on the network reaches it.
    store_bind_addr: str | None = None
    grace_s: float = 5.0  # between SIGTERM and SIGKILL when stopping workers
    run_dir: str | None = None  # error records and flight dumps; None: a new temp dir
    prefix_output: bool = True
    # Parameter servers started beside the workers (ranks nproc..nproc+servers-1); every
    # process gets DISTTRAIN_PS_SERVERS so that roles.servers_from_env() knows the split.
    servers: int = 0
    max_restarts: int = 0  # whole-job restarts after a failure (disttrain.launch.restarts)
    # A worker rank (0..nproc-1 of a --servers job) that fails or dies does not stop the job:
    # ps-async and ps-ssp go on without it (docs/parameter_server.md, "When a worker dies").
    tolerate_worker_loss: bool = False

    def __post_init__(self) -> None:
        _positive_int("-n/--nproc-per-node", self.nproc_per_node, "the number of workers on "
                      "this node, e.g. -n 2")
        self._check_servers()
        _positive_int("--nnodes", self.nnodes, "the number of machines in the job")
        self._check_node_rank()
        self._check_target()
        if self.nnodes > 1 and not self.master_addr:
            raise ValueError(f"--nnodes {self.nnodes} needs --master-addr: the address of the "
                             "machine running node rank 0, reachable from every node")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError(f"--nnodes {self.nnodes} needs --master-port: a free TCP port on "
                             "the machine of node rank 0, the same on every node")
        if self.master_port is not None and not (
                isinstance(self.master_port, int) and 0 < self.master_port < 65536):
            raise ValueError(f"--master-port {self.master_port} is not a TCP port (1..65535)")
        if self.store_bind_addr is not None and (
                not isinstance(self.store_bind_addr, str) or not self.store_bind_addr.strip()):
            raise ValueError(f"--store-bind-addr must be an address of this machine (e.g. "
                             f"10.0.0.1, or 0.0.0.0 for every interface), got "
                             f"{self.store_bind_addr!r}")
        if not (isinstance(self.grace_s, (int, float)) and 0 <= self.grace_s < math.inf):
            raise ValueError(f"--grace-period must be a non-negative number of seconds, got "
                             f"{self.grace_s!r}")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or (
                self.max_restarts < 0):
            raise ValueError(f"--max-restarts must be a whole number ≥ 0 (how often to restart "
                             f"the job after a failure), got {self.max_restarts!r}")

    def _check_servers(self) -> None:
        if isinstance(self.servers, bool) or not isinstance(self.servers, int) or (
                self.servers < 0):
            raise ValueError(f"--servers must be a whole number ≥ 0 (parameter-server "
                             f"processes to start beside the workers), got {self.servers!r}")
        if not isinstance(self.tolerate_worker_loss, bool):
            raise ValueError(f"tolerate_worker_loss must be True or False, got "
                             f"{self.tolerate_worker_loss!r}")
        if self.tolerate_worker_loss and not self.servers:
            raise ValueError("--tolerate-worker-loss needs --servers S: the launcher must know "
                             "which ranks are parameter-server workers (the first -n) whose "
                             "loss the job outlives")
        if self.servers and self.nnodes > 1:
            raise ValueError("--servers starts the servers on this one machine; across "
                             "machines count them in -n on every node and export "
                             "DISTTRAIN_PS_SERVERS=S (the last S ranks of the job serve)")

    def _check_node_rank(self) -> None:
        if isinstance(self.node_rank, bool) or not isinstance(self.node_rank, int):
            raise ValueError(f"--node-rank must be an integer, got {self.node_rank!r}")
        if self.nnodes == 1 and self.node_rank != 0:
            raise ValueError(f"--node-rank {self.node_rank} needs --nnodes > 1: this is a "
                             "single-node launch (add --nnodes N, or drop --node-rank)")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} is out of range for --nnodes "
                             f"{self.nnodes}: node ranks are 0..{self.nnodes - 1}")

    def _check_target(self) -> None:
        if not self.target:
            raise ValueError("nothing to run: give a script (train.py) or -m a.module")
        if self.module:
            if self.target.endswith(".py") or os.sep in self.target:
                raise ValueError(f"-m expects a module name like 'pkg.train', not the file "
                                 f"{self.target!r}; drop -m to run a script")
            top = self.target.split(".")[0]
            if not top.isidentifier() or importlib.util.find_spec(top) is None:
                raise ValueError(f"module {self.target!r} was not found (no top-level package "
                                 f"{top!r} on the Python path of {sys.executable})")
        elif not os.path.isfile(self.target):
            hint = " (to run a module, use -m)" if not self.target.endswith(".py") else ""
            raise ValueError(f"script {self.target!r} does not exist{hint}")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node + self.servers

    @property
    def local_processes(self) -> int:
        """Processes this launcher starts: the workers, then the servers (single node)."""
        return self.nproc_per_node + self.servers

    @property
    def losable_ranks(self) -> frozenset[int]:
        """Ranks whose failure does not stop the job (``tolerate_worker_loss``)."""
        return frozenset(range(self.nproc_per_node)) if self.tolerate_worker_loss else (
            frozenset())

    @property
    def hosts_store(self) -> bool:
        """Node rank 0's launcher hosts the rendezvous store (as torchrun's agent does)."""
        return self.node_rank == 0

    def command(self) -> list[str]:
        """The worker command line (the same for every local rank)."""
        if self.module:
            return [sys.executable, "-m", self.target, *self.args]
        return [sys.executable, self.target, *self.args]


def _positive_int(flag: str, value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{flag} must be a positive integer ({what}), got {value!r}")


def free_port() -> int:
    """A TCP port nobody listens on right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def port_in_use(port: int) -> LaunchError:
    """The error for a ``--master-port`` that another process listens on."""
    return LaunchError(f"--master-port {port} is already in use on this machine (another "
                       "job, or a leftover process?); choose another port, or omit "
                       "--master-port on a single node to get a free one")


def check_port_free(port: int) -> None:
    """Raise LaunchError when ``port`` cannot be listened on here (on any address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no conflict
        try:
            sock.bind(("", port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise port_in_use(port) from None
            raise LaunchError(f"cannot listen on --master-port {port}: {exc}") from None
