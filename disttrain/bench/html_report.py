"""A self-contained HTML report of the strategy table: the table and four inline SVG plots
(throughput against world size, peak memory per rank, accuracy curves, bytes on the wire
against theory). No JavaScript, no external CSS or fonts, nothing fetched: one file that
opens anywhere.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from disttrain.bench.report import COLUMNS, cells

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


def plots(rows: list[Row]) -> list[str]:
    """The four plots, from the rows that finished."""
    ok = [r for r in rows if not r.get("error")]
    names = list(dict.fromkeys(r["strategy"] for r in ok))
    throughput = [(n, [(float(r["world_size"]), r["samples_per_s"]) for r in ok
                       if r["strategy"] == n]) for n in names]
    labels = [f"{r['strategy']} n={r['world_size']}" for r in ok]
    memory = [("peak MB per rank (max)", [r["peak_mem_bytes"] / 1e6 for r in ok])]
    curves = [(f"{r['strategy']} n={r['world_size']}",
               [(float(e[0]), e[1]) for e in r.get("evaluations", [])]) for r in ok]
    wire = [("measured", [_kb(r["bytes_sent_per_rank_per_step"]) for r in ok]),
            ("theory", [_kb(r["theory_bytes_per_rank_per_step"]) for r in ok])]
    return [line_plot("plot-throughput", "Throughput against world size", "ranks",
                      "samples/s", throughput),
            bar_plot("plot-memory", "Peak memory per rank", "MB", labels, memory),
            line_plot("plot-accuracy", "Held-out accuracy during training", "step",
                      "accuracy", curves),
            bar_plot("plot-bytes", "Bytes sent per rank per step: measured and theory", "kB",
                      labels, wire)]


def _kb(value: float | None) -> float | None:
    return None if value is None else value / 1e3


def html_report(rows: list[Row], env: dict[str, Any]) -> str:
    head = "".join(f"<th>{_esc(c)}</th>" for c in COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in cells(r)) + "</tr>"
                   for r in rows)
    failed = "".join(f"<li>{_esc(r['strategy'])} n={r['world_size']}: {_esc(r['error'])}</li>"
                     for r in rows if r.get("error"))
    envlist = "".join(f"<li>{_esc(k)}: {_esc(v)}</li>" for k, v in env.items())
    style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}"
             "svg.plot{margin:1em 1em 0 0;border:1px solid #eee}")
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>disttrain bench"
            f"</title><style>{style}</style></head><body><h1>disttrain bench</h1>"
            f"<p>Command: <code>{_esc(env.get('command', ''))}</code></p>"
            f"<table><tr>{head}</tr>{body}</table>"
            + (f"<h2>Failed runs</h2><ul>{failed}</ul>" if failed else "")
            + "<h2>Plots</h2>" + "".join(plots(rows))
            + f"<h2>Environment</h2><ul>{envlist}</ul></body></html>\n")


def write_html(path: Path, rows: list[Row], env: dict[str, Any]) -> None:
    path.write_text(html_report(rows, env), encoding="utf-8")
