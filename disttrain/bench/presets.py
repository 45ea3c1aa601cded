"""Named workloads of ``disttrain bench``: model, data, optimizer, batch, length and rows.

``disttrain bench`` runs :data:`DEFAULT_PRESET`; ``--preset NAME`` picks another, and any
flag given beside it (``--model``, ``--steps``, ``--strategies`` …) overrides the preset's
value. Each preset is sized to run its whole table on a 2-core machine in the time its
description says, with no download:

* ``transformer`` (the default): a 2-block transformer language model of width 128 (0.42M
  parameters) with Adam on synthetic token sequences, global batch 64 × 32 tokens. The work
  per step (about 5 GFLOP) dwarfs the gradient all-reduce (1.7 MB) and Adam's update, so
  two ranks can beat one process with two threads; Adam makes the model states 16 bytes
  per parameter, which the ZeRO stages visibly divide. The task saturates early (next-token
  accuracy 0.90 = 1 − noise), so every row, asynchronous ones included, is at the plateau
  by the end: the accuracy column checks that every strategy trains the same model.
* ``lenet-digits``: the small LeNet on scikit-learn's 8×8 digits with SGD, the table of
  earlier releases: too little work per step for distribution to pay, a quick smoke test.
* ``distributedtest``: the rows of the DistributedTest benchmark (single, DDP, model
  parallel, pipelined model parallel, ZeRO-DDP through torch, ZeRO, DeepSpeed) on a
  ResNet-50-shaped network (3-4-6-3 bottlenecks at 1/8 width) with Adam on the digits
  upsampled to MNIST's 28×28, global batch 64 as there (docs/benchmarks.md compares). Its
  BatchNorm normalizes each rank's share of the batch, so data-parallel rows differ a
  little from the single process, as the seed's did.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disttrain.parallel.presets import zero_presets
from disttrain.train.data import DataOptions


@dataclass(frozen=True)
class Preset:
    """One named workload (every field is a :class:`~disttrain.bench.experiments.
    BenchConfig` field of the same name)."""

    description: str
    model: str
    dataset: str
    optimizer: str
    lr: float
    global_batch: int
    epochs: int | None = None
    steps: int | None = None
    eval_every: int = 10
    momentum: float = 0.9
    data: DataOptions = field(default_factory=DataOptions)
    strategies: tuple[str, ...] | None = None  # None: every registered strategy


PRESETS: dict[str, Preset] = {
    "transformer": Preset(
        "transformer LM (0.42M params, Adam) on synthetic tokens, 100 steps; ~5 min on 2 cores",
        model="transformer-d128", dataset="synthetic-lm", optimizer="adam", lr=1e-3,
        global_batch=64, epochs=4, eval_every=25,
        data=DataOptions(seq_len=32, vocab_size=64)),
    "lenet-digits": Preset(
        "LeNet (SGD) on the 8×8 digits, 88 steps; ~2 min on 2 cores",
        model="lenet", dataset="digits", optimizer="sgd", lr=0.05, global_batch=32, epochs=2,
        eval_every=10),
    "distributedtest": Preset(
        "the DistributedTest rows: ResNet-50-shaped CNN (Adam) on 28×28 digits, batch 64, "
        "110 steps; ~10 min on 2 cores",
        model="resnet50-w8", dataset="digits-28", optimizer="adam", lr=1e-3, global_batch=64,
        epochs=5, eval_every=22,
        strategies=("ddp", "torch-ddp", "model-parallel", "gpipe", "torch-zero1",
                    *zero_presets(), "deepspeed-ddp",
                    *(f"deepspeed-{name}" for name in zero_presets()), "deepspeed-pipe")),
}
DEFAULT_PRESET = "transformer"


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") \
            from None
