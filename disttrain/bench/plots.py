"""The strategy table's plots, drawn with matplotlib as SVG for the HTML report.

Four figures, one row of the table per bar or line, in human units (``11k`` samples/s,
``1.2 MiB``): throughput against the single process, memory per rank (model states by
kind, activations, and the ZeRO formula's figure as a mark), held-out accuracy during
training, and bytes sent per step against theory.

matplotlib is optional (``pip install 'disttrain[plots]'``): :func:`svg_plots` returns None
without it and the report says how to get the plots. Figures are drawn with the
object-oriented API (no pyplot, no global backend) and text stays text in the SVG
(``svg.fonttype: none``): smaller files whose labels can be searched.
"""

from __future__ import annotations

import io
import math
from typing import Any

Row = dict[str, Any]
INSTALL = "pip install 'disttrain[plots]' (or pip install matplotlib)"
COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3",
          "#8C8C8C", "#CCB974", "#64B5CD")


def human_count(value: float) -> str:
    """11234 → ``11k``, 1.5e6 → ``1.5M``, 950 → ``950``."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            shown = value / scale
            return f"{shown:.0f}{unit}" if abs(shown) >= 10 or shown == int(shown) else (
                f"{shown:.1f}{unit}")
    if abs(value) >= 100 or value == int(value):
        return f"{value:.0f}"
    return f"{value:.3g}" if abs(value) >= 1 else f"{value:.2g}"


def human_bytes(value: float) -> str:
    """1288490188 → ``1.2 GiB``, 3 × 2²⁰ → ``3 MiB``, 0 → ``0 B`` (binary units)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= scale:
            shown = value / scale
            return f"{shown:.0f} {unit}" if abs(shown) >= 10 or shown == int(shown) else (
                f"{shown:.1f} {unit}")
    return f"{value:.0f} B"


def _label(row: Row) -> str:
    servers = f"+{row['servers']}" if row.get("servers") else ""
    return f"{row['strategy']} n={row['world_size']}{servers}"


def _svg(fig: Any) -> str:
    import matplotlib

    out = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "disttrain"}):
        fig.savefig(out, format="svg", bbox_inches="tight")
    text = out.getvalue()
    return text[text.index("<svg"):].strip()  # no XML prologue or doctype: inline in HTML


def _figure(rows: int) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(8.0, 1.2 + 0.32 * max(rows, 1)), dpi=100)


def _formatter(fn: Any) -> Any:
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda value, _pos: fn(value))


def _bytes_axis(axis: Any, largest: float) -> None:
    """Ticks at round numbers of the binary unit the largest value is in (4, 8, 12 MiB
    rather than 9.5, 19 MiB), labelled in that unit."""
    from matplotlib.ticker import MultipleLocator

    unit = next((u for u in (2**30, 2**20, 2**10) if largest >= u), 1)
    rough = max(largest / unit / 5, 1e-9)
    magnitude = 10 ** math.floor(math.log10(rough))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= rough)
    axis.set_major_locator(MultipleLocator(step * unit))
    axis.set_major_formatter(_formatter(human_bytes))


def throughput(rows: list[Row]) -> str:
    fig = _figure(len(rows))
    ax = fig.subplots()
    labels = [_label(r) for r in rows]
    speeds = [r["samples_per_s"] for r in rows]
    colors = ["#8C8C8C" if r["strategy"] == "single" else COLORS[0] for r in rows]
    ax.barh(labels, speeds, color=colors)
    ax.invert_yaxis()
    ax.xaxis.set_major_formatter(_formatter(human_count))
    for y, row in enumerate(rows):
        speedup = row.get("speedup")
        note = human_count(row["samples_per_s"]) + (f"  ({speedup:.2f}×)" if speedup else "")
        ax.text(row["samples_per_s"], y, " " + note, va="center", fontsize=8)
    ax.set_xlabel("samples/s (× the single process in brackets)")
    ax.set_title("Throughput")
    ax.margins(x=0.25)
    return _svg(fig)


def left_total(left: list[float], acts: list[float]) -> list[float]:
    return [a + b for a, b in zip(left, acts)]


def memory(rows: list[Row]) -> str:
    fig = _figure(len(rows))
    ax = fig.subplots()
    labels = [_label(r) for r in rows]
    left = [0.0] * len(rows)
    parts = [("parameters", "params"), ("gradients", "grads"), ("optimizer state", "optimizer")]
    for i, (name, key) in enumerate(parts):
        values = [float((r.get("model_state_breakdown") or {}).get(key, 0)) for r in rows]
        ax.barh(labels, values, left=left, color=COLORS[i], label=name)
        left = [a + b for a, b in zip(left, values)]
    acts = [float(r.get("activation_peak_bytes") or 0) for r in rows]
    ax.barh(labels, acts, left=left, color=COLORS[3], label="activations (peak)")
    formula = [(y, r["model_state_formula_bytes"]) for y, r in enumerate(rows)
               if r.get("model_state_formula_bytes")]
    if formula:
        ax.plot([f for _, f in formula], [y for y, _ in formula], "k|", markersize=14,
                label="ZeRO formula (model states)")
    ax.invert_yaxis()
    _bytes_axis(ax.xaxis, max([*left_total(left, acts), 1.0]))
    ax.set_xlabel("bytes per rank (the busiest rank)")
    ax.set_title("Memory per rank: model states and activations")
    ax.legend(fontsize=8, loc="lower right")
    return _svg(fig)


def accuracy(rows: list[Row]) -> str:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, 4.0), dpi=100)
    ax = fig.subplots()
    for i, row in enumerate(rows):
        points = row.get("evaluations") or []
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=".",
                    color=COLORS[i % len(COLORS)], label=_label(row))
    ax.set_xlabel("step")
    ax.set_ylabel("held-out accuracy")
    ax.set_title("Accuracy during training")
    if ax.lines:
        ax.legend(fontsize=7, ncol=2)
    return _svg(fig)


def wire(rows: list[Row]) -> str:
    fig = _figure(len(rows))
    ax = fig.subplots()
    labels = [_label(r) for r in rows]
    y = list(range(len(rows)))
    sent = [float(r.get("bytes_sent_per_rank_per_step") or 0) for r in rows]
    theory = [float(r.get("theory_bytes_per_rank_per_step") or 0) for r in rows]
    ax.barh([v - 0.2 for v in y], sent, height=0.4, color=COLORS[0], label="measured")
    ax.barh([v + 0.2 for v in y], theory, height=0.4, color=COLORS[1], label="theory")
    ax.set_yticks(y, labels)
    ax.invert_yaxis()
    _bytes_axis(ax.xaxis, max([*sent, *theory, 1.0]))
    ax.set_xlabel("bytes the busiest rank sends per step (native and baseline rows: "
                  "not counted)")
    ax.set_title("Bytes on the wire: measured and theory")
    ax.legend(fontsize=8, loc="lower right")
    return _svg(fig)


PLOTS = {"plot-throughput": throughput, "plot-memory": memory, "plot-accuracy": accuracy,
         "plot-bytes": wire}


def svg_plots(rows: list[Row]) -> dict[str, str] | None:
    """Plot id → inline SVG for the finished rows, or None when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    ok = [r for r in rows if not r.get("error")]
    return {plot_id: draw(ok) for plot_id, draw in PLOTS.items()}
