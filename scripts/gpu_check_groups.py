"""The groups of scripts/gpu_check.py that run in one process: env, single, nccl, cli, bench
(the rank pools' group is gpu_check_ranks.py). Each runs its checks with run_check."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from gpu_check_lib import (
    CHECK_S,
    GROUP_S,
    ROOT,
    CheckFailed,
    Options,
    compare,
    config,
    finite,
    host_params,
    on_device,
    run_check,
)
from gpu_check_ranks import group_ranks


# ---------------------------------------------------------------- group: env
def group_env(opts: Options) -> None:
    def versions() -> str:
        import torch

        from disttrain.launch import info

        facts = info.collect()
        if opts.device == "cuda":
            if not torch.cuda.is_available():
                raise CheckFailed("torch.cuda.is_available() is False")
            if not facts["backends"]["nccl"] or not facts["nccl_version"]:
                raise CheckFailed("this torch has no NCCL")
            gpu = facts["gpus"]["devices"][0]["name"]
            return (f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL "
                    f"{facts['nccl_version']}, {facts['gpus']['count']}× {gpu}")
        return f"torch {torch.__version__} (dry run on the CPU)"

    def info_command() -> str:
        done = subprocess.run([sys.executable, "-m", "disttrain", "info"], capture_output=True,
                              text=True, timeout=60, cwd=ROOT)
        if done.returncode != 0 or "backends" not in done.stdout:
            raise CheckFailed(f"disttrain info failed: {done.stderr.strip()[-200:]}")
        gpus = [line for line in done.stdout.splitlines() if line.startswith("gpus")]
        return gpus[0] if gpus else "ran"

    run_check("env:versions", versions, CHECK_S * opts.slack)
    run_check("env:info", info_command, CHECK_S * opts.slack)


# ---------------------------------------------------------------- group: single
def group_single(opts: Options) -> None:
    from disttrain.train import DataOptions, train

    def single(model: str, dataset: str) -> Callable[[], str]:
        def check() -> str:
            data = DataOptions(seq_len=16, vocab_size=64, num_samples=256)
            result = train(config(opts, model=model, dataset=dataset, data=data, eval_every=0))
            assert result.model is not None
            finite(host_params(result.model), model)
            device = next(result.model.parameters()).device.type
            if device != opts.device:
                raise CheckFailed(f"the model trained on {device}, not {opts.device}")
            return f"accuracy {result.accuracy:.3f}, {on_device(result, opts)}"
        return check

    for model, dataset in opts.models().items():
        run_check(f"single:{model}", single(model, dataset), CHECK_S * opts.slack)

    def precision(name: str) -> Callable[[], str]:
        def check() -> str:
            result = train(config(opts, precision=name, steps=20))
            finite(host_params(result.model), name)
            losses = result.losses
            trained = losses[result.extras.get("skipped_steps", 0):]
            if not sum(trained[-4:]) / 4 < trained[0]:
                raise CheckFailed(f"{name} did not train: losses {losses}")
            extra = result.extras
            scale = (f", loss scale {extra['loss_scale']:g} after {extra['skipped_steps']} "
                     f"skipped step(s)") if "loss_scale" in extra else ""
            return f"loss {trained[0]:.3f} → {losses[-1]:.3f}{scale}"
        return check

    run_check("single:fp16-loss-scaling", precision("fp16"), CHECK_S * opts.slack)
    run_check("single:bf16", precision("bf16"), CHECK_S * opts.slack)


# ---------------------------------------------------------------- group: nccl (one rank)
def group_nccl(opts: Options) -> None:
    """NCCL on a world of one: a smoke test. Every collective is the identity there, so
    these checks prove that the NCCL path runs (streams, staging, the strategies' set-up on
    one GPU), not that its results are right; the rank groups prove that, over Gloo."""
    import torch
    import torch.distributed as dist

    from disttrain.comm import ALGORITHMS, CommConfig, Communicator

    if opts.device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(opts.nccl, store=dist.HashStore(), rank=0, world_size=1)
    comm = Communicator.from_torch(config=CommConfig(timeout_s=60))
    device = comm.device

    def collectives() -> str:
        done = 0
        for op, table in ALGORITHMS.items():
            for name in table:
                if name in ("shm", "hierarchical"):
                    continue
                one_collective(comm, op, name, device)
                done += 1
        return f"{done} (collective, algorithm) pairs on {device}"

    def asynchronous() -> str:
        side = torch.cuda.Stream() if device.type == "cuda" else None
        values = []
        for stream in (None, side):  # on the caller's stream, whichever it is
            with torch.cuda.stream(stream) if stream is not None else _nothing():
                t = torch.arange(1 << 20, dtype=torch.float32, device=device)
                work = comm.all_reduce(t, "avg", async_op=True)
                assert work is not None
                work.wait()
                values.append(float(t[-1]))
        if device.type == "cuda":
            torch.cuda.synchronize()
        if any(v != (1 << 20) - 1 for v in values):
            raise CheckFailed(f"async all_reduce gave {values}")
        host = torch.ones(3)  # a CPU tensor on an NCCL communicator: staged
        comm.all_reduce(host)
        if host.tolist() != [1.0, 1.0, 1.0] or host.device.type != "cpu":
            raise CheckFailed(f"staged all_reduce gave {host}")
        sub = comm.new_group([0])
        assert sub is not None
        sub.barrier()
        return "async on the default and a side stream, a staged CPU tensor, new_group"

    def strategy(name: str) -> Callable[[], str]:
        def check() -> str:
            from disttrain.train import train

            reference = train(config(opts))
            result = train(config(opts, strategy=name), comm)
            worst = compare(host_params(result.model), host_params(reference.model), name)
            return f"matches single (max diff {worst:.1e}), {on_device(result, opts)}"
        return check

    smoke = f"{opts.nccl}-smoke"
    run_check(f"{smoke}:collectives", collectives, CHECK_S * opts.slack)
    run_check(f"{smoke}:async-streams-staging", asynchronous, CHECK_S * opts.slack)
    for name in ("ddp", "zero1", "zero3"):
        run_check(f"{smoke}:{name}-1-rank", strategy(name), CHECK_S * opts.slack)
    comm.close()
    dist.destroy_process_group()


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def one_collective(comm: Any, op: str, name: str, device: Any) -> None:
    """``op`` by algorithm ``name`` on a world of one: the result is the input."""
    import torch

    x = torch.arange(6, dtype=torch.float32, device=device) + 1
    out = torch.zeros_like(x)
    if op in ("all_reduce", "broadcast", "reduce"):
        y = x.clone()
        getattr(comm, op)(y, algorithm=name)
        out = y
    elif op in ("all_gather", "reduce_scatter", "all_to_all"):
        getattr(comm, op)(out, x, algorithm=name)
    elif op == "gather":
        comm.gather(out, x, algorithm=name)
    elif op == "scatter":
        comm.scatter(out, x, algorithm=name)
    else:
        comm.barrier(algorithm=name)
        return
    if not torch.equal(out, x):
        raise CheckFailed(f"{op} ({name}) gave {out.tolist()}")


# ---------------------------------------------------------------- group: cli
def group_cli(opts: Options) -> None:
    """``disttrain run`` as a user types it: two ranks on the device (Gloo: they share
    GPU 0), a checkpoint, and a resumed run that continues from it."""
    folder = tempfile.mkdtemp(prefix="gpu-check-cli-")
    base = [sys.executable, "-m", "disttrain", "run", "--strategy", "ddp", "-n", "2",
            "--device", opts.device, "--backend", "gloo", "--model", "mlp", "--dataset",
            "synthetic", "--eval-every", "0", "--log-every", "0", "--checkpoint-dir", folder]
    limit = (GROUP_S["cli"] // 2 - 2) * opts.slack
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def run(*extra: str) -> str:
        done = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=limit,
                              cwd=ROOT, env=env)
        if done.returncode != 0:
            raise CheckFailed(f"exit {done.returncode}: {done.stderr.strip()[-300:]}")
        return done.stdout + done.stderr

    def first() -> str:
        out = run("--steps", "4")
        result = [line for line in out.splitlines() if line.startswith("result ")]
        if not result or "steps=4" not in result[0]:
            raise CheckFailed(f"no result line for 4 steps:\n{out[-500:]}")
        return result[0][:100]

    def resume() -> str:
        out = run("--steps", "6", "--resume")
        if not re.search(r"resumed from \S+ at step 4", out):
            raise CheckFailed(f"the run did not resume at step 4:\n{out[-500:]}")
        return "resumed at step 4 and finished step 6"

    run_check("cli:run", first, limit + 5)
    run_check("cli:checkpoint-resume", resume, limit + 5)


# ---------------------------------------------------------------- group: bench
def group_bench(opts: Options) -> None:
    def table() -> str:
        names = ["ddp"] if opts.quick else ["ddp", "zero2", "1f1b"]
        command = [sys.executable, "-m", "disttrain", "bench", "--device", opts.device,
                   "--backend", "gloo", "--strategies", ",".join(names), "-n", "2",
                   "--steps", "5" if opts.quick else "20", "--eval-every", "0",
                   "--model", "mlp", "--dataset", "synthetic"]
        limit = (GROUP_S["bench"] - 10) * opts.slack
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit, cwd=ROOT)
        if done.returncode != 0:
            raise CheckFailed(f"exit {done.returncode}: {done.stderr.strip()[-300:]}")
        rows = [line for line in done.stdout.splitlines() if any(s in line for s in names)]
        if len(rows) < len(names):
            raise CheckFailed(f"the table has {len(rows)} strategy rows:\n{done.stdout}")
        print(done.stdout, file=sys.stderr, flush=True)  # the table itself, for the log
        return f"{len(rows)} rows (the table is on stderr)"

    run_check("bench:table", table, (GROUP_S["bench"] - 5) * opts.slack)


GROUPS: dict[str, Callable[[Options], None]] = {
    "env": group_env, "single": group_single, "nccl": group_nccl, "ranks": group_ranks,
    "cli": group_cli, "bench": group_bench,
}
