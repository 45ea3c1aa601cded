"""Loader threads read batches ahead of the step: counted, not timed. The Prefetcher hands
out every batch in order, reads exactly ``prefetch`` ahead on its own threads, raises a
failed read at the batch that needed it; in the training loop, the batches of the next
steps are read while the loop is still inside a step's hook."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.utils.data import TensorDataset

from disttrain.train import DataInfo, DataOptions, DatasetSplits, TrainConfig, train
from disttrain.train.loader import Prefetcher

DEADLINE_S = 30.0  # how long a test waits for reads that must happen (never for speed)


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {DEADLINE_S} s: {what}"
        time.sleep(0.005)


class Recorder:
    """``fetch(job)``: records (job, thread name) and returns ``job * 10``."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.reads: list[tuple[int, str]] = []
        self.fail_at = fail_at

    def __call__(self, job: int) -> int:
        self.reads.append((job, threading.current_thread().name))
        if job == self.fail_at:
            raise ValueError(f"cannot read batch {job}")
        return job * 10


@pytest.mark.parametrize("workers,prefetch", [(0, 1), (1, 1), (1, 3), (3, 2), (2, 9)])
def test_every_batch_comes_out_once_in_order(workers, prefetch):
    with Prefetcher(range(7), Recorder(), workers, prefetch) as batches:
        assert list(batches) == [j * 10 for j in range(7)]


@pytest.mark.parametrize("workers,prefetch", [(1, 1), (1, 2), (2, 3)])
def test_workers_read_exactly_prefetch_batches_ahead(workers, prefetch):
    fetch = Recorder()
    batches = Prefetcher(range(10), fetch, workers, prefetch)
    try:
        for k in range(4):
            assert next(batches) == k * 10
            # holding batch k: batches k+1 .. k+prefetch get read, and no more
            wait_for(lambda: len(fetch.reads) == batches.submitted, "the asked reads")
            assert batches.submitted == k + 1 + prefetch
            assert sorted(job for job, _ in fetch.reads) == list(range(k + 1 + prefetch))
        assert all(name.startswith("disttrain-loader") for _, name in fetch.reads)
    finally:
        batches.close()


def test_without_workers_each_batch_is_read_when_it_is_asked_for():
    fetch = Recorder()
    with Prefetcher(range(5), fetch, workers=0, prefetch=3) as batches:
        assert next(batches) == 0 and next(batches) == 10
        assert fetch.reads == [(0, "MainThread"), (1, "MainThread")]


def test_a_failed_read_is_raised_by_the_batch_that_needed_it():
    with Prefetcher(range(6), Recorder(fail_at=3), workers=2, prefetch=3) as batches:
        assert [next(batches) for _ in range(3)] == [0, 10, 20]  # read before 3 failed
        with pytest.raises(ValueError, match="cannot read batch 3"):
            next(batches)


def test_close_stops_the_reads_and_the_threads():
    fetch = Recorder()
    batches = Prefetcher(iter(range(1000)), fetch, workers=2, prefetch=2)
    next(batches)
    batches.close()
    assert len(fetch.reads) <= 3 and batches.submitted == 3
    assert not [t for t in threading.enumerate() if t.name.startswith("disttrain-loader")]


def test_bad_settings_name_the_fix():
    with pytest.raises(ValueError, match="workers must be an int ≥ 0, got -1"):
        Prefetcher([], Recorder(), workers=-1)
    with pytest.raises(ValueError, match="prefetch must be an int ≥ 1, got 0"):
        Prefetcher([], Recorder(), prefetch=0)
    with pytest.raises(ValueError, match="loader_workers must be an int ≥ 0"):
        DataOptions(loader_workers=-2)
    with pytest.raises(ValueError, match="prefetch must be an int ≥ 1"):
        DataOptions(prefetch=0)
    with pytest.raises(ValueError, match="token_dtype must be one of uint16, uint32"):
        DataOptions(token_dtype="int64")


# ---------------------------------------------------------------- in the training loop
READS: dict[str, int] = {}  # "loader" or "main" → samples read on such threads


class Counted(torch.utils.data.Dataset):
    """Samples read one by one through ``__getitem__``, each read counted in READS by the
    kind of thread that read it."""

    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        self.inputs, self.labels = inputs, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        name = threading.current_thread().name
        kind = "loader" if name.startswith("disttrain-loader") else "main"
        READS[kind] = READS.get(kind, 0) + 1
        return self.inputs[i], self.labels[i]


def counted(options: DataOptions) -> DatasetSplits:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(96, 4, generator=generator)
    labels = (inputs[:, 0] > 0).long()
    return DatasetSplits(Counted(inputs[:64], labels[:64]),
                         TensorDataset(inputs[64:], labels[64:]), DataInfo((4,), 2))


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_the_loop_reads_the_next_steps_while_a_step_is_still_going_on(workers):
    """Parked in step 2's hook: with workers, the batches of steps 3 and 4 (prefetch 2) are
    read meanwhile, and no more; without, nothing past step 2 has been read."""
    batch, prefetch, seen = 8, 2, {}
    READS.clear()

    def hook(record) -> None:
        if record.step == 2:
            if workers:
                wait_for(lambda: READS.get("loader", 0) >= (2 + prefetch) * batch,
                         "the next steps' batches read ahead")
            seen.update(READS)

    config = TrainConfig(model="mlp", dataset="tests.test_train_loader:counted", steps=6,
                         global_batch=batch, eval_every=0, log_every=0, progress=False,
                         data=DataOptions(loader_workers=workers, prefetch=prefetch))
    result = train(config, hooks=[hook])
    assert result.steps == 6
    sample = batch  # the loop reads one micro-batch at set-up to build the strategy
    if workers:
        assert seen == {"main": sample, "loader": (2 + prefetch) * batch}
    else:
        assert seen == {"main": sample + 2 * batch}
