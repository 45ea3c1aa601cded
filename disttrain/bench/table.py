"""Readable terminal output for ``disttrain bench comm``: a table per (op, world size), streamed
row by row, and a closing comparison of ``auto`` with the best algorithm at each size."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TextIO

from disttrain.bench.units import format_size
from disttrain.comm.selection import AUTO_NEVER

Row = dict[str, Any]
_COLUMNS = (("size", 9), ("algorithm", 24), ("p50", 10), ("p99", 10), ("algbw", 7),
            ("busbw", 7), ("sent/rank", 10), ("theory", 10), ("model", 10), ("check", 5))


def format_time(seconds: float | None) -> str:
    """Seconds in the unit that reads best: ``87 µs``, ``4.56 ms``, ``1.23 s``."""
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def _bytes(value: float | None) -> str:
    return "-" if value is None else format_size(value)


def _algorithm(row: Row) -> str:
    if row["algorithm"] == row["chosen"]:
        return str(row["algorithm"])
    return f"{row['algorithm']}→{row['chosen']}"


def _cells(row: Row) -> list[str]:
    return [format_size(row["bytes"]), _algorithm(row), format_time(row["time_p50_s"]),
            format_time(row["time_p99_s"]), f"{row['algbw_GBps']:.2f}",
            f"{row['busbw_GBps']:.2f}", _bytes(row["bytes_sent_per_rank"]),
            _bytes(row["theory_bytes_per_rank"]), format_time(row["model_s"]),
            "ok" if row["correct"] else "WRONG"]


def _line(cells: Iterable[str]) -> str:
    return "  ".join(c.rjust(w) for c, (_, w) in zip(cells, _COLUMNS)).rstrip()


class TableWriter:
    """Prints rows as they arrive, with a header whenever the (op, world size) changes."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self._group: tuple[str, int, str] | None = None

    def row(self, row: Row) -> None:
        group = (row["op"], row["world_size"], row["transport"])
        if group != self._group:
            self._group = group
            print(f"\n# {row['op']}  world_size={row['world_size']}  "
                  f"transport={row['transport']}  (times: slowest rank per iteration; "
                  f"bandwidth in GB/s)", file=self.out)
            print(_line(name for name, _ in _COLUMNS), file=self.out)
        print(_line(_cells(row)), file=self.out, flush=True)


def auto_versus_best(rows: list[Row], by_name_only: Iterable[str] = AUTO_NEVER) -> list[str]:
    """For each (op, world size, size) with an ``auto`` row: its p50 against the best p50 of
    the algorithms ``auto`` chooses among. An algorithm only ever run by name
    (``by_name_only``: ``hierarchical``, which inside one machine is the shared-memory
    all-reduce) is no fair yardstick for the cost model's pick on the torch transport; when
    one was faster than ``auto`` it is shown after the line, with its own ratio."""
    never = frozenset(by_name_only)
    lines = []
    keys = sorted({(r["op"], r["world_size"], r["bytes"]) for r in rows})
    for op, p, nbytes in keys:
        group = [r for r in rows if (r["op"], r["world_size"], r["bytes"]) == (op, p, nbytes)]
        auto = [r for r in group if r["algorithm"] == "auto"]
        named = [r for r in group if r["algorithm"] != "auto"]
        # only by-name algorithms measured (--algorithms auto,hierarchical): against them
        eligible = [r for r in named if r["algorithm"] not in never] or named
        if not auto or not eligible:
            continue
        t_auto = auto[0]["time_p50_s"]
        best = min(eligible, key=lambda r: r["time_p50_s"])
        t_best = best["time_p50_s"]
        line = (f"{op:15s} p={p}  {format_size(nbytes):>8s}  auto→{auto[0]['chosen']:17s}"
                f"{format_time(t_auto):>10s}   best {best['algorithm']:17s}"
                f"{format_time(t_best):>10s}   auto/best {t_auto / t_best:.2f}")
        for r in sorted(named, key=lambda r: r["time_p50_s"]):
            if r is not best and r["algorithm"] in never and r["time_p50_s"] < t_auto:
                line += (f"   ({r['algorithm']}, by name only: "
                         f"{format_time(r['time_p50_s'])}, auto/it {t_auto / r['time_p50_s']:.2f})")
        lines.append(line)
    return lines
