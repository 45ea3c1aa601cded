"""Pick a strategy per worker count, with the reasoning shown.

The choice is the fastest strategy (highest samples/s) that fits in device memory. Every
other strategy gets one line saying why it lost: it cannot run the case (too few layers
for its stages, …), it does not fit (the memory it needs against the device's), or it is
slower (by how much, with what its simulation blamed: exposed communication, pipeline
idle time, a busy server NIC). Nothing is dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.simulate.base import StepResult
from disttrain.simulate.report import format_bytes, format_time


@dataclass(frozen=True)
class Recommendation:
    workers: int
    strategy: str | None  # None: nothing fits
    lines: tuple[str, ...]

    def text(self) -> str:
        head = (f"{self.workers} workers: {self.strategy}" if self.strategy
                else f"{self.workers} workers: nothing fits")
        return "\n".join([head, *(f"  - {line}" for line in self.lines)])


def _why(row: StepResult) -> str:
    return "; ".join(n for n in row.notes if not n.startswith("assumes"))


def _memory(row: StepResult) -> str:
    return f"{format_bytes(row.memory_bytes)} of {format_bytes(row.device_memory)}"


def recommend(rows: list[StepResult], workers: int) -> Recommendation:
    """The recommendation among ``rows`` at ``workers`` (rows of other counts ignored)."""
    here = [r for r in rows if r.workers == workers]
    runnable = [r for r in here if r.error is None]
    fitting = sorted((r for r in runnable if r.fits), key=lambda r: -r.samples_per_s)
    best = fitting[0] if fitting else None
    lines = []
    if best is not None:
        lines.append(f"{best.strategy}: fastest that fits: {format_time(best.step_s)}/step, "
                     f"{best.samples_per_s:.4g} samples/s, efficiency {best.efficiency:.0%}, "
                     f"{_memory(best)} ({_why(best)})")
    else:
        smallest = min(runnable, key=lambda r: r.memory_bytes, default=None)
        if smallest is not None:
            lines.append(f"no strategy fits; the smallest, {smallest.strategy}, needs "
                         f"{_memory(smallest)}: add devices, use bf16 or a smaller batch")
    for row in sorted(here, key=lambda r: (r.error is not None, not r.fits,
                                           -r.samples_per_s)):
        if row is best:
            continue
        if row.error is not None:
            lines.append(f"{row.strategy}: cannot run: {row.error}")
        elif not row.fits:
            lines.append(f"{row.strategy}: does not fit: needs {_memory(row)} per device")
        elif best is not None:
            slower = best.samples_per_s / row.samples_per_s if row.samples_per_s else 0.0
            lines.append(f"{row.strategy}: {slower:.2f}× slower, efficiency "
                         f"{row.efficiency:.0%} ({_why(row)})")
    return Recommendation(workers, best.strategy if best else None, tuple(lines))
