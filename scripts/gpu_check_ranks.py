"""The group of scripts/gpu_check.py that needs ranks: every strategy on two (three) rank
processes sharing GPU 0 over Gloo or shared memory, kept in a pool across checks."""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from gpu_check_lib import (
    CHECK_S,
    STEPS,
    CheckFailed,
    Options,
    compare,
    config,
    finite,
    host_params,
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
