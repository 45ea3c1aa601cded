"""Tensors on another device than the transport's: staged through a buffer on the transport's.

Gloo and the shared-memory transport move host memory, NCCL moves GPU memory. A
:class:`~disttrain.comm.Communicator` call given a tensor of the other kind copies it to a
*stage* on the transport's device first (pinned host memory for a CUDA tensor, so that the
copy is a DMA; this rank's GPU for a CPU tensor), runs on the stage, and copies the outputs
back: at once for a blocking call, and for an asynchronous one in ``wait()`` (or the first
``is_completed()`` that says True). So a CPU transport serves a GPU job where a user asks for
it (two ranks sharing one GPU, which NCCL refuses), and a strategy's host-side bookkeeping (a
loss, flags, agreement tables) works unchanged on NCCL.

Copies in are synchronous: the stage holds the tensor's value at the time of the call, which
is what NCCL's stream order gives too. Copies back are synchronous as well, so the result is
in place, on the device, when ``wait()`` returns, whatever stream the caller then reads it
on. The cost is two copies of every staged byte and a host wait for the GPU at each end: the
price of a CPU transport under a GPU job, not a way to run one fast.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import torch

from disttrain.comm.work import StreamFence, Work

P = ParamSpec("P")
R = TypeVar("R")
_STAGEABLE = ("cpu", "cuda")


def foreign(value: Any, device_type: str) -> bool:
    """Whether ``value`` is a tensor that must be staged for a ``device_type`` transport."""
    return (isinstance(value, torch.Tensor) and value.device.type != device_type
            and value.device.type in _STAGEABLE and device_type in _STAGEABLE)


def stage_for(tensor: torch.Tensor, device_type: str, copy: bool) -> torch.Tensor:
    """A contiguous buffer like ``tensor`` on ``device_type`` (``cuda``: the current
    device), holding its values when ``copy``."""
    if device_type == "cpu":
        stage = torch.empty(tensor.shape, dtype=tensor.dtype,
                            pin_memory=torch.cuda.is_available())
    else:
        stage = torch.empty(tensor.shape, dtype=tensor.dtype, device=device_type)
    return stage.copy_(tensor.detach()) if copy else stage


class StagedWork(Work):
    """An asynchronous call on stages: its outputs are copied back once it is done."""

    def __init__(self, inner: Work, copies: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 stages: Sequence[torch.Tensor]) -> None:
        self._inner, self._copies, self._stages = inner, list(copies), list(stages)
        self._lock = threading.Lock()

    def wait(self, timeout: float | None = None) -> None:
        self._inner.wait(timeout)
        self._finish()

    def is_completed(self) -> bool:
        done = self._inner.is_completed()
        if done:
            self._finish()
        return done

    def _finish(self) -> None:
        with self._lock:  # a poller and a waiter may both get here: copy once
            copies, self._copies, self._stages = self._copies, [], []
            copy_back(copies)


def copy_back(copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for original, stage in copies:
            original.copy_(stage)


def staged(*, inout: tuple[str, ...] = (), out: tuple[str, ...] = ()
           ) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a Communicator method whose tensor arguments may be on another device than
    its transport's: ``inout`` arguments are read and written (copied in and back), ``out``
    arguments only written (copied back), the others only read. The common case, every
    tensor already on the transport's device, costs one type check per argument."""

    def wrap(method: Callable[P, R]) -> Callable[P, R]:
        signature = inspect.signature(method)

        @functools.wraps(method)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            device_type = args[0].transport.device_type  # type: ignore[attr-defined]
            for value in (*args[1:], *kwargs.values()):
                if foreign(value, device_type):
                    return _call_staged(method, signature, inout, out, device_type,
                                        args, kwargs)
            return method(*args, **kwargs)

        return call

    return wrap


def _call_staged(method: Callable[..., Any], signature: inspect.Signature,
                 inout: tuple[str, ...], out: tuple[str, ...], device_type: str,
                 args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    bound = signature.bind(*args, **kwargs)
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    stages: list[torch.Tensor] = []
    for name, value in bound.arguments.items():
        # a non-contiguous tensor goes through unstaged: the usual check names the fix
        if foreign(value, device_type) and value.is_contiguous():
            stage = stage_for(value, device_type, copy=name not in out)
            bound.arguments[name] = stage
            stages.append(stage)
            if name in inout or name in out:
                copies.append((value, stage))
    result = method(*bound.args, **bound.kwargs)
    if isinstance(result, Work):
        return StagedWork(result, copies, stages)
    copy_back(copies)
    return result


def on_current_stream(task: Callable[[], None]) -> tuple[Callable[[], None], StreamFence]:
    """``task``, to run on the CUDA stream that is current now (the caller's), wherever it
    runs: the kernels of a collective queued for the progress thread (reductions, copies,
    NCCL's own wait) then follow the kernels that produced its tensors in stream order, and
    every buffer it allocates or frees belongs to that one stream, so the caching allocator
    never hands out memory a collective still reads. The fence, recorded on that stream
    after the task's last kernel, is what ``wait()`` orders the waiter's stream after."""
    stream = torch.cuda.current_stream()
    fence = StreamFence()

    def run() -> None:
        with torch.cuda.stream(stream):
            task()
        fence.record(stream)

    return run, fence
