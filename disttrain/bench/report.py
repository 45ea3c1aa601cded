"""The strategy table as text: the terminal table, Markdown, JSON rows, and the environment.

Columns (one row per strategy × world size, the global batch the same for every row):

* ``samples/s``: median over ``--repeat`` runs (± the spread, (max − min)/median);
* ``tokens/s`` (language models: samples/s × tokens per sample) and ``MFU``, the model FLOPs
  utilization against ``--peak-tflops`` (shown when given; :mod:`disttrain.train.flops`);
* ``speed-up``: samples/s over the single-process reference's; ``eff``: speed-up / ranks;
* ``vs torch``: samples/s over torch's implementation of the same idea at the same size
  (ddp / torch-ddp, zero1 and zero2 / torch-zero1, zero3 / torch-fsdp, gpipe / torch-gpipe);
  ``vs DS``: over DeepSpeed's (ddp / deepspeed-ddp, zeroS / deepspeed-zeroS, 1f1b /
  deepspeed-pipe);
* ``state``: model-state bytes (parameters, gradients, optimizer state) of the busiest rank,
  counted from the tensors the strategy keeps, each storage once; ``formula``: the ZeRO
  paper's figure for it (``-`` for strategies it does not describe: pipelines, servers);
* ``act``: the most bytes autograd held saved for backward during a step, busiest rank;
* ``RSS``: the maximum over ranks of each rank's peak resident set (on CUDA the allocator's
  peak), interpreter and libraries included;
* ``sent/step`` and ``theory``: bytes the busiest rank sent per step through disttrain.comm
  and what the strategy's formula says for the algorithms it ran (``-`` where torch's or
  DeepSpeed's own code sends, uncounted; ``native`` where disttrain handed the collectives
  to torch.distributed; on shared memory, the bytes a rank writes for the others);
* ``acc`` and ``loss``: final held-out accuracy and last training loss; the reference's are
  in its own row, and ``Δacc`` is the difference.

Parameter-server rows show ``n`` as ``workers+servers`` (``2+1``); their samples/s is the sum
of the workers' own rates (a straggler slows only itself in async mode), their ``sent/step``
is what a worker sends per step (its pushed gradients and request headers), and a line
under the table gives each one's staleness distribution and straggler.

Tensor-parallel rows get a line each under the table: the mesh (dp × pp × tp, sequence
parallel or not) and the bytes autograd kept for one transformer block, measured and by the
formula (:mod:`disttrain.parallel.tensor.theory`).
"""

from __future__ import annotations

import os
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

from disttrain.bench.units import format_size
from disttrain.comm.transports import gloo_threads
from disttrain.flags import write_rows

Row = dict[str, Any]
COLUMNS = ("strategy", "n", "batch", "samples/s", "speed-up", "eff", "vs torch", "vs DS", "state",
           "formula", "act", "RSS", "sent/step", "theory", "acc", "Δacc", "loss", "algorithm")


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _size(value: float | None) -> str:
    return "-" if value is None else format_size(value)


def _sent(row: Row) -> str:
    """Bytes sent per step; ``native`` (or ``+native``) where collectives ran inside
    torch.distributed, which moved their payload without showing its bytes."""
    sent = row.get("bytes_sent_per_rank_per_step")
    if sent is None or not row.get("bytes_unobserved"):  # None: torch's code sends, uncounted
        return _size(sent)
    return "native" if not sent else f"{_size(sent)}+native"


def table_columns(rows: list[Row]) -> tuple[str, ...]:
    """:data:`COLUMNS`, with ``tokens/s`` after ``samples/s`` when a row trained a language
    model, and ``MFU`` after it when a peak was given (``--peak-tflops``)."""
    extra = (("tokens/s",) if any(r.get("tokens_per_s") is not None for r in rows) else ()) + (
        ("MFU",) if any(r.get("mfu") is not None for r in rows) else ())
    at = COLUMNS.index("samples/s") + 1
    return (*COLUMNS[:at], *extra, *COLUMNS[at:])


def cells(row: Row, columns: tuple[str, ...] = COLUMNS) -> list[str]:
    """One row's cells, in the order of ``columns`` (:data:`COLUMNS` or
    :func:`table_columns`)."""
    servers = f"+{row['servers']}" if row.get("servers") else ""
    head = [row["strategy"], f"{row['world_size']}{servers}", str(row["global_batch"])]
    if row.get("error"):
        return head + ["FAILED"] + [""] * (len(columns) - 4)
    speed = f"{row['samples_per_s']:.1f}"
    if row.get("repeats", 1) > 1:
        speed += f" ±{100 * row['spread']:.0f}%"
    vs = "-" if row.get("vs_torch") is None else f"{row['vs_torch']:.2f}× {row['compare_to']}"
    vs_ds = "-" if row.get("vs_deepspeed") is None else f"{row['vs_deepspeed']:.2f}×"
    ref = row.get("reference_accuracy")
    delta = None if ref is None or row["accuracy"] is None else row["accuracy"] - ref
    mfu = row.get("mfu")
    by_name = dict(zip(COLUMNS[:3], head))
    by_name.update({
        "samples/s": speed, "tokens/s": _num(row.get("tokens_per_s"), ".0f"),
        "MFU": "-" if mfu is None else f"{100 * mfu:.2f}%",
        "speed-up": _num(row.get("speedup"), ".2f"), "eff": _num(row.get("efficiency"), ".0%"),
        "vs torch": vs, "vs DS": vs_ds, "state": _size(row.get("model_state_bytes")),
        "formula": _size(row.get("model_state_formula_bytes")),
        "act": _size(row.get("activation_peak_bytes")), "RSS": _size(row["peak_mem_bytes"]),
        "sent/step": _sent(row), "theory": _size(row["theory_bytes_per_rank_per_step"]),
        "acc": _num(row["accuracy"], ".4f"), "Δacc": _num(delta, "+.4f"),
        "loss": _num(row["final_loss"], ".4f"), "algorithm": row.get("algorithm") or "-"})
    return [by_name[c] for c in columns]


def text_table(rows: list[Row]) -> str:
    """The aligned terminal table, then one line per failed row (rank and error)."""
    columns = table_columns(rows)
    grid = [list(columns)] + [cells(r, columns) for r in rows]
    widths = [max(len(line[i]) for line in grid) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(line, widths))).rstrip() for line in grid]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = ps_notes(rows) + mesh_notes(rows) + zero_notes(rows)
    if notes:
        lines += ["", *notes]
    failed = [r for r in rows if r.get("error")]
    if failed:
        lines.append("")
        lines += [f"FAILED {r['strategy']} n={r['world_size']}: {r['error']}" for r in failed]
    return "\n".join(lines)


def ps_notes(rows: list[Row]) -> list[str]:
    """One line per parameter-server row: its staleness distribution and straggler."""
    notes = []
    for r in rows:
        ps = r.get("extras") or {}
        if r.get("error") or "staleness" not in ps:
            continue
        hist = ", ".join(f"{k}: {n}" for k, n in ps["staleness"].items())
        slow = ", ".join(f"rank {k} ×{f:g}" for k, f in ps["straggler"].items()) or "none"
        if ps.get("straggler_every"):
            slow += f", moving to the next worker every {ps['straggler_every']} steps"
        steps = ", ".join(f"{1e3 * t:.1f}" for t in ps.get("worker_step_s", []))
        notes.append(f"{r['strategy']} n={r['world_size']}+{ps['servers']}: staleness "
                     f"{{{hist}}} (mean {ps['staleness_mean']:.2f}, max "
                     f"{ps['staleness_max']}); straggler {slow}; step ms by worker [{steps}]")
    return notes


def mesh_notes(rows: list[Row]) -> list[str]:
    """One line per tensor- or context-parallel row: its mesh and its activation bytes per
    block."""
    notes = []
    for r in rows:
        x = r.get("extras") or {}
        if r.get("error") or "tp_size" not in x:
            continue
        sp = "sequence parallel" if x.get("sequence_parallel") else "no sequence parallelism"
        acts = ""
        if x.get("activation_bytes_per_block") is not None:
            acts = (f"; activations per block {_size(x['activation_bytes_per_block'])} "
                    f"(formula {_size(x.get('activation_bytes_per_block_formula'))})")
        cp = f" × cp {x['cp_size']} ({x.get('cp_variant')})" if x.get("cp_size", 1) > 1 else ""
        notes.append(f"{r['strategy']} n={r['world_size']}: dp {x.get('dp_size')} × pp "
                     f"{x.get('pp_size')}{cp} × tp {x['tp_size']}, {sp}{acts}")
    return notes


def zero_notes(rows: list[Row]) -> list[str]:
    """One line per ZeRO row: what wrapping the model held at its peak (built eagerly, or on
    the meta device with --meta-init) and, under hybrid sharding, the groups."""
    notes = []
    for r in rows:
        x = r.get("extras") or {}
        if r.get("error") or x.get("wrap_peak_bytes") is None:
            continue
        how = "meta-device init" if x.get("meta_init") else "eager init"
        hybrid = (f"hybrid: shard {x['dp_shard']} × replicate {x['dp_replicate']}; "
                  if x.get("dp_shard") else "")
        notes.append(f"{r['strategy']} n={r['world_size']}: {hybrid}wrapping held "
                     f"{_size(x['wrap_peak_bytes'])} at its peak ({how})")
    return notes


def skipped_notes(env: dict[str, Any]) -> list[str]:
    """One line per row left out because it cannot run here (a missing optional package)."""
    return [f"{name} skipped: {why}" for name, why in env.get("skipped", [])]


def markdown_table(rows: list[Row], env: dict[str, Any]) -> str:
    """The table in Markdown, headed by the command and the machine that produced it."""
    columns = table_columns(rows)
    out = [f"Command: `{env.get('command', 'disttrain bench')}`  ",
           f"Machine: {env.get('cpu')}, {env.get('cpu_count')} cores; torch "
           f"{env.get('torch')}; backend {env.get('backend')}; transport "
           f"{env.get('transport')}; commit {env.get('commit') or 'unknown'}; "
           f"{env.get('date')}", "",
           "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in cells(r, columns)) + " |"
            for r in rows]
    notes = ps_notes(rows) + mesh_notes(rows) + zero_notes(rows) + skipped_notes(env)
    if notes:
        out += ["", *[f"* {note}" for note in notes]]
    failed = [r for r in rows if r.get("error")]
    if failed:
        out.append("")
        out += [f"* {r['strategy']} n={r['world_size']} failed: {r['error']}" for r in failed]
    return "\n".join(out) + "\n"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    """The checkout's commit (with ``-dirty`` when it has changes), if it is a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                                text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}-dirty" if dirty.strip() else commit or None


def environment(config: Any, command: str) -> dict[str, Any]:
    """Where and how the table was made (recorded in every JSON row)."""
    import torch

    return {"command": command, "torch": torch.__version__,
            "backend": getattr(config, "backend", "gloo"), "device": _device(config),
            "transport": config.transport, "cpu": cpu_model(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "platform": platform.platform(),
            "commit": git_commit(), "model": config.model, "dataset": config.dataset,
            "epochs": config.length[0], "steps": config.length[1], "repeat": config.repeat,
            "servers": getattr(config, "servers", None),
            "straggler": dict(getattr(config, "straggler", ())),
            "straggler_every": getattr(config, "straggler_every", None),
            "bind_cores": getattr(config, "bind_cores", False),
            "gloo_io_threads": gloo_threads.policy_from_env(),
            "preset": getattr(config, "preset", None),
            "optimizer": getattr(config, "optimizer", None), "lr": getattr(config, "lr", None),
            "global_batch": getattr(config, "global_batch", None),
            "algorithm": getattr(config, "algorithm", None),
            "skipped": config.skipped() if hasattr(config, "skipped") else [],
            "untimed_steps": config.untimed_steps,
            "peak_tflops": getattr(config, "peak_tflops", None),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def _device(config: Any) -> str:
    """``cpu``, or the GPU's name when the ranks train on one."""
    import torch

    name = getattr(config, "device", "cpu")
    if name == "cpu" or not torch.cuda.is_available():
        return "cpu"
    return f"cuda ({torch.cuda.get_device_name()})"


def write_json(path: Path, rows: list[Row], env: dict[str, Any]) -> None:
    """JSON Lines: one object per row, each carrying the environment under ``env``."""
    write_rows(path, ({**row, "env": env} for row in rows))


def print_table(rows: list[Row], out: TextIO, interrupted: bool = False,
                env: dict[str, Any] | None = None) -> None:
    print(text_table(rows), file=out)
    for note in skipped_notes(env or {}):
        print(note, file=out)
    if interrupted:
        print("(interrupted: the rows above are the runs that finished)", file=out)
