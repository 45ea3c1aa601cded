"""The group of scripts/gpu_check.py that needs ranks: every strategy on two (three) rank
processes sharing GPU 0 over Gloo or shared memory, kept in a pool across checks."""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from gpu_check_lib import (
    CHECK_S,
    LM_STRATEGIES,
    STEPS,
    CheckFailed,
    Options,
    compare,
    config,
    finite,
    host_params,
    lm_config,
    on_device,
    rank_check,
    run_check,
)


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
        if callable(cfg):  # a function of (rank, communicator): call()
            try:
                comm = make_comm("torch", CommConfig(timeout_s=60))
                try:
                    conn.send(("ok", cfg(rank, comm), None))
                finally:
                    comm.close()
            except BaseException:
                conn.send(("error", traceback.format_exc(), None))
            continue
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
        answers, errors = [], {}
        for rank, conn in enumerate(self.conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                self.stop()
                raise TimeoutError(f"rank {rank} gave no result within {seconds}s")
            status, value, result = conn.recv()
            if status != "ok":
                errors[rank] = value.strip().splitlines()[-1]
            answers.append((value, result))
        if errors:  # refused on every rank before training: the ranks are still usable
            if len(errors) < self.world or not all(e.startswith("ValueError") for e in
                                                   errors.values()):
                self.stop()
            rank = min(errors)
            raise CheckFailed(f"rank {rank} failed: {errors[rank]}")
        return answers

    def call(self, fn: Callable[[int, Any], Any], seconds: int) -> list[Any]:
        """``fn(rank, communicator)`` on every rank (a module-level function)."""
        return [value for value, _ in self.run(fn, "torch", seconds)]

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
    references: dict[tuple[str, str], Any] = {}

    def build(name: str, world: int, **kwargs: Any) -> Any:
        options: dict[str, Any] = {"microbatches": 4} if name in ("gpipe", "1f1b") else {}
        if name == "3d":
            options = {"tp_size": world, "pp_size": 1}
        if name in LM_STRATEGIES:
            return lm_config(opts, strategy=name, parallel=ParallelOptions(**options), **kwargs)
        return config(opts, strategy=name, parallel=ParallelOptions(**options), **kwargs)

    def reference(name: str, precision: str = "fp32") -> dict[str, Any]:
        key = ("lm" if name in LM_STRATEGIES else "mlp", precision)
        if key not in references:
            cfg = build(name, 1, precision=precision)
            references[key] = host_params(train(replace(cfg, strategy="single")).model)
        return references[key]

    def strategy(name: str, world: int, transport: str, equal: bool) -> Callable[[], str]:
        def check() -> str:
            workers = world - 1 if name.startswith("ps-") else world
            cfg = build(name, world, **({"steps": STEPS * 2} if not equal else {}))
            if opts.refuses(name):
                return refused(pools[world], cfg, transport, limit)
            per_rank = pools[world].run(cfg, transport, limit)
            worst = 0.0
            for rank, (params, _) in enumerate(per_rank[:workers]):
                finite(params, f"rank {rank}")
                if equal:
                    worst = max(worst, compare(params, reference(name), f"rank {rank}"))
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

    def side_stream_avg() -> str:
        values = pools[2].call(async_avg_on_side_stream, limit)
        want = [float(sum(range(1, 3))) / 2] * 2
        if values != want:
            raise CheckFailed(f"the ranks read {values} after wait(), not {want}")
        return "async avg launched on a side stream, read on the default one after wait()"

    try:
        for name, world, transport, equal in opts.strategies():
            run_check(rank_check(name, world, transport),
                      strategy(name, world, transport, equal), limit + 5)
        run_check("gloo-2rank:ddp/fp16", fp16_ddp, limit + 5)
        run_check("gloo-2rank:async-avg-side-stream", side_stream_avg, limit + 5)
    finally:
        for pool in pools.values():
            pool.stop()


def refused(pool: Pool, cfg: Any, transport: str, seconds: int) -> str:
    """A strategy that must refuse this device over Gloo: a one-line error on every rank."""
    try:
        pool.run(cfg, transport, seconds)
    except CheckFailed as exc:
        text = str(exc)
        if "--backend nccl" in text:
            return f"refused in one line: {text.split(': ', 1)[-1][:120]}"
        raise
    raise CheckFailed(f"{cfg.strategy} ran torch's collectives on CUDA tensors over Gloo "
                      f"instead of refusing")


def async_avg_on_side_stream(rank: int, comm: Any) -> float:
    """A large tensor averaged asynchronously from a side stream, read on the default
    stream right after ``wait()``: the result must be the final one."""
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if (
        torch.cuda.is_available()) else torch.device("cpu")
    side = torch.cuda.Stream() if device.type == "cuda" else None
    t = torch.full((1 << 22,), float(rank + 1), device=device)
    if side is not None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            t.mul_(1.0)  # the tensor's last writer is the side stream
            work = comm.all_reduce(t, "avg", async_op=True)
    else:
        work = comm.all_reduce(t, "avg", async_op=True)
    work.wait()
    low, high = float(t.min()), float(t.max())  # read on the default stream
    return low if low == high else float("nan")
