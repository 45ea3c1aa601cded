"""A real single-node Slurm for the launcher tests: munged, slurmctld and slurmd under a
temporary directory, with their own ports, socket and key, stopped by pid.

Everything lives under ``root`` (no /etc, /run or /var file is touched), so several test
sessions on one machine do not meet. ``start`` raises :class:`Unavailable` with the reason
when a binary is missing or a daemon does not come up; the fixture turns that into a skip.
Run as a module it starts a cluster, prints ``export SLURM_CONF=...`` and waits (Ctrl-C
stops it): handy to try ``srun`` by hand.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sinfo")
CPUS = 4  # more than this machine's 2 cores (config_overrides): 3-4 tasks fit on one node


class Unavailable(RuntimeError):
    """Slurm cannot run here; the message says why."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class SlurmCluster:
    root: Path
    host: str = field(default_factory=socket.gethostname)
    pid_files: list[Path] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment in which srun/sinfo talk to this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def srun(self, *args: str, timeout: float = 120, env: dict[str, str] | None = None,
             ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["srun", *args], capture_output=True, text=True, timeout=timeout,
                              env={**self.env, **(env or {})})

    def start(self, timeout_s: float = 60.0) -> None:
        missing = [b for b in BINARIES if shutil.which(b) is None]
        if missing:
            raise Unavailable(f"Slurm is not installed ({', '.join(missing)} missing; "
                              "apt-get install slurm-wlm munge)")
        if os.geteuid() != 0:
            raise Unavailable("the test cluster runs slurmd as root; not root here")
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._start_munge()
        self._write_conf()
        self._daemon(["slurmctld", "-i", "-f", str(self.conf)], "slurmctld.pid")
        self._daemon(["slurmd", "-f", str(self.conf), "-N", self.host], "slurmd.pid")
        self._wait_idle(timeout_s)

    def _start_munge(self) -> None:
        munge = self.root / "munge"
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        munge.chmod(0o700)
        self.socket = munge / "munge.socket"
        self._daemon(["munged", "--force", f"--key-file={key}", f"--socket={self.socket}",
                      f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
                      f"--seed-file={munge / 'munged.seed'}"], None, munge / "munged.pid")

    def _write_conf(self) -> None:
        r = self.root
        lines = [
            "ClusterName=disttraintest", f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge",
            f"AuthInfo=socket={self.socket}", "CredType=cred/munge", "MpiDefault=none",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "ReturnToService=2",
            "SlurmdParameters=config_overrides", "SchedulerType=sched/builtin",
            "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
            "InactiveLimit=0", "KillWait=2", "MinJobAge=10", "Waittime=0",
            f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}", f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={CPUS} State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES State=UP OverSubscribe=YES "
            "MaxTime=INFINITE",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _daemon(self, argv: list[str], pid_name: str | None, pid_file: Path | None = None,
                ) -> None:
        pid_file = pid_file or self.root / str(pid_name)
        log = open(self.root / "log" / f"{Path(argv[0]).name}.out", "ab")
        with log:
            done = subprocess.run(argv, stdout=log, stderr=log, env=self.env, timeout=30)
        if done.returncode != 0:
            raise Unavailable(f"{argv[0]} did not start (exit {done.returncode}); see "
                              f"{self.root / 'log'}")
        self.pid_files.append(pid_file)
        deadline = time.monotonic() + 10
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            done = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True,
                                  env=self.env, timeout=30)
            state = done.stdout.strip() or done.stderr.strip()
            if state in ("idle", "mix", "alloc"):
                return
            time.sleep(0.3)
        raise Unavailable(f"the Slurm node did not become idle within {timeout_s:g}s "
                          f"(sinfo: {state!r}); see {self.root / 'log'}")

    def stop(self) -> None:
        """Stop the daemons by the pids in their pid files (never by name)."""
        pids = []
        for pid_file in reversed(self.pid_files):
            try:
                pids.append(int(pid_file.read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                continue
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        for pid in pids:
            _signal(pid, signal.SIGKILL)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


if __name__ == "__main__":
    import tempfile

    cluster = SlurmCluster(Path(tempfile.mkdtemp(prefix="disttrain-slurm-")))
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop the daemons on kill too
    try:
        cluster.start()
        print(f"export SLURM_CONF={cluster.conf}", flush=True)
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
