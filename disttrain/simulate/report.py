"""The simulation's outputs: a text table, JSON rows, and one SVG with three plots (step
time, memory per device, scaling efficiency against log₂ workers), drawn with the
dependency-free SVG plots of :mod:`disttrain.bench.svg`."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from disttrain.bench.svg import H, line_plot
from disttrain.bench.table import format_time
from disttrain.simulate.base import StepResult

HEADER = ("strategy", "workers", "step", "samples/s", "eff", "mem/device", "fits",
          "sent/device", "notes")


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


def write_json(path: Path, rows: list[StepResult], meta: dict[str, Any]) -> None:
    """One JSON object per line: a ``meta`` line, then one per row."""
    with path.open("w") as out:
        out.write(json.dumps({"meta": meta}) + "\n")
        for row in rows:
            out.write(json.dumps(row.as_dict()) + "\n")


def _series(rows: list[StepResult], value: Any) -> list[tuple[str, list[tuple[float, float]]]]:
    names = list(dict.fromkeys(r.strategy for r in rows))
    series = []
    for name in names:
        pts = [(math.log2(r.workers), value(r)) for r in rows
               if r.strategy == name and r.error is None]
        series.append((name, [p for p in pts if math.isfinite(p[1])]))
    return series


def svg(rows: list[StepResult], title: str) -> str:
    device = rows[0].device_memory if rows else 0.0
    plots = [
        line_plot("step", f"{title}: step time", "log2(workers)", "seconds per step",
                  _series(rows, lambda r: r.step_s)),
        line_plot("memory", f"memory per device (a device holds {device / 1e9:.0f} GB)",
                  "log2(workers)", "GB", _series(rows, lambda r: r.memory_bytes / 1e9)),
        line_plot("efficiency", "scaling efficiency", "log2(workers)", "efficiency",
                  _series(rows, lambda r: r.efficiency)),
    ]
    body = "".join(p.replace("<svg id=", f'<svg y="{i * H}" id=', 1)
                   for i, p in enumerate(plots))
    width = 760
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{3 * H}" '
            f'viewBox="0 0 {width} {3 * H}">{body}</svg>\n')
