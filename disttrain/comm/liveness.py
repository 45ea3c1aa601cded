"""Is that rank's process running, stopped or gone? Process identities, their states, and
store calls that cannot hang.

A rank that stops answering is either dead (SIGKILL, a crash), stopped (SIGSTOP, a
debugger) or alive but busy elsewhere. The first two are facts the kernel knows, so a peer
on the same host can tell at once instead of waiting out a grace period: each rank
publishes its :class:`ProcessInfo` (host, pid, kernel start time) in the rendezvous store
when it joins (:func:`publish`), and a survivor reads ``/proc/<pid>/stat`` of a silent
peer on its own host (:func:`local_state`). The start time tells a recycled pid from the
rank's process.

Store calls go over TCP to the store's host. When that host stops answering (a network
partition, a stopped process) a ``TCPStore`` call waits until the kernel gives up on the
connection, which is about 15 minutes with Linux's default ``tcp_retries2``, whatever the
store's timeout says. :func:`bounded` runs such a call on a helper thread (torch releases
the GIL during store calls) and gives up after the caller's deadline.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

T = TypeVar("T")
PROC_KEY = "disttrain/proc/"  # + global rank: that rank's ProcessInfo as JSON

RUNNING, STOPPED, DEAD, REMOTE = "running", "stopped", "dead", "remote"


@dataclass(frozen=True)
class ProcessInfo:
    """Who a rank's process is: enough to find it again on its host."""

    host: str  # host name, for messages
    host_key: str  # equal exactly for processes that share a host and pid namespace
    pid: int
    start_time: int  # clock ticks since boot (0: unknown)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, data: bytes | str) -> ProcessInfo | None:
        """Parse a published identity (JSON only: nothing read from the network is
        unpickled); None when it is not one."""
        try:
            obj = json.loads(data)
            info = cls(str(obj["host"]), str(obj["host_key"]), int(obj["pid"]),
                       int(obj["start_time"]))
        except (ValueError, TypeError, KeyError):
            return None
        return info


def host_key() -> bytes:
    """32 bytes that are equal exactly for processes that can share memory and see each
    other's pids: same host name, same boot, same mount, pid and network namespaces.

    Two network namespaces on one machine count as two hosts."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        parts.append("no-boot-id")
    for ns in ("mnt", "pid", "net"):
        try:
            parts.append(f"{ns}:{os.stat(f'/proc/self/ns/{ns}').st_ino}")
        except OSError:
            parts.append(f"{ns}:?")
    return hashlib.sha256("\0".join(parts).encode()).digest()


def this_process() -> ProcessInfo:
    pid = os.getpid()
    return ProcessInfo(socket.gethostname(), host_key().hex(), pid, process_start_time(pid))


def process_start_time(pid: int) -> int:
    """The kernel's start time of ``pid`` (clock ticks since boot), 0 when unknown. A pid is
    identified by (pid, start time), so a recycled pid is not mistaken for a live peer."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields and len(fields) > 19 else 0


def is_alive(pid: int, start_time: int) -> bool:
    """Whether process ``pid`` (started at ``start_time``) still runs. A zombie is dead:
    a SIGKILLed rank stays a zombie until its parent reaps it, and ``os.kill(pid, 0)``
    alone would call it alive."""
    return process_state(pid, start_time) != DEAD


def process_state(pid: int, start_time: int = 0) -> str:
    """RUNNING, STOPPED (SIGSTOP, or held by a debugger) or DEAD, for a process on this
    host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return DEAD
    except PermissionError:
        pass
    fields = _stat_fields(pid)
    if fields is None:
        return DEAD if os.path.isdir("/proc/self") else RUNNING  # no /proc: trust os.kill
    if fields[0] in ("Z", "X", "x"):
        return DEAD
    if start_time and len(fields) > 19 and int(fields[19]) != start_time:
        return DEAD  # the pid was recycled
    return STOPPED if fields[0] in ("T", "t") else RUNNING


def local_state(info: ProcessInfo | None, here: str | None = None) -> str:
    """``info``'s state, or REMOTE when it runs on another host (or is unknown)."""
    if info is None or info.host_key != (here or host_key().hex()):
        return REMOTE
    return process_state(info.pid, info.start_time)


def describe(state: str, info: ProcessInfo | None) -> str:
    """``was stopped (SIGSTOP or a debugger; pid 4711 on node7)``."""
    where = f"pid {info.pid} on {info.host}" if info is not None else "its process"
    if state == STOPPED:
        return f"was stopped (SIGSTOP or a debugger; {where})"
    if state == DEAD:
        return f"died ({where} is gone)"
    return f"did not answer ({where})"


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name: [state, ppid, ...] (field 3 onwards)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


# ------------------------------------------------------------------- the rendezvous store
def publish(store: Any, rank: int, info: ProcessInfo | None = None) -> ProcessInfo:
    """Publish this process's identity as global rank ``rank``'s."""
    info = info or this_process()
    store.set(PROC_KEY + str(rank), info.to_json())
    return info


def read_table(store: Any, ranks: Sequence[int],
               timeout_s: float) -> tuple[ProcessInfo | None, ...] | None:
    """The published identities of global ``ranks`` (None entries: unpublished), or None
    when the store cannot tell within ``timeout_s`` (or nobody published)."""
    keys = [PROC_KEY + str(r) for r in ranks]
    try:
        if not bounded(lambda: store.check(keys), timeout_s):
            return None
        values = bounded(lambda: store.multi_get(keys), timeout_s)
    except Exception:  # a diagnosis aid: no table is no failure
        return None
    return tuple(ProcessInfo.from_json(bytes(v)) for v in values)


class StoreUnreachable(TimeoutError):
    """A store call did not return in time (its host is unreachable or stopped)."""


def bounded(call: Callable[[], T], timeout_s: float) -> T:
    """``call()``, or :class:`StoreUnreachable` when it takes longer than ``timeout_s``. The
    call goes on in a daemon thread that nobody waits for (it holds no lock of ours)."""
    box: list[Any] = []
    done = threading.Event()

    def run() -> None:
        try:
            box.append((True, call()))
        except BaseException as exc:  # handed to the caller
            box.append((False, exc))
        done.set()

    threading.Thread(target=run, name="disttrain-store-call", daemon=True).start()
    if not done.wait(max(0.0, timeout_s)):
        raise StoreUnreachable(f"the rendezvous store did not answer within {timeout_s:g}s")
    ok, value = box[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]
