"""A self-contained HTML report of the strategy table: the table, its notes and four plots
drawn by matplotlib as inline SVG (:mod:`disttrain.bench.plots`: throughput, memory per rank,
accuracy curves, bytes on the wire against theory). No JavaScript, no external CSS or
fonts, nothing fetched: one file that opens anywhere. Without matplotlib the report says
how to get the plots and keeps the table.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from disttrain.bench.plots import INSTALL, svg_plots
from disttrain.bench.report import cells, ps_notes, skipped_notes, table_columns

Row = dict[str, Any]


def _esc(text: object) -> str:
    return html.escape(str(text))


def plots_html(rows: list[Row]) -> str:
    """Each plot in a ``<figure id=…>``, or the note that matplotlib is missing."""
    figures = svg_plots(rows)
    if figures is None:
        return f"<p class=\"note\">Plots need matplotlib: {_esc(INSTALL)}.</p>"
    return "".join(f'<figure id="{plot_id}" class="plot">{svg}</figure>'
                   for plot_id, svg in figures.items())


def html_report(rows: list[Row], env: dict[str, Any]) -> str:
    columns = table_columns(rows)
    head = "".join(f"<th>{_esc(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in cells(r, columns))
                   + "</tr>" for r in rows)
    failed = "".join(f"<li>{_esc(r['strategy'])} n={r['world_size']}: {_esc(r['error'])}</li>"
                     for r in rows if r.get("error"))
    notes = "".join(f"<li>{_esc(n)}</li>" for n in ps_notes(rows) + skipped_notes(env))
    envlist = "".join(f"<li>{_esc(k)}: {_esc(v)}</li>" for k, v in env.items())
    style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}"
             "figure.plot{margin:1em 0}figure.plot svg{max-width:100%;height:auto}")
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>disttrain bench"
            f"</title><style>{style}</style></head><body><h1>disttrain bench</h1>"
            f"<p>Command: <code>{_esc(env.get('command', ''))}</code></p>"
            f"<table><tr>{head}</tr>{body}</table>"
            + (f"<ul>{notes}</ul>" if notes else "")
            + (f"<h2>Failed runs</h2><ul>{failed}</ul>" if failed else "")
            + "<h2>Plots</h2>" + plots_html(rows)
            + f"<h2>Environment</h2><ul>{envlist}</ul></body></html>\n")


def write_html(path: Path, rows: list[Row], env: dict[str, Any]) -> None:
    path.write_text(html_report(rows, env), encoding="utf-8")
