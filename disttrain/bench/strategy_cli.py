"""``disttrain bench`` with no subcommand: the strategy comparison table.

    disttrain bench                                   # every strategy, the default preset, n=2
    disttrain bench --list                            # the presets and the experiments
    disttrain bench --preset lenet-digits             # the small LeNet table (~2 min)
    disttrain bench --preset distributedtest          # the DistributedTest rows (~10 min)
    disttrain bench --strategies ddp,torch-ddp -n 1,2,4 --steps 50 --repeat 3
    disttrain bench --json rows.jsonl --markdown table.md --html report.html --trace traces/
    # tensor parallelism against torch's, on the transformer
    disttrain bench --strategies tp,torch-tp,tp-sp,torch-tp-sp -n 2 --model transformer \
        --dataset synthetic-lm --steps 60
    # the straggler experiment: one worker slowed 2x, sync vs async vs SSP in the same run
    disttrain bench --strategies ps-sync,ps-async,ps-ssp -n 2,4 --servers 1 \
        --straggler 1:2 --staleness 2 --eval-every 0 --steps 200 --global-batch 256

Exit codes: 0 every row ran, 1 some row failed (named in the table), 2 bad arguments,
130 interrupted (the finished rows are still printed and written).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from disttrain.bench.experiments import BenchConfig, Run, experiments, plan
from disttrain.bench.presets import DEFAULT_PRESET, PRESETS
from disttrain.bench.transports import TRANSPORTS
from disttrain.comm.transports import gloo_threads
from disttrain.flags import add_alias, add_json_argument
from disttrain.train.cli import add_token_arguments
from disttrain.train.config import OPTIMIZERS, STALENESS_LR
from disttrain.train.data import DataOptions
from disttrain.train.flops import peak_tflops_value

Row = dict[str, Any]


def _csv_names(text: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    if not names:
        raise argparse.ArgumentTypeError("empty list of strategies")
    return names


def _csv_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,2,4, "
                                         f"got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("empty list of world sizes")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The table's flags, on the ``bench`` parser itself."""
    d = BenchConfig()
    parser.add_argument("--list", action="store_true",
                        help="list the presets and the experiments and exit")
    parser.add_argument("--preset", default=DEFAULT_PRESET, choices=tuple(PRESETS),
                        help="the workload: model, data, optimizer, batch, length and rows "
                        "(default %(default)s); the flags below override its values")
    parser.add_argument("--strategies", type=_csv_names, default=None,
                        help="comma-separated experiments (default: the preset's, every "
                        "registered one for most; 'single' always runs as the reference)")
    parser.add_argument("-n", "--world-sizes", type=_csv_ints, default=d.world_sizes,
                        help="comma-separated numbers of ranks (default: 2)")
    parser.add_argument("--model", default=None, help="model (default: the preset's); "
                        "hf:gpt2 or hf:llama with --model-config")
    parser.add_argument("--model-config", default=None, metavar="FILE.json",
                        help="hf:gpt2, hf:llama: the model's transformers config as JSON")
    parser.add_argument("--dataset", default=None,
                        help="dataset (default: the preset's): a registered name, "
                        "tokens:PATH (a file of token ids), text:PATH, or "
                        "package.module:factory")
    parser.add_argument("--optimizer", default=None, choices=OPTIMIZERS,
                        help="optimizer of every row (default: the preset's)")
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate (default: the preset's)")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=int, default=None,
                        help="passes over the training split (default: the preset's)")
    length.add_argument("--steps", type=int, default=None, help="optimizer steps per run")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="samples per step over all ranks, the same for every row "
                        "(default: the preset's)")
    parser.add_argument("--reference-threads", type=int, default=None,
                        help="intra-op threads of the single-process reference (default: the "
                        "largest -n, up to the cores: it uses the cores the ranks use)")
    parser.add_argument("--repeat", type=int, default=d.repeat,
                        help="fresh runs per row, taken round the table (every row once, "
                        "then again), so a slow spell of the machine hits one run of many "
                        "rows rather than every run of one; the table shows the median and "
                        "the spread")
    parser.add_argument("--transport", default=d.transport,
                        help=f"transport of the disttrain rows (default %(default)s: shared "
                        f"memory between local ranks; the baselines always use torch; known: "
                        f"{', '.join(TRANSPORTS)})")
    parser.add_argument("--algorithm", default=d.algorithm,
                        help="collective algorithm of ddp and zero (default %(default)s: 'shm' "
                        "on shared memory, the cost model's pick on torch; 'ring', 'tree', … "
                        "by name; every one but 'native' has its bytes counted)")
    parser.add_argument("--bind-cores", action="store_true",
                        help="pin each rank to a core of its own when there are enough cores, "
                        "or the same number of ranks to every core when the ranks are a "
                        "multiple of the cores (every row alike, like DeepSpeed's "
                        "--bind_cores_to_rank): otherwise the kernel may keep two ranks on "
                        "one core for a whole run")
    parser.add_argument("--device", default=d.device, metavar="{auto,cpu,cuda}",
                        help="where every rank trains (as in disttrain run: auto is this "
                        "rank's GPU when CUDA is available)")
    parser.add_argument("--backend", default=d.backend, choices=("auto", "gloo", "nccl"),
                        help="torch.distributed backend of the ranks (auto follows --device; "
                        "gloo lets several ranks share one GPU)")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="steps between evaluations, the accuracy curves (default: the "
                        "preset's; 0: only at the end, so nothing makes parameter-server "
                        "workers wait for each other)")
    _ps_arguments(parser, d)
    add_token_arguments(parser.add_argument_group(
        "language-model data (synthetic-lm, tokens:PATH, text:PATH; default: the preset's)"))
    mesh = parser.add_argument_group("tensor-parallel rows (tp, tp-sp, 3d, torch-tp, "
                                     "torch-tp-sp: --model transformer --dataset synthetic-lm)")
    mesh.add_argument("--tp", type=int, default=d.tp_size, dest="tp_size",
                      help="3d rows: ranks per tensor-parallel group (default %(default)s; tp "
                      "and tp-sp use every rank)")
    mesh.add_argument("--pp", type=int, default=d.pp_size, dest="pp_size",
                      help="3d rows: pipeline stages (default %(default)s); dp takes the rest")
    zero = parser.add_argument_group("ZeRO rows (zero1, zero2, zero3)")
    zero.add_argument("--dp-shard", type=int, default=None,
                      help="hybrid sharding: ZeRO inside groups of this many ranks, "
                           "replicated across the groups (default: shard over all)")
    zero.add_argument("--meta-init", action="store_true",
                      help="also run each ZeRO row with the model built on the meta device "
                           "(row name +meta): its wrap-time peak beside the eager one")
    blocks = parser.add_argument_group("second rows of disttrain's strategies")
    blocks.add_argument("--activation-checkpointing", choices=("none", "full", "selective"),
                        default="none", help="also run every row with the blocks' "
                        "activations recomputed in backward (row name +ac): the activation "
                        "column's drop and the extra time beside the plain row")
    blocks.add_argument("--compile", action="store_true",
                        help="also run every row with its blocks torch.compiled (row name "
                             "+compile; not under zero3)")
    blocks.add_argument("--compile-backend", default="inductor",
                        help="torch.compile's backend (inductor; aot_eager needs no C++ "
                             "compiler)")
    timeout = parser.add_argument(
        "--comm-timeout", type=float, default=d.timeout_s,
        help="seconds any collective may wait; a rank silent for 4× this is stopped "
        "(default %(default)s)")
    add_alias(parser, "--timeout", new=timeout)
    add_json_argument(parser, "row, with the environment under 'env'")
    parser.add_argument("--peak-tflops", type=peak_tflops_value, default=None, metavar="TFLOPS",
                        help="one device's peak (a GPU's, or this machine's CPU): adds the "
                             "MFU column for transformer models; auto: measure it here "
                             "first, as `disttrain info` does")
    parser.add_argument("--markdown", type=Path, metavar="FILE", help="write a Markdown table")
    parser.add_argument("--html", type=Path, metavar="FILE",
                        help="write a self-contained HTML report with plots")
    parser.add_argument("--trace", type=Path, metavar="DIR",
                        help="write a Chrome-trace JSON per run (all ranks) into DIR")


def _ps_arguments(parser: argparse.ArgumentParser, d: BenchConfig) -> None:
    ps = parser.add_argument_group("parameter-server rows (ps-sync, ps-async, ps-ssp)")
    ps.add_argument("--servers", type=int, default=d.servers,
                    help="server ranks started beside the -n workers (default %(default)s)")
    ps.add_argument("--staleness", type=int, default=None,
                    help="ps-ssp: steps a worker may run ahead of the slowest (default 2)")
    ps.add_argument("--staleness-lr", default=None, choices=STALENESS_LR,
                    help="ps-async, ps-ssp: 'inverse' divides each update's learning rate by "
                    "its staleness (the default), 'none' does not")
    ps.add_argument("--straggler", default=None, metavar="RANK:FACTOR[:EVERY]",
                    help="slow worker RANK's steps to FACTOR× its own work, e.g. 1:2 (workers "
                    "are ranks 0..n-1; other rows are not slowed). With :EVERY, e.g. 1:2:5, "
                    "the slow-down is transient: it moves to the next worker every EVERY steps")


def list_experiments() -> str:
    lines = ["presets (--preset):"]
    for name, preset in PRESETS.items():
        default = " [default]" if name == DEFAULT_PRESET else ""
        lines.append(f"  {name:15s} {preset.description}{default}")
    lines.append("experiments (--strategies):")
    for name, exp in experiments().items():
        vs = f" [compared with {exp.compare_to}]" if exp.compare_to else ""
        lines.append(f"  {name:15s} {exp.description}{vs}")
    return "\n".join(lines)


def make_config(args: argparse.Namespace) -> BenchConfig:
    from disttrain.bench.strategy_bench import backend_of
    from disttrain.bench.transports import check_transport
    from disttrain.train.cli import straggler_options, token_options
    from disttrain.train.device import require_available

    check_transport(args.transport)
    gloo_threads.policy_from_env()  # a typo in DISTTRAIN_GLOO_IO_THREADS: said here, once
    config = BenchConfig.from_preset(
        args.preset, strategies=args.strategies, world_sizes=args.world_sizes,
        model=args.model, model_config=args.model_config, dataset=args.dataset,
        optimizer=args.optimizer, lr=args.lr,
        epochs=args.epochs, steps=args.steps, global_batch=args.global_batch,
        repeat=args.repeat, transport=args.transport, algorithm=args.algorithm,
        reference_threads=args.reference_threads, timeout_s=args.comm_timeout,
        eval_every=args.eval_every, servers=args.servers, staleness=args.staleness,
        staleness_lr=args.staleness_lr, bind_cores=args.bind_cores, tp_size=args.tp_size,
        pp_size=args.pp_size, dp_shard=args.dp_shard, meta_init=args.meta_init,
        activation_checkpointing=args.activation_checkpointing, compile=args.compile,
        compile_backend=args.compile_backend,
        device=args.device, backend=args.backend,
        peak_tflops=_measured_peak(args.peak_tflops, args.device),
        data=_data_options(PRESETS[args.preset].data, token_options(args)),
        **straggler_options(args.straggler))
    require_available(config.device)
    _check_workload(config)
    for planned in plan(config):  # every run's backend can run here (NCCL: a GPU per rank)
        backend_of(config, planned)
    return config


def _measured_peak(peak: float | str | None, device: str) -> float | None:
    """--peak-tflops: as given, or ``auto``: one device's float32 matmul peak measured now,
    before any rank starts."""
    if peak != "auto":
        return None if peak is None else float(peak)
    from disttrain.train.flops import measured_peak

    measured, where = measured_peak(device, "float32")
    print(f"disttrain bench: peak {measured:.4g} TFLOP/s measured ({where}, float32 matmul)",
          file=sys.stderr)
    return measured


def _data_options(preset: DataOptions, given: dict[str, Any]) -> DataOptions | None:
    """The preset's DataOptions with the --seq-len, --vocab-size, --token-dtype given
    (None, the preset's, when none is)."""
    return dataclasses.replace(preset, **given) if given else None


def _check_workload(config: BenchConfig) -> None:
    """The model builds on the dataset (``--model mlp`` on the default preset's tokens does
    not): said once, before any rank starts, instead of as every row's failure."""
    from disttrain.train.data import build_dataset
    from disttrain.train.models import build_model, check_model, is_hf_model

    try:
        info = build_dataset(config.dataset, config.data).info
        if is_hf_model(config.model):  # built on the meta device: shapes only
            check_model(config.model, config.model_config, lambda: info)
        else:
            build_model(config.model, info, config.model_config)
    except ValueError as exc:
        raise ValueError(f"{exc} (--model {config.model} --dataset {config.dataset}; a "
                         f"preset's dataset stays unless --dataset is given)") from None


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.list:
        print(list_experiments())
        return 0
    try:
        config = make_config(args)
    except ValueError as exc:
        parser.error(str(exc))
    return _run_table(config, args)


def _run_table(config: BenchConfig, args: argparse.Namespace) -> int:
    from disttrain.bench.report import environment, print_table
    from disttrain.bench.strategy_bench import run_table

    runs = plan(config)
    epochs, steps = config.length
    length = f"{steps} steps" if steps else f"{epochs} epoch(s)"
    rounds = f" × {config.repeat} rounds of the table" if config.repeat > 1 else ""
    print(f"disttrain bench --preset {config.preset}: {len(runs)} runs{rounds} of "
          f"{config.model} on {config.dataset} ({config.optimizer}, lr {config.lr:g}), "
          f"{length}, global batch {config.global_batch}, transport {config.transport}"
          f"{', ranks bound to cores' if config.bind_cores else ''}, Gloo I/O threads "
          f"{gloo_threads.policy_from_env()} "
          f"(Ctrl-C stops and keeps the finished rows)", file=sys.stderr, flush=True)
    started = time.monotonic()

    # with --repeat the table goes round several times; a row is printed after its last run
    open_line = [False]

    def on_start(i: int, total: int, run: Run) -> None:
        if open_line[0]:
            print(file=sys.stderr)
        print(f"[{i + 1}/{total}] {run.label} ...", end="", file=sys.stderr, flush=True)
        open_line[0] = True

    def on_row(row: Row) -> None:
        what = "FAILED" if row.get("error") else f"{row['samples_per_s']:.1f} samples/s"
        label = "" if open_line[0] and config.repeat == 1 else (
            f" {row['strategy']} n={row['world_size']}:")
        print(f"{label} {what} ({time.monotonic() - started:.0f}s)", file=sys.stderr,
              flush=True)
        open_line[0] = False

    def on_progress(run: Run, step: int) -> None:  # every 10 steps, from rank 0's heartbeat
        print(f" step {step}/{steps}" if steps else f" step {step}", end="",
              file=sys.stderr, flush=True)

    outcome = run_table(config, on_row, on_start, trace=args.trace is not None,
                        on_progress=on_progress)
    rows = outcome.rows
    if outcome.interrupted:
        print(" interrupted", file=sys.stderr, flush=True)
    env = environment(config, "disttrain bench" + "".join(
        f" {shlex.quote(a)}" for a in sys.argv[2:]))
    print_table(rows, sys.stdout, outcome.interrupted, env)
    _write_outputs(args, rows, env, outcome.traces)
    if outcome.interrupted:
        return 130
    return 1 if any(r.get("error") for r in rows) or not rows else 0


def _write_outputs(args: argparse.Namespace, rows: list[Row], env: dict[str, Any],
                   traces: dict[str, Any]) -> None:
    from disttrain.bench.html_report import write_html
    from disttrain.bench.report import markdown_table, write_json
    from disttrain.bench.trace import write_traces

    if args.json:
        write_json(args.json, rows, env)
    if args.markdown:
        args.markdown.write_text(markdown_table(rows, env))
    if args.html:
        write_html(args.html, rows, env)
    if args.trace:
        paths = write_traces(args.trace, traces)
        print(f"traces: {len(paths)} file(s) in {args.trace}", file=sys.stderr)
