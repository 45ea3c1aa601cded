"""Dependency-free SVG plots: lines with markers and grouped bars, as plain SVG text.

``disttrain simulate --svg`` draws its figures with these (the benchmark's HTML report uses
matplotlib: :mod:`disttrain.bench.plots`), so the simulator needs nothing beyond torch.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

Row = dict[str, Any]
W, H, PAD = 760, 330, 70  # PAD: left and bottom margins (tick and rotated labels)
RIGHT = 130  # the legend's column
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39")
Series = tuple[str, list[tuple[float, float]]]


def _esc(text: object) -> str:
    return html.escape(str(text))


def _scale(lo: float, hi: float, a: float, b: float) -> Any:
    span = (hi - lo) or 1.0
    return lambda v: a + (v - lo) / span * (b - a)


def _frame(plot_id: str, title: str, xlabel: str, ylabel: str, body: list[str],
           ymax: float) -> str:
    ticks = [f'<text x="{PAD - 4}" y="{H - PAD - i * (H - 2 * PAD) / 4 + 4:.1f}" '
             f'text-anchor="end" font-size="10">{ymax * i / 4:.3g}</text>' for i in range(5)]
    return (f'<svg id="{plot_id}" class="plot" xmlns="http://www.w3.org/2000/svg" '
            f'width="{W}" height="{H}" viewBox="0 0 {W} {H}">'
            f'<title>{_esc(title)}</title>'
            f'<text x="{W / 2}" y="16" text-anchor="middle" font-size="13">{_esc(title)}</text>'
            f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - RIGHT}" y2="{H - PAD}" stroke="#000"/>'
            f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{H - PAD}" stroke="#000"/>'
            f'<text x="{W / 2}" y="{H - 6}" text-anchor="middle" font-size="11">'
            f'{_esc(xlabel)}</text><text x="12" y="{H / 2}" font-size="11" '
            f'transform="rotate(-90 12 {H / 2})" text-anchor="middle">{_esc(ylabel)}</text>'
            + "".join(ticks) + "".join(body) + "</svg>")


def _legend(names: Sequence[str]) -> list[str]:
    return [f'<text x="{W - RIGHT + 6}" y="{PAD + 12 * i}" font-size="9" '
            f'fill="{COLORS[i % len(COLORS)]}">{_esc(n)}</text>' for i, n in enumerate(names)]


def line_plot(plot_id: str, title: str, xlabel: str, ylabel: str, series: list[Series]) -> str:
    """Lines with markers, one colour per series."""
    points = [p for _, pts in series for p in pts]
    if not points:
        return _frame(plot_id, title + " (no data)", xlabel, ylabel, [], 1.0)
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    ymax = max(ys) * 1.05 or 1.0
    sx = _scale(min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1, PAD + 10, W - RIGHT - 10)
    sy = _scale(0.0, ymax, H - PAD, PAD)
    body = [f'<text x="{sx(x):.1f}" y="{H - PAD + 14}" text-anchor="middle" font-size="10">'
            f'{x:g}</text>' for x in sorted(set(xs))][:12]
    for i, (name, pts) in enumerate(series):
        color = COLORS[i % len(COLORS)]
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in sorted(pts))
        body.append(f'<polyline class="series" data-name="{_esc(name)}" fill="none" '
                    f'stroke="{color}" stroke-width="1.5" points="{coords}"/>')
        body += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{color}"/>'
                 for x, y in pts]
    return _frame(plot_id, title, xlabel, ylabel, body + _legend([s[0] for s in series]), ymax)


def bar_plot(plot_id: str, title: str, ylabel: str, labels: list[str],
             groups: list[tuple[str, list[float | None]]]) -> str:
    """Grouped bars: one group per label, one bar per (name, values) in ``groups``."""
    values = [v for _, vs in groups for v in vs if v is not None]
    ymax = (max(values) * 1.05 if values else 0.0) or 1.0
    sy = _scale(0.0, ymax, H - PAD, PAD)
    slot = (W - PAD - RIGHT) / max(len(labels), 1)
    bar = slot * 0.8 / max(len(groups), 1)
    body = []
    for i, label in enumerate(labels):
        x0 = PAD + i * slot + slot * 0.1
        lx, ly = x0 + slot * 0.4, H - PAD + 10
        body.append(f'<text x="{lx:.1f}" y="{ly}" font-size="9" text-anchor="end" '
                    f'transform="rotate(-35 {lx:.1f} {ly})">{_esc(label)}</text>')
        for j, (name, vals) in enumerate(groups):
            v = vals[i]
            if v is None:
                continue
            y = sy(v)
            body.append(f'<rect class="bar" data-name="{_esc(name)}" x="{x0 + j * bar:.1f}" '
                        f'y="{y:.1f}" width="{bar * 0.9:.1f}" height="{H - PAD - y:.1f}" '
                        f'fill="{COLORS[j % len(COLORS)]}"><title>{_esc(label)} {_esc(name)}: '
                        f'{v:.4g}</title></rect>')
    return _frame(plot_id, title, "", ylabel, body + _legend([g[0] for g in groups]), ymax)
