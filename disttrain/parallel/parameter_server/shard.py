"""One server's share of the parameters: values, optimizer state, pending gradients.

The shard is one flat tensor holding the keys ``[start, end)`` of the partition, wrapped in
an ``nn.Parameter`` so that any element-wise ``torch.optim`` optimizer (SGD with momentum,
Adam, AdamW) updates it and keeps its state (momentum buffers, Adam moments) right here on
the server, exactly as the same optimizer would on the whole model in one process.
Optimizers that look across elements (LARS, LAMB: per-tensor norms) would not match.

Gradients wait in *pending* buffers, one per update (a clock in sync and ssp with s = 0, a
worker's step in async and ssp with s > 0), until :meth:`ServerShard.apply` averages them
over the workers that contributed, steps the optimizer once (at a learning rate scaled by
the update's staleness, ``PSConfig.staleness_lr``) and bumps the parameter version.
Addressing a request (a dense key range or rows of an embedding table) is validated here and
raises :class:`ProtocolError`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from disttrain.parallel.checkpoint_files import (
    CheckpointError,
    atomic_save,
    fsync_directory,
    load,
    seal,
    verify,
)
from disttrain.parallel.parameter_server.config import staleness_lr_factor
from disttrain.parallel.parameter_server.partition import Partition, Segment
from disttrain.parallel.parameter_server.protocol import ProtocolError, Status

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
UpdateKey = tuple[int, int]  # (clock, worker) applied on arrival; (clock, -1) clock-ordered
CHECKPOINT_FORMAT = "disttrain.parameter_server.shard/1"
SHARD_FILE = "shard.pt"  # in a server's checkpoint directory, beside its manifest


@dataclass
class _Pending:
    grad: torch.Tensor
    pulled_versions: list[int] = field(default_factory=list)  # one per contributing worker


class ServerShard:
    """Keys ``partition.server_range(server)``: their values, optimizer and versions."""

    def __init__(self, partition: Partition, server: int, values: torch.Tensor,
                 optimizer_factory: OptimizerFactory, staleness_lr: str = "none") -> None:
        self.partition, self.server = partition, server
        self.start, self.end = partition.server_range(server)
        if values.dim() != 1 or values.numel() != self.end - self.start:
            raise ValueError(f"server {server} holds {self.end - self.start} keys but was given "
                             f"a tensor of shape {tuple(values.shape)}")
        self.param = nn.Parameter(values.detach().clone().contiguous())
        self.optimizer = optimizer_factory([self.param])
        self.staleness_lr = staleness_lr
        self.version = 0  # updates applied so far
        self._pending: dict[UpdateKey, _Pending] = {}

    @property
    def dtype(self) -> torch.dtype:
        return self.param.dtype

    # ------------------------------------------------------------ addressing (validated)
    def dense_slice(self, offset: int, count: int) -> slice:
        """Local slice of the keys ``[offset, offset + count)``; they must all be here."""
        if not self.start <= offset < self.end:
            raise ProtocolError(Status.UNKNOWN_KEY, f"key {offset} is not on server "
                                f"{self.server} (it holds keys [{self.start}, {self.end}))")
        if count < 1 or offset + count > self.end:
            raise ProtocolError(Status.BAD_SIZE, f"{count} elements from key {offset} do not fit "
                                f"in server {self.server}'s keys [{self.start}, {self.end})")
        return slice(offset - self.start, offset - self.start + count)

    def table(self, tensor: int) -> Segment:
        """The rows of sparse table ``tensor`` that live on this server."""
        specs = self.partition.specs
        if not 0 <= tensor < len(specs) or not specs[tensor].sparse:
            raise ProtocolError(Status.UNKNOWN_KEY, f"key {tensor} is not a sparse table "
                                f"(there are {len(specs)} tensors)")
        segments = self.partition.segments(server=self.server, tensor=tensor)
        if not segments:
            raise ProtocolError(Status.UNKNOWN_KEY, f"table {specs[tensor].name!r} has no rows "
                                f"on server {self.server}")
        return segments[0]

    def check_rows(self, seg: Segment, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` (global row numbers) must be strictly increasing rows of ``seg``; returns
        them relative to the segment's first row."""
        n = ids.numel()
        if n and (int(ids[0]) < seg.row_start or int(ids[-1]) >= seg.row_end
                  or (n > 1 and not bool((ids[1:] > ids[:-1]).all()))):
            raise ProtocolError(Status.BAD_ROWS, f"row ids must be strictly increasing and in "
                                f"[{seg.row_start}, {seg.row_end}) on server {self.server}")
        return (ids - seg.row_start).to(self.param.device)

    def _rows(self, data: torch.Tensor, seg: Segment) -> torch.Tensor:
        row = self.partition.specs[seg.tensor].row_size
        local = seg.start - self.start
        return data[local:local + seg.length].view(seg.row_end - seg.row_start, row)

    # ------------------------------------------------------------ reads
    def read_dense(self, where: slice) -> torch.Tensor:
        return self.param.data[where].clone()

    def read_rows(self, seg: Segment, local_ids: torch.Tensor) -> torch.Tensor:
        return self._rows(self.param.data, seg)[local_ids].contiguous()

    # ------------------------------------------------------------ updates
    def _pending_for(self, key: UpdateKey) -> _Pending:
        if key not in self._pending:
            self._pending[key] = _Pending(torch.zeros_like(self.param.data))
        return self._pending[key]

    def add_dense(self, key: UpdateKey, where: slice, grad: torch.Tensor) -> None:
        # a message arrives where the transport moves bytes; the shard may live elsewhere
        self._pending_for(key).grad[where] += grad.to(self.param.device)

    def add_rows(self, key: UpdateKey, seg: Segment, local_ids: torch.Tensor,
                 grad_rows: torch.Tensor) -> None:
        rows = self._rows(self._pending_for(key).grad, seg)
        rows.index_add_(0, local_ids, grad_rows.to(rows.device).view(local_ids.numel(), -1))

    def contribute(self, key: UpdateKey, pulled_version: int) -> None:
        """A worker finished its part of update ``key``, computed on ``pulled_version``."""
        self._pending_for(key).pulled_versions.append(pulled_version)

    def discard(self, worker: int) -> int:
        """Drop the pending updates of a lost ``worker`` (applied on arrival, keyed by
        worker); returns how many were dropped."""
        keys = [key for key in self._pending if key[1] == worker]
        for key in keys:
            del self._pending[key]
        return len(keys)

    def apply(self, key: UpdateKey) -> list[int]:
        """Average update ``key`` over its contributors, step the optimizer at its learning
        rate times the staleness factor, bump the version. Returns the staleness of each
        contribution."""
        pending = self._pending.pop(key, None) or _Pending(torch.zeros_like(self.param.data))
        staleness = [self.version - v for v in pending.pulled_versions]
        factor = staleness_lr_factor(self.staleness_lr, staleness)
        self.param.grad = pending.grad / max(1, len(pending.pulled_versions))
        rates = [group["lr"] for group in self.optimizer.param_groups]
        for group, lr in zip(self.optimizer.param_groups, rates):
            group["lr"] = lr * factor
        try:
            self.optimizer.step()
        finally:  # the optimizer keeps its own rate (checkpoints save it)
            for group, lr in zip(self.optimizer.param_groups, rates):
                group["lr"] = lr
        self.param.grad = None
        self.version += 1
        return staleness

    # ------------------------------------------------------------ checkpoints
    def state_dict(self, clock: int) -> dict[str, Any]:
        """Applied state only: gradients of updates still pending are not included."""
        return {"format": CHECKPOINT_FORMAT, "server": self.server,
                "range": [self.start, self.end], "fingerprint": self.partition.fingerprint(),
                "values": self.param.data.clone(), "optimizer": self.optimizer.state_dict(),
                "version": self.version, "clock": clock}

    def load_state_dict(self, state: dict[str, Any]) -> int:
        """Restore values, optimizer state and version; returns the saved clock."""
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"not a parameter-server shard checkpoint (format "
                             f"{state.get('format')!r}, expected {CHECKPOINT_FORMAT!r})")
        if (state["server"] != self.server or list(state["range"]) != [self.start, self.end]
                or state["fingerprint"] != self.partition.fingerprint()):
            raise ValueError(f"checkpoint of server {state['server']} (keys {state['range']}) "
                             f"does not fit server {self.server} (keys [{self.start}, "
                             f"{self.end})): the model or the number of servers changed")
        self.param.data.copy_(state["values"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self._pending.clear()
        return int(state["clock"])


def checkpoint_path(directory: str, server: int) -> str:
    """Server ``server``'s checkpoint in ``directory``: a directory of its own, sealed."""
    return os.path.join(directory, f"ps-server-{server:03d}")


def save_checkpoint(path: str, state: dict[str, Any]) -> None:
    """Write checkpoint directory ``path``: ``shard.pt`` and the manifest that seals it (its
    size and SHA-256, as every disttrain checkpoint: :mod:`~disttrain.parallel.
    checkpoint_files`). Each server seals its own, so no server waits for another, even
    when it saves mid-run (``checkpoint_every``). Written in a temporary sibling, then put in
    place by two renames: a crash leaves the previous checkpoint or the new one, complete
    (between the renames, microseconds, the previous one is left as ``.NAME.old-PID``)."""
    parent, name = os.path.split(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fresh = os.path.join(parent, f".{name}.tmp-{os.getpid()}")
    shutil.rmtree(fresh, ignore_errors=True)
    os.makedirs(fresh)
    atomic_save(state, os.path.join(fresh, SHARD_FILE))
    seal(fresh, 0, 1, lambda: None)
    old = os.path.join(parent, f".{name}.old-{os.getpid()}") if os.path.exists(path) else None
    if old is not None:
        os.rename(path, old)
    os.rename(fresh, path)
    fsync_directory(parent)
    if old is not None:
        shutil.rmtree(old)


def load_checkpoint(path: str) -> dict[str, Any]:
    """Checkpoint directory ``path``, verified against its manifest (a damaged, truncated or
    unsealed one raises CheckpointError naming the file); tensors and plain containers only
    (``weights_only=True``): nothing is unpickled."""
    verify(path)
    file = os.path.join(path, SHARD_FILE)
    state = load(file)
    if not isinstance(state, dict):
        raise CheckpointError(f"{file} is not a parameter-server shard checkpoint")
    return state
