"""disttrain on one CUDA GPU: every check this machine can make, one PASS/FAIL line each.

    python3 scripts/gpu_check.py                 # on a machine with a CUDA GPU (< 8 minutes)
    python3 scripts/gpu_check.py --cpu-dry-run   # the same checks on the CPU
    python3 scripts/gpu_check.py --cpu-dry-run --quick   # a few of each group (CI)
    python3 scripts/gpu_check.py --only single,nccl --list

What each check proves is in docs/gpu.md. The checks run in groups, each group in a child
process of its own with a time limit, and every check inside it has its own limit too: a
hang is a FAIL line, never a stuck script. Two-rank checks run in one pool of rank processes
per world size (Gloo, both ranks on GPU 0: NCCL refuses two ranks on one GPU), so a check
costs its training, not a process start. Exit status: 0 when every check passed, 1
otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4
CHECK_S = 60  # one check
# a group's limit (the child process is killed); together under 8 minutes, the promise
GROUP_S = {"env": 45, "single": 90, "nccl": 60, "ranks": 180, "bench": 100}
TOL = {"rtol": 1e-4, "atol": 1e-5}  # fp32 on the GPU: sums in another order per rank
MODELS = {"lenet": "digits", "resnet": "digits", "mlp": "digits",
          "transformer": "synthetic-lm"}
STRATEGIES = [  # (strategy, world size, transport, compared with the single process)
    ("ddp", 2, "torch", True), ("torch-ddp", 2, "torch", True), ("zero1", 2, "torch", True),
    ("zero2", 2, "torch", True), ("zero3", 2, "torch", True), ("torch-zero1", 2, "torch", True),
    ("model-parallel", 2, "torch", True), ("gpipe", 2, "torch", True),
    ("1f1b", 2, "torch", True), ("ddp", 2, "shm", True), ("zero2", 2, "shm", True),
    ("1f1b", 2, "shm", True), ("ps-sync", 3, "torch", True), ("ps-async", 3, "torch", False),
    ("ps-ssp", 3, "torch", False),
]


QUICK = {("ddp", 2, "torch", True), ("1f1b", 2, "shm", True)}  # one pool, two transports


@dataclasses.dataclass(frozen=True)
class Options:
    device: str  # "cuda", or "cpu" for the dry run
    nccl: str  # the backend of the one-rank collective check: "nccl", or "gloo" on CPU
    quick: bool = False  # a few checks of each group (the CI test of this script)

    @property
    def slack(self) -> int:
        """Time limits × this: the dry run shares a CPU (a CI machine's) between the ranks
        and the checks themselves; the 8-minute promise is the GPU machine's."""
        return 1 if self.device == "cuda" else 4

    def models(self) -> dict[str, str]:
        return {"mlp": MODELS["mlp"]} if self.quick else MODELS

    def strategies(self) -> list[tuple[str, int, str, bool]]:
        return [s for s in STRATEGIES if s in QUICK] if self.quick else STRATEGIES


def rank_check(name: str, world: int, transport: str) -> str:
    return (f"gloo-{world}rank:{name}" + ("" if transport == "torch" else f"/{transport}"))


def check_names(group: str, opts: Options) -> list[str]:
    """The checks ``group`` reports, in order."""
    if group == "env":
        return ["env:versions", "env:info"]
    if group == "single":
        return [f"single:{m}" for m in opts.models()] + ["single:fp16-loss-scaling",
                                                          "single:bf16"]
    if group == "nccl":
        return [f"{opts.nccl}:{n}" for n in ("collectives", "async-streams-staging",
                                             "ddp-1-rank", "zero1-1-rank", "zero3-1-rank")]
    if group == "ranks":
        return [rank_check(n, w, t) for n, w, t, _ in opts.strategies()] + [
            "gloo-2rank:ddp/fp16"]
    return ["bench:table"]


class CheckFailed(Exception):
    """A check's result was wrong (the message says how)."""


def say(status: str, name: str, seconds: float, detail: str) -> None:
    print(f"{status:4s}  {name:28s} {seconds:6.1f}s  {detail}", flush=True)


@contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """Raise TimeoutError in this (main) thread after ``seconds``."""
    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"no result within {seconds}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_check(name: str, fn: Callable[[], str], seconds: int) -> None:
    start = time.monotonic()
    try:
        with time_limit(seconds):
            detail = fn()
    except Exception as exc:  # a FAIL line, and the next check runs
        reason = str(exc).strip().splitlines()
        say("FAIL", name, time.monotonic() - start,
            f"{type(exc).__name__}: {reason[-1] if reason else ''}"[:300])
        if not isinstance(exc, CheckFailed):
            traceback.print_exc(file=sys.stderr)
        return
    say("PASS", name, time.monotonic() - start, detail)


# ---------------------------------------------------------------- helpers (child processes)
def config(opts: Options, **kwargs: Any) -> Any:
    from disttrain.train import TrainConfig

    base: dict[str, Any] = {"model": "mlp", "steps": STEPS, "global_batch": 32, "log_every": 0,
                            "progress": False, "eval_every": 0, "device": opts.device}
    return TrainConfig(**{**base, **kwargs})


def host_params(model: Any) -> dict[str, Any]:
    return {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


def compare(got: dict[str, Any], want: dict[str, Any], what: str) -> float:
    """Every tensor of ``got`` (a rank may hold a part) close to ``want``; the largest
    difference."""
    import torch

    worst = 0.0
    for name, tensor in got.items():
        try:
            torch.testing.assert_close(tensor, want[name], **TOL)
        except AssertionError as exc:
            raise CheckFailed(f"{what}: {name} differs from the single process: "
                              f"{str(exc).splitlines()[-1]}") from None
        worst = max(worst, float((tensor - want[name]).abs().max()) if tensor.numel() else 0.0)
    return worst


def finite(params: dict[str, Any], what: str) -> None:
    import torch

    bad = [n for n, t in params.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise CheckFailed(f"{what}: inf/nan in {bad[:3]}")


def on_device(result: Any, opts: Options) -> str:
    peak = result.peak_mem_bytes_max / 1e6
    if opts.device == "cuda" and not peak > 0:
        raise CheckFailed("no CUDA memory was allocated: the run did not use the GPU")
    return f"peak {peak:.1f} MB"


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
                work = comm.all_reduce(t, "sum", async_op=True)
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

    run_check(f"{opts.nccl}:collectives", collectives, CHECK_S * opts.slack)
    run_check(f"{opts.nccl}:async-streams-staging", asynchronous, CHECK_S * opts.slack)
    for name in ("ddp", "zero1", "zero3"):
        run_check(f"{opts.nccl}:{name}-1-rank", strategy(name), CHECK_S * opts.slack)
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


# ---------------------------------------------------------------- group: ranks (Gloo, shm)
def rank_main(rank: int, world: int, store: str, device: str, conn: Any) -> None:
    """A pool rank: Gloo on GPU 0 (every rank: one GPU), then train what it is sent."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from disttrain.comm import CommConfig
    from disttrain.train import train
    from disttrain.train.spawn import make_comm

    while (job := conn.recv()) is not None:
        cfg, transport = job
        try:
            comm = make_comm(transport, CommConfig(timeout_s=60))
            try:
                result = train(cfg, comm)
            finally:
                comm.close()
            conn.send(("ok", host_params(result.model), result.without_model()))
        except BaseException:
            conn.send(("error", traceback.format_exc(), None))
    dist.destroy_process_group()


class Pool:
    """``world`` rank processes kept across checks; a job that overruns restarts them."""

    def __init__(self, world: int, device: str) -> None:
        self.world, self.device = world, device
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory(prefix="gpu-check-")
        store = os.path.join(self._tmp.name, "store")
        for rank in range(self.world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(rank, self.world, store, self.device,
                                                       child), daemon=True)
            proc.start()
            self.procs.append(proc)
            self.conns.append(parent)

    def run(self, cfg: Any, transport: str, seconds: int) -> list[Any]:
        if not self.procs:
            self.start()
        for conn in self.conns:
            conn.send((cfg, transport))
        deadline = time.monotonic() + seconds
        answers = []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                self.stop()
                raise TimeoutError(f"rank {rank} gave no result within {seconds}s")
            status, value, result = conn.recv()
            if status != "ok":
                self.stop()
                raise CheckFailed(f"rank {rank} failed: {value.strip().splitlines()[-1]}")
            answers.append((value, result))
        return answers

    def stop(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
        self.procs, self.conns = [], []
        if self._tmp is not None:
            self._tmp.cleanup()


def group_ranks(opts: Options) -> None:
    from disttrain.train import ParallelOptions, train

    pools = {world: Pool(world, opts.device) for world in (2, 3)}  # started when first used
    limit = CHECK_S * opts.slack
    references: dict[str, Any] = {}

    def reference(precision: str = "fp32") -> dict[str, Any]:
        if precision not in references:
            references[precision] = host_params(train(config(opts, precision=precision)).model)
        return references[precision]

    def strategy(name: str, world: int, transport: str, equal: bool) -> Callable[[], str]:
        def check() -> str:
            options = ParallelOptions(microbatches=4) if name in ("gpipe", "1f1b") else (
                ParallelOptions())
            workers = world - 1 if name.startswith("ps-") else world
            cfg = config(opts, strategy=name, parallel=options,
                         **({"steps": STEPS * 2} if not equal else {}))
            per_rank = pools[world].run(cfg, transport, limit)
            worst = 0.0
            for rank, (params, _) in enumerate(per_rank[:workers]):
                finite(params, f"rank {rank}")
                if equal:
                    worst = max(worst, compare(params, reference(), f"rank {rank}"))
            peak = on_device(per_rank[0][1], opts)
            how = f"matches single (max diff {worst:.1e})" if equal else "finite"
            return f"{how}, {peak}"
        return check

    def fp16_ddp() -> str:
        cfg = config(opts, strategy="ddp", precision="fp16", steps=20)
        per_rank = pools[2].run(cfg, "torch", limit)
        skipped = {r.extras["skipped_steps"] for _, r in per_rank}
        if len(skipped) != 1:
            raise CheckFailed(f"the ranks skipped different steps: {skipped}")
        for rank, (params, _) in enumerate(per_rank):
            finite(params, f"rank {rank}")
        return f"both ranks skipped {skipped.pop()} step(s) and trained"

    try:
        for name, world, transport, equal in opts.strategies():
            run_check(rank_check(name, world, transport),
                      strategy(name, world, transport, equal), limit + 5)
        run_check("gloo-2rank:ddp/fp16", fp16_ddp, limit + 5)
    finally:
        for pool in pools.values():
            pool.stop()


# ---------------------------------------------------------------- group: bench
def group_bench(opts: Options) -> None:
    def table() -> str:
        names = ["ddp"] if opts.quick else ["ddp", "zero2", "1f1b"]
        command = [sys.executable, "-m", "disttrain", "bench", "--device", opts.device,
                   "--backend", "gloo", "--strategies", ",".join(names), "-n", "2",
                   "--steps", "5" if opts.quick else "20", "--eval-every", "0",
                   "--model", "mlp"]
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
    "bench": group_bench,
}


# ---------------------------------------------------------------- the parent
def run_group(group: str, opts: Options, flags: list[str]) -> tuple[int, int]:
    """Run ``group`` in a child process; relay its lines; a check that never reported (the
    child crashed or overran) is a FAIL. Returns (passed, failed)."""
    expected = check_names(group, opts)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, os.path.abspath(__file__), "--group", group, *flags]
    seen: dict[str, str] = {}
    start = time.monotonic()
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                          start_new_session=True) as child:
        assert child.stdout is not None
        try:
            with time_limit(GROUP_S[group] * opts.slack):
                for line in child.stdout:
                    print(line, end="", flush=True)
                    fields = line.split()
                    if len(fields) >= 2 and fields[0] in ("PASS", "FAIL"):
                        seen[fields[1]] = fields[0]
                child.wait()
        except TimeoutError:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    for name in expected:
        if name not in seen:
            seen[name] = "FAIL"
            say("FAIL", name, time.monotonic() - start,
                f"never reported: group {group!r} ended (exit {child.returncode}) first")
    failed = sum(1 for v in seen.values() if v == "FAIL")
    return len(seen) - failed, failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="run the same checks on the CPU (Gloo instead of NCCL for the "
                             "one-rank group): to keep this script working without a GPU")
    parser.add_argument("--only", default=None,
                        help=f"comma-separated groups: {', '.join(GROUPS)} (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="a few checks of each group, fewer steps (the CI test)")
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    parser.add_argument("--group", help=argparse.SUPPRESS)  # a child process runs one group
    args = parser.parse_args(argv)
    opts = Options("cpu" if args.cpu_dry_run else "cuda",
                   "gloo" if args.cpu_dry_run else "nccl", args.quick)
    flags = (["--cpu-dry-run"] if args.cpu_dry_run else []) + (["--quick"] if args.quick
                                                               else [])
    if args.group:
        GROUPS[args.group](opts)
        return 0
    groups = list(GROUPS) if args.only is None else [g.strip() for g in args.only.split(",")]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        parser.error(f"unknown group(s) {unknown}; choose from {', '.join(GROUPS)}")
    if args.list:
        for g in groups:
            print(f"{g}: " + ", ".join(check_names(g, opts)))
        return 0
    if not args.cpu_dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: torch finds no CUDA GPU here; run with --cpu-dry-run to check "
                  "the script itself on the CPU", file=sys.stderr)
            return 2
    start = time.monotonic()
    passed = failed = 0
    for group in groups:
        p, f = run_group(group, opts, flags)
        passed, failed = passed + p, failed + f
    print(json.dumps({"passed": passed, "failed": failed,
                      "seconds": round(time.monotonic() - start, 1),
                      "device": opts.device}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
