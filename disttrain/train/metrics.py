"""What a run reports: per-step records, the fixed-field metrics line, peak memory, a progress
bar and optional TensorBoard scalars.

The metrics line has the same fields in the same order every time, so it can be grepped and
compared across strategies::

    step=     40 epoch=  1 loss=  0.4123 samples/s=   8123.4 comm_MB=   12.345 \
        peak_mem_MB=  251.3 native_MB=    0.000      (one line)

* ``loss``: this rank's training loss of the step (rank 0 prints; the mean over ranks is in
  the final result).
* ``samples/s``: global samples (all data-parallel ranks) per second of step time over the
  logging interval; evaluation and checkpoints are not counted.
* ``comm_MB``: megabytes (10⁶ bytes) this rank has sent through disttrain.comm since the run
  started (``comm.stats``); ``-`` when the strategy's traffic bypasses disttrain.comm
  (the torch baselines).
* ``peak_mem_MB``: on CUDA, ``torch.cuda.max_memory_allocated``; on CPU, the process's peak
  resident set size (``getrusage`` ``ru_maxrss``), which includes the Python interpreter and
  torch's libraries (~200-300 MB), not only tensors.
* ``native_MB``: megabytes of payload this rank handed to collectives that ran inside
  torch.distributed (algorithm ``native``, which ``auto`` picks on the torch transport
  where Gloo's own is fastest): they ran, but their bytes on the wire are torch's and not
  in ``comm_MB``; ``-`` like ``comm_MB``.
* ``lr``: the learning rate of the step (``--lr-schedule``, :mod:`disttrain.train.schedule`).
* ``tokens/s`` and ``mfu`` (language models only): samples/s × tokens per sample, and the
  model FLOPs utilization against ``--peak-tflops`` (``-`` without one;
  :mod:`disttrain.train.flops`).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

import torch

log = logging.getLogger("disttrain.train")


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step as seen by one rank (passed to the loop's hooks)."""

    step: int  # 1-based count of optimizer steps done
    epoch: int
    loss: float  # this rank's loss
    seconds: float  # wall time of the step on this rank (data fetch, forward, backward, update)
    bytes_sent: int | None  # bytes this rank sent through disttrain.comm during the step
    grad_norm: float | None = None  # the whole model's gradient norm before clipping
    lr: float | None = None  # the learning rate of the step


def peak_memory_bytes(device: torch.device | None = None) -> int:
    """Peak memory of this process on ``device``: the CUDA allocator's peak for a GPU (since
    the last ``torch.cuda.reset_peak_memory_stats``, which the loop calls when a run
    starts), else the process's peak RSS."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB


def format_line(step: int, epoch: int, loss: float, samples_per_s: float,
                comm_bytes: int | None, peak_bytes: int, native_bytes: int = 0,
                grad_norm: float | None = None) -> str:
    """The fixed-field metrics line (see the module docstring); ``grad_norm`` (with
    gradient clipping: the norm before clipping) is appended when given."""
    comm = f"{comm_bytes / 1e6:9.3f}" if comm_bytes is not None else f"{'-':>9}"
    native = f"{native_bytes / 1e6:9.3f}" if comm_bytes is not None else f"{'-':>9}"
    line = (f"step={step:7d} epoch={epoch:3d} loss={loss:8.4f} samples/s={samples_per_s:9.1f} "
            f"comm_MB={comm} peak_mem_MB={peak_bytes / 1e6:8.1f} native_MB={native}")
    return line if grad_norm is None else f"{line} grad_norm={grad_norm:.4g}"


def format_rates(lr: float, tokens_per_s: float | None = None, mfu: float | None = None) -> str:
    """The metrics line's tail: the step's learning rate, then for a language model its
    tokens/s and model FLOPs utilization (``-`` without a peak)."""
    tail = f" lr={lr:.4e}"
    if tokens_per_s is not None:
        share = "-" if mfu is None else f"{100 * mfu:.2f}%"
        tail += f" tokens/s={tokens_per_s:10.1f} mfu={share:>6}"
    return tail


class ProgressBar:
    """A one-line bar redrawn in place on a terminal; silent when disabled."""

    def __init__(self, total: int, enabled: bool, stream: TextIO | None = None) -> None:
        self.total, self.stream = max(total, 1), stream or sys.stderr
        self.enabled = enabled
        self._last_draw = 0.0

    def update(self, step: int, loss: float) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self._last_draw < 0.1 and step < self.total):
            return
        self._last_draw = now
        done = int(30 * step / self.total)
        self.stream.write(f"\r[{'#' * done}{'.' * (30 - done)}] {step}/{self.total} "
                          f"loss {loss:.4f}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


class TensorBoard:
    """Scalars to TensorBoard when ``torch.utils.tensorboard`` imports; otherwise nothing."""

    def __init__(self, log_dir: str | None) -> None:
        self._writer: Any = None
        if log_dir is None:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.debug("tensorboard is not installed; skipping TensorBoard output")
            return
        self._writer = SummaryWriter(log_dir=log_dir)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self._writer is not None:
            for name, value in values.items():
                self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
