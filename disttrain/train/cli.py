"""``disttrain run``: train one model with one strategy and report its accuracy.

    disttrain run --strategy ddp -n 2 --model lenet --dataset digits --epochs 3
    disttrain run --strategy single --model lenet --dataset digits --epochs 3   # the reference
    disttrain run --strategy zero2 -n 2 --optimizer adam --lr 1e-3 --epochs 3
    disttrain run --strategy 1f1b -n 2 --microbatches 4 --model mlp --epochs 1
    disttrain run --strategy pipeline --schedule gpipe -n 4 --pp 2 --microbatches 8
    disttrain run --strategy tp -n 2 --model transformer --dataset synthetic-lm --epochs 1
    disttrain run --strategy 3d -n 4 --dp 2 --tp 2 --pp 1 --model transformer \
        --dataset synthetic-lm --optimizer adam --lr 1e-3 --zero 1
    disttrain run --strategy ps-ssp -n 4 --servers 1 --staleness 2 --straggler 1:2
    disttrain run --strategy ddp -n 2 --model transformer --dataset tokens:data/train.bin \
        --vocab-size 50304 --seq-len 256 --optimizer adam --lr 1e-3 --steps 1000
    disttrain run --model transformer --dataset text:corpus.txt --seq-len 128 --steps 200
    disttrain run --strategy zero2 -n 2 --model transformer --dataset synthetic-lm \
        --lr-schedule cosine --warmup-steps 10 --min-lr 1e-4 --steps 30 --peak-tflops auto
    disttrain run --config run.toml --steps 100   # a recipe file; the command line overrides it

With ``-n N > 1`` it starts N local ranks itself (the parameter-server strategies start N
workers and --servers more ranks); inside a launched job (torchrun, ``disttrain launch``,
``srun`` or ``mpirun``: the same detection as ``disttrain.init()``) it runs as that rank,
and the last ``DISTTRAIN_PS_SERVERS`` (or --servers) ranks serve.
Exit codes: 0 done, 1 a rank failed (named on stderr), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

from disttrain.comm import CommConfig
from disttrain.flags import add_alias, add_json_argument, write_rows
from disttrain.train.config import (
    DTYPES,
    OPTIMIZERS,
    PRECISIONS,
    STALENESS_LR,
    ParallelOptions,
    TrainConfig,
)
from disttrain.train.config_file import (
    BooleanOptional,
    add_config_arguments,
    dump,
    track_given,
)
from disttrain.train.data import DATASETS, DataOptions, build_dataset, check_dataset
from disttrain.train.device import local_backend, require_available, select_local_gpu
from disttrain.train.flops import measured_peak, peak_tflops_value
from disttrain.train.models import HF_MODELS, MODELS, check_model
from disttrain.train.result import TrainResult
from disttrain.train.schedule import SCHEDULES
from disttrain.train.strategies import STRATEGIES, get_strategy, ranks_needed
from disttrain.train.token_files import TOKEN_DTYPES

RESTART_COUNT_VAR = "TORCHELASTIC_RESTART_COUNT"  # torchrun's; disttrain launch sets it too


def configure(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("run", help="train a model with one strategy",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    track_given(p)  # what the command line gave wins over --config's file
    add_config_arguments(p)
    p.add_argument("--strategy", default="single",
                   help=f"one of: {', '.join(STRATEGIES)}; 'pipeline' means --schedule")
    nproc = p.add_argument("-n", "--nproc-per-node", type=int, default=None,
                           dest="nproc_per_node",
                           help="worker ranks to start on this machine (default 1; in a "
                                "launched job: WORLD_SIZE)")
    add_alias(p, "--nproc", new=nproc)
    p.add_argument("--model", default="lenet",
                   help=f"one of: {', '.join(MODELS)}; {', '.join(HF_MODELS)} (Hugging Face, "
                        f"with --model-config); or package.module:factory")
    p.add_argument("--model-config", default=None, metavar="FILE.json",
                   help="hf:gpt2, hf:llama: the model's transformers config as JSON (built "
                        "from it, never downloaded; vocab_size defaults to the dataset's)")
    p.add_argument("--dataset", default="digits",
                   help=f"one of: {', '.join(DATASETS)}; tokens:PATH (a file of token ids, "
                        f"--token-dtype), text:PATH (bytes); or package.module:factory")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=int, help="passes over the training split (default 1)")
    length.add_argument("--steps", type=int, help="optimizer steps in total")
    defaults = TrainConfig()
    batch = p.add_argument("--global-batch", type=int, default=defaults.global_batch,
                           help="samples per step over all ranks (default %(default)s)")
    add_alias(p, "--batch", new=batch)
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per step per rank")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=defaults.optimizer)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--lr-schedule", choices=SCHEDULES, default=defaults.lr_schedule,
                   help="the learning rate over the run after --warmup-steps: constant, or "
                        "down to --min-lr at the last step along a line (linear) or half a "
                        "cosine (cosine)")
    p.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps,
                   help="learning-rate warmup: step k < N runs at lr·(k+1)/(N+1), rising "
                        "from a small fraction as torchtitan's (default 0: none)")
    p.add_argument("--min-lr", type=float, default=defaults.min_lr,
                   help="the rate linear and cosine end the run at (default 0)")
    p.add_argument("--momentum", type=float, default=defaults.momentum)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--no-decay-norms-biases", action="store_true",
                   help="no weight decay on biases and norm weights (parameters of fewer "
                        "than two dimensions), --weight-decay on the rest")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clip-grad-norm", type=float, default=None, metavar="MAX_NORM",
                   help="clip the whole model's gradient to this global norm before every "
                        "update (over replicas, ZeRO shards, stages and tp slices; the norm "
                        "before clipping is in the metrics line)")
    p.add_argument("--activation-checkpointing", choices=("none", "full", "selective"),
                   default="none", help="recompute each block's forward in backward instead "
                   "of keeping its activations: every block (full) or every second one "
                   "(selective)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each block of the model (not under zero3)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile's backend (inductor; aot_eager needs no C++ compiler)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="fp32; bf16 or fp16 autocast (fp16 with dynamic loss scaling)")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="the parameters' dtype (float inputs follow): float64 for numerical "
                        "checks, e.g. a strategy against single at tight tolerance")
    p.add_argument("--device", default="auto", metavar="{auto,cpu,cuda}",
                   help="where each rank trains: auto (this rank's GPU, cuda:LOCAL_RANK, when "
                        "CUDA is available, else the CPU), cpu, cuda or cuda:N")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                   help="torch.distributed backend of the ranks started here: auto follows "
                        "--device (cuda: nccl, cpu: gloo); gloo under --device cuda stages "
                        "CUDA tensors through pinned host memory (several ranks per GPU)")
    _loop_arguments(p)
    _data_and_parallel_arguments(p)
    p.add_argument("--transport", choices=("torch", "shm", "auto"), default="torch",
                   help="how disttrain.comm moves bytes between ranks (default torch; shm "
                        "needs every rank on one machine, auto picks it when they are)")
    p.add_argument("--comm-timeout", type=float, default=None,
                   help="seconds any collective may wait (default: $DISTTRAIN_TIMEOUT, else "
                        "120)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds the whole run may take (default: no limit)")
    add_json_argument(p, "run (rank 0's result summary)")
    p.set_defaults(func=run)


def _loop_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--eval-every", type=int, default=None,
                   help="evaluate every N steps (default: after each epoch; 0: at the end)")
    p.add_argument("--log-every", type=int, default=TrainConfig().log_every)
    p.add_argument("--untimed-steps", type=int, default=TrainConfig().untimed_steps,
                   help="first steps left out of samples/s, tokens/s and MFU (their "
                        "activations are measured instead; default %(default)s)")
    p.add_argument("--peak-tflops", type=peak_tflops_value, default=None, metavar="TFLOPS",
                   help="one device's peak (a GPU's, or one machine's CPU), the yardstick of "
                        "the model FLOPs utilization (mfu) of transformer models; auto: "
                        "measure it here first, as `disttrain info` does")
    p.add_argument("--checkpoint-dir", help="write checkpoints here")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir (automatic "
                        "when the launcher restarts the job: docs/recovery.md)")
    p.add_argument("--tensorboard", metavar="DIR", help="TensorBoard log dir (if installed)")
    p.add_argument("--progress", action=BooleanOptional, default=None,
                   help="progress bar (default: when stderr is a terminal)")


def _data_and_parallel_arguments(p: argparse.ArgumentParser) -> None:
    data = DataOptions()
    group = p.add_argument_group("data")
    group.add_argument("--samples", type=int, default=data.num_samples)
    group.add_argument("--input-shape", default="1,8,8", help="e.g. 3,32,32 or 20")
    group.add_argument("--num-classes", type=int, default=data.num_classes)
    group.add_argument("--data-seed", type=int, default=data.seed)
    add_token_arguments(group)
    group.add_argument("--loader-workers", type=int, default=data.loader_workers,
                       help="threads reading batches ahead of the step (0: in the step; "
                            "default %(default)s)")
    group.add_argument("--prefetch", type=int, default=data.prefetch,
                       help="steps' batches read ahead of the running step (default "
                            "%(default)s)")
    ddp = p.add_argument_group("data parallel")
    ddp.add_argument("--bucket-cap-mb", type=float, default=ParallelOptions().bucket_cap_mb)
    ddp.add_argument("--compression", default=None, help="gradient compression ('ddp' only)")
    ddp.add_argument("--find-unused-parameters", action="store_true")
    ddp.add_argument("--algorithm", default=None,
                     help="collective algorithm of disttrain.comm for 'ddp' (ring, tree, "
                          "halving_doubling, naive, native), 'zero1-3' (ring, naive, "
                          "halving_doubling, native) and 'tp', 'tp-sp', '3d' (every "
                          "collective they run); default: auto. 'native' traffic runs "
                          "inside torch and is not counted in comm_MB")
    pipe = p.add_argument_group("pipeline and model parallel")
    pipe.add_argument("--schedule", default=None,
                      help="gpipe or 1f1b (with --strategy pipeline; default 1f1b)")
    pipe.add_argument("--microbatches", type=int, default=None,
                      help="micro-batches per step (gpipe, 1f1b, torch-gpipe, deepspeed-pipe; "
                           "default 8)")
    pipe.add_argument("--partition", default=None,
                      help="layers per stage: params (balance parameter counts, default), "
                           "time (balance measured time) or counts like 3,2,2")
    pp = pipe.add_argument("--pp", type=int, default=None, dest="pp_size",
                           help="stages per pipeline (gpipe, 1f1b, 3d): -n/pp data-parallel "
                                "replicas (default: one pipeline over all ranks; 3d: 1)")
    add_alias(pipe, "--pp-size", new=pp)
    pipe.add_argument("--virtual-stages", type=int, default=None,
                      help="1f1b: model chunks per stage, interleaved 1F1B (Megatron-LM): the "
                           "bubble shrinks to (p−1)/(v·m+p−1) for v times the messages; "
                           "--microbatches a multiple of --pp (default 1)")
    mesh = p.add_argument_group("tensor parallel and the dp × pp × tp mesh (tp, tp-sp, 3d, "
                                "torch-tp)")
    mesh.add_argument("--tp", type=int, default=None, dest="tp_size",
                      help="3d: ranks per tensor-parallel group (default 1; tp and tp-sp use "
                           "every rank)")
    mesh.add_argument("--dp", type=int, default=None, dest="dp_size",
                      help="3d: data-parallel replicas (default: -n / (tp · pp))")
    mesh.add_argument("--dp-shard", type=int, default=None,
                      help="zero1-3: hybrid sharding, ZeRO inside groups of this many ranks "
                           "(a node), replicated across the groups (default: shard over all)")
    mesh.add_argument("--dp-replicate", type=int, default=None,
                      help="zero1-3: how many replica groups (default: -n / --dp-shard)")
    mesh.add_argument("--meta-init", action="store_true",
                      help="zero1-3: build the model on the meta device; each rank "
                           "materialises its shards one unit at a time (a model larger than "
                           "one rank; equal to eager initialisation)")
    mesh.add_argument("--sequence-parallel", action="store_true",
                      help="split LayerNorm regions along the sequence (tp, 3d, torch-tp; "
                           "tp-sp implies it)")
    mesh.add_argument("--cp", type=int, default=None, dest="cp_size",
                      help="cp, 3d: ranks each sequence is split over (context parallelism; "
                           "cp: default every rank)")
    mesh.add_argument("--cp-variant", default="ring", choices=("ring", "ulysses"),
                      help="cp: key/value blocks passed around a ring, or an all-to-all over "
                           "heads (Ulysses)")
    mesh.add_argument("--ep", type=int, default=None, dest="ep_size",
                      help="ep: ranks the experts of each MoE layer are spread over (default: "
                           "every rank; the rest are data-parallel replicas)")
    mesh.add_argument("--zero", type=int, default=None, choices=(1, 2, 3),
                      help="3d: ZeRO stage 1, 2 or 3 over the dp groups (default: plain data "
                           "parallel)")
    ps = p.add_argument_group("parameter server (ps-sync, ps-async, ps-ssp)")
    ps.add_argument("--servers", type=int, default=None,
                    help="server processes besides the -n workers (default 1; in a launched "
                         "job: DISTTRAIN_PS_SERVERS)")
    ps.add_argument("--staleness", type=int, default=None,
                    help="ps-ssp: steps a worker may run ahead of the slowest (default 2)")
    ps.add_argument("--staleness-lr", choices=STALENESS_LR, default=None,
                    help="ps-async, ps-ssp: 'inverse' divides each update's learning rate by "
                         "its staleness (Zhang et al. 2016; the default), 'none' does not")
    ps.add_argument("--straggler", default=None, metavar="RANK:FACTOR[:EVERY]",
                    help="slow worker RANK's steps to FACTOR× its own work (e.g. 1:2; several: "
                         "1:2,3:1.5); workers are ranks 0..N-1. With :EVERY the slow-down is "
                         "transient: it starts on RANK and moves to the next worker every "
                         "EVERY steps (e.g. 1:2:5)")


def add_token_arguments(group: argparse._ActionsContainer) -> None:
    """The flags of the language-model data (synthetic-lm, tokens:PATH, text:PATH), shared
    with ``disttrain bench``."""
    data = DataOptions()
    group.add_argument("--seq-len", type=int, default=None,
                       help=f"tokens per sample (default {data.seq_len})")
    group.add_argument("--vocab-size", type=int, default=None,
                       help=f"synthetic-lm's vocabulary; a tokens:PATH file's ids must be "
                            f"below it (default {data.vocab_size}; text:PATH: 256)")
    group.add_argument("--token-dtype", choices=TOKEN_DTYPES, default=None,
                       help=f"how a tokens:PATH file stores each id (default "
                            f"{data.token_dtype}, nanoGPT's)")


def token_options(args: argparse.Namespace) -> dict[str, Any]:
    """The DataOptions fields ``add_token_arguments``'s flags set (those given)."""
    given = {"seq_len": args.seq_len, "vocab_size": args.vocab_size,
             "token_dtype": args.token_dtype}
    return {k: v for k, v in given.items() if v is not None}


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Map the flags onto TrainConfig (raises ValueError with the fix on bad values)."""
    try:
        shape = tuple(int(d) for d in args.input_shape.split(","))
    except ValueError:
        raise ValueError(f"--input-shape must be comma-separated ints like 1,8,8, got "
                         f"{args.input_shape!r}") from None
    data = DataOptions(num_samples=args.samples, input_shape=shape, num_classes=args.num_classes,
                       seed=args.data_seed, loader_workers=args.loader_workers,
                       prefetch=args.prefetch, **token_options(args))
    parallel = ParallelOptions(bucket_cap_mb=args.bucket_cap_mb, compression=args.compression,
                               find_unused_parameters=args.find_unused_parameters,
                               algorithm=args.algorithm, schedule=args.schedule,
                               microbatches=args.microbatches,
                               partition=parse_partition(args.partition),
                               pp_size=args.pp_size, virtual_stages=args.virtual_stages,
                               tp_size=args.tp_size,
                               dp_size=args.dp_size, cp_size=args.cp_size,
                               cp_variant=args.cp_variant, ep_size=args.ep_size,
                               dp_shard=args.dp_shard, dp_replicate=args.dp_replicate,
                               meta_init=args.meta_init,
                               sequence_parallel=args.sequence_parallel,
                               zero=args.zero, servers=args.servers,
                               staleness=args.staleness, staleness_lr=args.staleness_lr,
                               **straggler_options(args.straggler))
    return TrainConfig(
        model=args.model, model_config=args.model_config, dataset=args.dataset,
        strategy=args.strategy, data=data,
        parallel=parallel, epochs=args.epochs, steps=args.steps, global_batch=args.global_batch,
        accumulate=args.accumulate, optimizer=args.optimizer, lr=args.lr,
        lr_schedule=args.lr_schedule, warmup_steps=args.warmup_steps, min_lr=args.min_lr,
        momentum=args.momentum, weight_decay=args.weight_decay,
        no_decay_norms_biases=args.no_decay_norms_biases, seed=args.seed,
        precision=args.precision, clip_grad_norm=args.clip_grad_norm, dtype=args.dtype,
        activation_checkpointing=args.activation_checkpointing, compile=args.compile,
        compile_backend=args.compile_backend,
        device=args.device,
        eval_every=args.eval_every,
        log_every=args.log_every, untimed_steps=args.untimed_steps,
        peak_tflops=None if args.peak_tflops in (None, "auto") else args.peak_tflops,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        resume=args.resume, tensorboard_dir=args.tensorboard, progress=args.progress)


def run_parser() -> argparse.ArgumentParser:
    """A parser of ``disttrain run``'s flags alone (the keys --print-config writes)."""
    subparsers = argparse.ArgumentParser(prog="disttrain").add_subparsers()
    configure(subparsers)
    parser = subparsers.choices["run"]
    assert isinstance(parser, argparse.ArgumentParser)
    return parser


def _measured_peak(config: TrainConfig, in_job: bool) -> TrainConfig:
    """``--peak-tflops auto``: one device's peak in the run's number format, measured
    before the ranks start (inside a launched job they have started: give the number)."""
    if in_job:
        raise ValueError("--peak-tflops auto measures this machine before its ranks start; "
                         "inside a launched job give the number `disttrain info` prints")
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(config.precision, config.dtype)
    peak, where = measured_peak(config.device, dtype)
    print(f"disttrain run: peak {peak:.4g} TFLOP/s measured ({where}, {dtype} matmul)",
          file=sys.stderr)
    return dataclasses.replace(config, peak_tflops=peak)


def parse_partition(text: str | None) -> str | tuple[int, ...] | tuple[str, ...] | None:
    """``--partition``: ``params``, ``time``, layer counts per stage like ``3,2,2``, or the
    names of the layers where stages 1, 2, … start, like ``blocks.2,head``."""
    if text is None or text in ("params", "time"):
        return text
    parts = tuple(part.strip() for part in text.split(","))
    if all(part.isdigit() for part in parts):
        return tuple(int(part) for part in parts)
    if not all(re.fullmatch(r"[A-Za-z_]\w*(\.\w+)*", part) for part in parts):
        raise ValueError(f"--partition must be 'params', 'time', layer counts per stage like "
                         f"3,2,2, or layer names where stages start like blocks.2,head; got "
                         f"{text!r}")
    return parts


def straggler_options(text: str | None) -> dict[str, Any]:
    """``--straggler`` → the ParallelOptions (and BenchConfig) fields it sets:
    ``1:2`` → ``{"straggler": ((1, 2.0),), "straggler_every": None}``; ``1:2:5`` → the same
    pairs and ``"straggler_every": 5`` (the slow-down moves to the next worker every 5 steps)."""
    if text is None:
        return {"straggler": (), "straggler_every": None}
    from disttrain.parallel.parameter_server import parse_straggler_spec

    try:
        spec = parse_straggler_spec(text)
    except ValueError as exc:
        raise ValueError(f"--straggler: {exc}") from None
    return {"straggler": tuple(sorted(spec.factors.items())), "straggler_every": spec.every}


def _servers_from_job(config: TrainConfig) -> TrainConfig:
    """In a launched job, a PS strategy takes its server count from ``disttrain launch
    --servers`` (DISTTRAIN_PS_SERVERS) unless --servers is given; both must agree."""
    from disttrain.parallel.parameter_server import SERVERS_ENV, servers_from_env

    announced = servers_from_env()
    if announced is None or get_strategy(config.strategy).layout != "ps":
        return config
    given = config.parallel.servers
    if given is not None and given != announced:
        raise ValueError(f"--servers {given} disagrees with {SERVERS_ENV}={announced} set by "
                         f"the launcher; drop --servers inside a launched job")
    parallel = dataclasses.replace(config.parallel, servers=announced)
    return dataclasses.replace(config, parallel=parallel)


def _resume_after_restart(config: TrainConfig) -> TrainConfig:
    """A job restarted by its launcher (``disttrain launch`` or ``torchrun --max-restarts``:
    TORCHELASTIC_RESTART_COUNT > 0) resumes from its --checkpoint-dir, as if --resume were
    given: from the latest complete checkpoint, or from step 0 if none was written yet."""
    text = os.environ.get(RESTART_COUNT_VAR, "0")
    try:
        count = int(text)
    except ValueError:
        raise ValueError(f"{RESTART_COUNT_VAR}={text!r} is not a whole number; it is set by "
                         f"the launcher (unset it when starting workers by hand)") from None
    if count <= 0 or config.checkpoint_dir is None or config.resume:
        return config
    logging.getLogger(__name__).info("restart %d of this job: resuming from %s", count,
                                     config.checkpoint_dir)
    return dataclasses.replace(config, resume=True)


def run(args: argparse.Namespace) -> int:
    from disttrain.train import spawn
    from disttrain.train.loop import checked_setup, train

    try:
        config = config_from_args(args)
        if args.print_config:
            print(dump(run_parser(), args), end="")
            return 0
        launcher = spawn.in_launched_job()
        in_job = launcher is not None
        if args.peak_tflops == "auto":
            config = _measured_peak(config, in_job)
        if launcher is not None:
            config = _resume_after_restart(_servers_from_job(config))
            world_size = _job_world_size(args.nproc_per_node, launcher, config)
        else:  # -n counts workers; a parameter-server run adds its servers
            world_size = ranks_needed(config, _local_workers(args.nproc_per_node))
        checked_setup(config, world_size)
        require_available(config.device)  # a one-line error, before any rank starts
        check_dataset(config.dataset, config.data)
        check_model(config.model, config.model_config,
                    lambda: build_dataset(config.dataset, config.data).info)
        comm_config = CommConfig(timeout_s=_comm_timeout(args.comm_timeout))
        if in_job:
            result: TrainResult | None = spawn.run_in_job(config, comm_config, args.backend,
                                                          args.transport)
            if result is not None and result.rank != reporting_rank(result):
                result = None
        elif world_size == 1 and not get_strategy(config.strategy).needs_comm:
            select_local_gpu(config.device, 0)
            result = train(config)
        else:
            backend = local_backend(args.backend, config.device, args.transport, world_size)
            result = spawn.run_local(config, world_size, comm_config, args.timeout,
                                     args.transport, backend)[0]
    except (ValueError, ImportError) as exc:  # bad settings, or a missing optional package
        print(f"disttrain run: error: {exc}", file=sys.stderr)
        return 2
    except spawn.RankFailedError as exc:
        print(f"disttrain run: {exc}", file=sys.stderr)
        return 1
    if result is not None:
        _report(result, args.json)
    return 0


def _comm_timeout(flag: float | None) -> float:
    """--comm-timeout, else $DISTTRAIN_TIMEOUT (what disttrain.init() reads), else 120 s."""
    if flag is not None:
        if not 0 < flag < float("inf"):
            raise ValueError(f"--comm-timeout must be a positive number of seconds, got {flag:g}")
        return flag
    from disttrain.launch.env import resolve_timeout

    return resolve_timeout(None, os.environ) if os.environ.get("DISTTRAIN_TIMEOUT") else 120.0


_SIZE_VARS = {"torchrun": "WORLD_SIZE", "slurm": "SLURM_NTASKS",
              "mpi": "OMPI_COMM_WORLD_SIZE or PMI_SIZE"}


def _job_world_size(nproc: int | None, launcher: str, config: TrainConfig) -> int:
    """The launched job's size (its variables checked: an incomplete set is an error
    naming the missing one); ``-n`` may repeat it (workers, for a parameter-server run)
    but not contradict it."""
    from disttrain.launch.env import resolve_placement

    world = resolve_placement(os.environ).world_size
    if nproc is not None and ranks_needed(config, nproc) != world:
        counted = ranks_needed(config, nproc)
        extra = f" ({nproc} workers + servers)" if counted != nproc else ""
        raise ValueError(f"-n {nproc}{extra} disagrees with the {world} ranks the launcher "
                         f"started ({_SIZE_VARS[launcher]}={world}); drop -n inside a "
                         f"launched job")
    return world


def _local_workers(nproc: int | None) -> int:
    nproc = 1 if nproc is None else nproc
    if nproc < 1:
        raise ValueError(f"-n must be ≥ 1, got {nproc}")
    return nproc


def _report(result: TrainResult, json_path: Path | None) -> None:
    accuracy = "-" if result.accuracy is None else f"{result.accuracy:.4f}"
    eval_loss = "-" if result.eval_loss is None else f"{result.eval_loss:.4f}"
    print(f"result strategy={result.strategy} world_size={result.world_size} "
          f"global_batch={result.global_batch} steps={result.steps} "
          f"samples/s={samples_per_s(result):.1f} "
          f"peak_mem_MB={result.peak_mem_bytes_max / 1e6:.1f}" + _tokens(result))
    print(f"accuracy={accuracy} eval_loss={eval_loss} final_loss={result.final_loss:.4f}")
    if result.model_state_bytes_max is not None:
        formula = result.model_state_formula_bytes
        print(f"model_state_MB={result.model_state_bytes_max / 1e6:.3f} formula_MB="
              f"{'-' if formula is None else format(formula['total'] / 1e6, '.3f')} "
              f"activations_MB={(result.activation_peak_bytes_max or 0) / 1e6:.3f} "
              f"(per rank, the maxima over ranks)")
    sent, theory = result.bytes_sent_per_step_max, result.theory_bytes_per_step_max
    if sent is not None or theory is not None:
        hidden = bool(result.bytes_unobserved) and not sent  # they ran, uncounted: not 0
        measured = "-" if sent is None or hidden else f"{sent:.0f}"
        expected = "-" if theory is None else f"{theory:.0f}"
        print(f"bytes_per_rank_per_step={measured} theory={expected} "
              f"bytes_unobserved={result.bytes_unobserved}")
        if hidden:
            steps = max(len(result.step_times), 1)
            print(f"note: the collectives ran inside torch.distributed (algorithm 'native', "
                  f"auto's pick here), which moved {result.bytes_unobserved / steps:.0f} bytes "
                  f"of payload per step but does not show its bytes on the wire; "
                  f"--transport shm (or --algorithm ring) counts them")
    ps = result.extras
    if "staleness" in ps:
        print(f"ps mode={ps['mode']} workers={ps['workers']} servers={ps['servers']} "
              f"staleness={_histogram(ps['staleness'])} (mean {ps['staleness_mean']:.2f}, "
              f"max {ps['staleness_max']}) worker_bytes_per_step="
              f"{ps['worker_bytes_per_step']:.0f} dense={ps['dense_bytes_per_step']:.0f} "
              f"step_ms_by_worker=[{', '.join(f'{1e3 * t:.1f}' for t in ps['worker_step_s'])}]")
        if ps.get("lost_workers"):
            print(f"lost_workers={ps['lost_workers']} (the run went on without them)")
    if json_path:
        write_rows(json_path, [result.summary()])


def _tokens(result: TrainResult) -> str:
    """`` tokens/s=… mfu=…`` for a language model (mfu ``-`` without a peak), else ``""``."""
    if result.tokens_per_s is None:
        return ""
    mfu = "-" if result.mfu is None else f"{100 * result.mfu:.2f}%"
    return f" tokens/s={result.tokens_per_s:.1f} mfu={mfu}"


def reporting_rank(result: TrainResult) -> int:
    """The rank that prints the result: 0, or the first survivor of a run that went on
    without some workers (ps-async, ps-ssp: ``extras["lost_workers"]``)."""
    lost = set(result.extras.get("lost_workers", ()))
    return min(r for r in range(result.world_size) if r not in lost)


def samples_per_s(result: TrainResult) -> float:
    """The run's samples/s: a strategy whose workers step at their own pace (ps-async)
    reports the sum of their rates in ``extras``; the others, rank 0's figure."""
    return float(result.extras.get("samples_per_s", result.samples_per_s))


def _histogram(counts: dict[str, int]) -> str:
    return "{" + ", ".join(f"{k}: {n}" for k, n in counts.items()) + "}"
