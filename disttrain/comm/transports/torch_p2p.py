"""The ``torch`` transport: point-to-point messages over a torch.distributed process group.

Gloo moves CPU tensors over TCP; NCCL moves CUDA tensors. Each message is one
``dist.isend``/``dist.irecv``; ``wait(timeout_s)`` maps Gloo's timeout and closed-connection
errors onto the transport contract (``TimeoutError`` / ``ConnectionError``).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from disttrain.comm.transport import RawWork, Transport

_PEER_GONE = ("connection closed", "connection reset", "broken pipe", "closed by peer",
              "connection refused", "eof", "socket closed")


def translate_error(exc: BaseException) -> BaseException:
    """Map a torch.distributed RuntimeError onto TimeoutError / ConnectionError when it is one."""
    text = str(exc).lower()
    if "timed out" in text or "timeout" in text:
        return TimeoutError(str(exc))
    if any(marker in text for marker in _PEER_GONE):
        return ConnectionError(str(exc))
    return exc


class _TorchWork:
    def __init__(self, work: Any) -> None:
        self._work = work

    def wait(self, timeout_s: float) -> None:
        try:
            self._work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise translate_error(exc) from exc

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())


class TorchTransport(Transport):
    """Point-to-point over a torch.distributed process group (the default group if none)."""

    name = "torch"

    def __init__(self, group: Any | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized: call disttrain.init() or "
                "torch.distributed.init_process_group() before creating a Communicator"
            )
        self._group = group if group is not None else dist.group.WORLD
        self._global_ranks = tuple(dist.get_process_group_ranks(self._group))
        self._rank = dist.get_rank(self._group)
        if self._rank < 0:
            raise ValueError("this process is not a member of the given process group")
        backend = str(dist.get_backend(self._group)).lower()
        self._device_type = "cuda" if "nccl" in backend else "cpu"

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return len(self._global_ranks)

    @property
    def global_ranks(self) -> tuple[int, ...]:
        return self._global_ranks

    @property
    def native_group(self) -> Any:
        return self._group

    @property
    def device_type(self) -> str:
        return self._device_type

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> RawWork:
        work = dist.isend(tensor, self._global_ranks[dst], group=self._group, tag=tag)
        return _TorchWork(work)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> RawWork:
        work = dist.irecv(tensor, self._global_ranks[src], group=self._group, tag=tag)
        return _TorchWork(work)

    def subgroup(self, ranks: Sequence[int]) -> TorchTransport | None:
        if self._rank not in ranks:
            return None
        members = [self._global_ranks[r] for r in ranks]
        # Only members synchronise, so groups can be created by the ranks that need them.
        group = dist.new_group(members, use_local_synchronization=True)
        return TorchTransport(group)
