"""Rank functions and helpers of the universal-checkpoint tests (importable, so the pools can
pickle them): a run interrupted after a checkpoint, a checkpoint rewritten under another
strategy, and the state a checkpoint holds, consolidated offline."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from disttrain.comm import Communicator
from disttrain.parallel import zero
from disttrain.train import DataOptions, ParallelOptions, TrainConfig, checkpoint, train

# the tiny TransformerLM of the tensor-parallel tests; 12 samples a step split over 1-4 ranks;
# Adam under a cosine schedule with warmup, so moments, steps and rates must all carry over
CONFIG = TrainConfig(model="transformer", dataset="synthetic-lm",
                     data=DataOptions(num_samples=80, seq_len=8, vocab_size=48), steps=4,
                     global_batch=12, optimizer="adam", lr=3e-3, lr_schedule="cosine",
                     warmup_steps=1, min_lr=1e-4, eval_every=0, log_every=0, progress=False,
                     checkpoint_every=2)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A strategy on a number of ranks, as the matrix names it."""

    strategy: str
    world: int
    options: tuple[tuple[str, Any], ...] = ()
    model: str = CONFIG.model

    def config(self, directory: Path, **changes: Any) -> TrainConfig:
        return dataclasses.replace(CONFIG, strategy=self.strategy, checkpoint_dir=str(directory),
                                   parallel=ParallelOptions(**dict(self.options)),
                                   model=self.model, **changes)

    def __str__(self) -> str:
        extra = "".join(f"-{k.removesuffix('_size')}{v}" for k, v in self.options
                        if k != "microbatches")
        model = "" if self.model == CONFIG.model else f"-{self.model}"
        return f"{self.strategy}{extra}{model}@{self.world}"


def rank_train(comm: Communicator, config: TrainConfig) -> list[float]:
    """The run's losses (the checkpoints land in ``config.checkpoint_dir``)."""
    return train(config, comm).losses


def rank_rewrite(comm: Communicator, config: TrainConfig, target: str
                 ) -> tuple[int, dict[str, torch.Tensor]]:
    """Load the latest checkpoint of ``config.checkpoint_dir`` under ``config``'s strategy
    and write it again, untouched, into ``target``: what this strategy reads of it and
    writes back is all the next run gets. Returns the step and the parameters this rank
    then holds, gathered by the strategy's own code (``trained_module``), so a slice read
    into the wrong place cannot hide behind the same mistake made writing it back."""
    from disttrain.train.loop import _Run

    run = _Run(dataclasses.replace(config, resume=True), comm)
    try:
        checkpoint.save(target, run.step, run.strategy, comm, run.meta, run._position(),
                        run.scaler, rank=comm.rank)
        held = run.strategy.trained_module().state_dict()
        return run.step, {k: v.detach().clone() for k, v in held.items()}
    finally:
        run.close()


def state(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer tensor of a checkpoint, whole, by name
    (``<param>`` and ``<param>/<key>``), verified against its manifest."""
    params, optim = zero.consolidate(step_dir)
    out = dict(params)
    for name, keys in optim.items():
        out.update({f"{name}/{key}": value for key, value in keys.items()})
    return out


def merged(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The ranks' parameters together (a pipeline stage holds some, replicas the same)."""
    out: dict[str, torch.Tensor] = {}
    for held in per_rank:
        for name, value in held.items():
            assert name not in out or torch.equal(out[name], value), f"ranks differ on {name}"
            out[name] = value
    return out


def assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                     what: str) -> None:
    """The same names, dtypes and bits (a lost optimizer moment or step, a misplaced slice,
    a rounding on the way fails here)."""
    assert sorted(got) == sorted(want), what
    for name, value in want.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), (
            f"{what}: {name} differs (max |Δ| "
            f"{(got[name].double() - value.double()).abs().max().item():.3g})")


def rank_save_zero_format(comm: Communicator, stage: int, steps: int, directory: str) -> None:
    """ZeRO trained ``steps`` and saved in the format before the universal one
    (``zero.json`` + one shard file per rank, as ``zero.save`` wrote it), to show it still
    loads."""
    import json
    import os

    from disttrain.parallel.checkpoint_files import atomic_save, atomic_write_text, seal
    from tests import zero_cases

    z = zero_cases.wrap(stage, zero_cases.make_net(), comm, "adam",
                        zero.ZeroConfig(bucket_bytes=256))
    zero_cases.train(z, comm, 0, steps)
    os.makedirs(directory, exist_ok=True)
    tensors, groups = {}, []
    for g, group in enumerate(z.shard_groups()):
        tensors[f"{g}.master"] = group.master.detach().clone()
        scalars = {}
        for key, value in z.optimizer.state[group.master].items():
            if value.shape == group.master.shape:
                tensors[f"{g}.state.{key}"] = value.detach().clone()
            else:
                scalars[key] = [float(value.item()), str(value.dtype).removeprefix("torch.")]
        groups.append({"names": list(group.names), "shapes": [list(s) for s in group.shapes],
                       "shard_size": group.layout.shard_size, "scalars": scalars})
    atomic_save(tensors, os.path.join(directory, f"rank{comm.rank:05d}.pt"))
    comm.barrier()
    if comm.rank == 0:
        hyper = [{k: list(v) if isinstance(v, tuple) else v for k, v in pg.items()
                  if k != "params"} for pg in z.optimizer.param_groups]
        atomic_write_text(os.path.join(directory, "zero.json"), json.dumps({
            "format": "disttrain.zero.checkpoint/1", "world_size": comm.world_size,
            "stage": stage, "optimizer": type(z.optimizer).__name__,
            "state_keys": ["exp_avg", "exp_avg_sq"], "param_groups": hyper, "buffers": [],
            "groups": groups}))
    seal(directory, comm.rank, comm.world_size, comm.barrier)
