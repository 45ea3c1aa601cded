"""The simulation's text table and the units it is written in. (``disttrain simulate``
writes its JSON Lines rows and draws its SVG in :mod:`~disttrain.simulate.cli`, with the
CLI's and the benchmark's code.)"""

from __future__ import annotations

from disttrain.simulate.base import StepResult

HEADER = ("strategy", "workers", "step", "samples/s", "eff", "mem/device", "fits",
          "sent/device", "notes")


def format_time(seconds: float | None) -> str:
    """Seconds in the unit that reads best: ``87 µs``, ``4.56 ms``, ``1.23 s`` (as
    ``disttrain bench`` prints them)."""
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def format_bytes(nbytes: float) -> str:
    """Decimal units, as device memory is quoted: ``16 GB``, ``31.4 GB``, ``214 kB``."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes:.0f} B"


def _cells(row: StepResult) -> list[str]:
    if row.error is not None:
        return [row.strategy, str(row.workers), "-", "-", "-", "-", "n/a", "-",
                f"cannot run: {row.error}"]
    return [row.strategy, str(row.workers), format_time(row.step_s),
            f"{row.samples_per_s:.4g}", f"{row.efficiency:.0%}",
            format_bytes(row.memory_bytes), "yes" if row.fits else "NO",
            format_bytes(row.bytes_sent), "; ".join(row.notes)]


def text_table(rows: list[StepResult]) -> str:
    table = [list(HEADER)] + [_cells(r) for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(HEADER) - 1)]
    lines = []
    for cells in table:
        lines.append("  ".join(c.rjust(w) if 0 < i < 8 else c.ljust(w)
                               for i, (c, w) in enumerate(zip(cells, widths)))
                     + "  " + cells[-1])
    return "\n".join(line.rstrip() for line in lines)
