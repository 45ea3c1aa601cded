"""Which device a rank trains on: ``--device {auto,cpu,cuda}`` (``TrainConfig.device``).

``auto`` is this rank's GPU when CUDA is available, else the CPU; ``cuda`` is this rank's GPU
(``cuda:LOCAL_RANK``: the launcher, ``disttrain.init()`` or ``disttrain run`` makes that the
current CUDA device of each rank) and an error where there is none; ``cuda:N`` names a GPU.
The model, its batches, the optimizer state and every buffer a strategy makes live there;
the communicator moves what it must (NCCL on the GPU, Gloo and shared memory through pinned
host memory, :mod:`disttrain.comm.staging`).
"""

from __future__ import annotations

import os
from typing import Any

import torch

DEVICES = ("auto", "cpu", "cuda")


def check_device(name: str) -> str:
    """``name`` if it is ``auto``, ``cpu``, ``cuda`` or ``cuda:N``, else a ValueError."""
    kind, _, index = name.partition(":")
    if name in DEVICES or (kind == "cuda" and index.isdigit()):
        return name
    raise ValueError(f"device must be one of {', '.join(DEVICES)} or cuda:N, got {name!r}")


def cuda_missing() -> str | None:
    """Why CUDA cannot be used here (one line), or None when it can."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    if not torch.cuda.is_available():
        return "torch finds no CUDA GPU (check the driver and CUDA_VISIBLE_DEVICES)"
    return None


def require_available(name: str) -> None:
    """Raise a one-line ValueError when ``name`` asks for CUDA and there is none."""
    if check_device(name).startswith("cuda"):
        missing = cuda_missing()
        if missing is not None:
            raise ValueError(f"--device {name}: CUDA is not available: {missing}; use "
                             f"--device cpu (or auto)")


def uses_cuda(name: str) -> bool:
    """Whether ranks given ``name`` train on GPUs here."""
    check_device(name)
    return name.startswith("cuda") or (name == "auto" and torch.cuda.is_available())


def local_gpu(local_rank: int) -> int:
    """The GPU of local rank ``local_rank``: one each, shared round-robin when the ranks of a
    node outnumber its GPUs (only CPU transports allow that: NCCL refuses it)."""
    return local_rank % max(1, torch.cuda.device_count())


def select_local_gpu(name: str, local_rank: int | None = None) -> None:
    """Make this rank's GPU the current CUDA device (``cuda:LOCAL_RANK``), when ``name``
    trains on GPUs; ``local_rank`` defaults to ``$LOCAL_RANK`` (else 0)."""
    if not uses_cuda(name):
        return
    if ":" in name:  # every rank on the named GPU: it must be current, as the model is
        torch.cuda.set_device(torch.device(name))
        return
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    torch.cuda.set_device(local_gpu(local_rank))


def local_backend(requested: str | None, device: str, transport: str, world_size: int) -> str:
    """The torch.distributed backend of ``world_size`` ranks started on this machine:
    ``requested`` (or $DISTTRAIN_BACKEND) if given, else NCCL for GPUs and Gloo for the CPU.
    A transport other than ``torch`` moves bytes itself and meets over Gloo; NCCL needs a
    GPU of its own per rank (it refuses two ranks on one GPU)."""
    from disttrain.launch.env import choose_backend

    requested = None if requested in (None, "auto") else requested
    if transport != "torch":
        if requested not in (None, "gloo"):
            raise ValueError(f"--transport {transport} moves bytes itself and meets over Gloo; "
                             f"use --backend gloo (or auto)")
        return "gloo"
    name = choose_backend(requested, os.environ, torch.cuda.is_available(), device)
    gpus = torch.cuda.device_count()
    if name == "nccl" and ":" in device and world_size > 1:
        raise ValueError(f"--device {device} puts all {world_size} ranks on one GPU, which "
                         f"NCCL refuses; use --device cuda (a GPU per rank) or --backend gloo")
    if name == "nccl" and world_size > gpus:
        raise ValueError(f"NCCL needs a GPU of its own per rank, but {world_size} ranks would "
                         f"share {gpus} GPU(s) here (NCCL refuses two ranks on one GPU); use "
                         f"--backend gloo (CUDA tensors are staged through pinned host "
                         f"memory) or -n {max(gpus, 1)}")
    return name


def resolve_device(name: str) -> torch.device:
    """The device ``name`` means in this process (``cuda``: the current CUDA device)."""
    require_available(name)
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if ":" in name:
        return torch.device(name)
    return torch.device("cuda", torch.cuda.current_device())


def to_device(batch: tuple[Any, Any], device: torch.device,
              dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """``(inputs, targets)`` with their tensors (also a dict's) on ``device`` and, given
    ``dtype``, their floating-point tensors in it (the model's); anything else unchanged."""
    def move(t: Any) -> Any:
        if isinstance(t, dict):
            return {key: move(value) for key, value in t.items()}
        if not isinstance(t, torch.Tensor):
            return t
        if dtype is not None and t.is_floating_point():
            return t.to(device, dtype)
        return t.to(device)

    return tuple(move(t) for t in batch)  # type: ignore[return-value]
