"""The universal checkpoint without processes: the block maps are exact (every flat range of
every shape, every tensor-parallel split, ZeRO's ranges of those splits), a tensor written
cut one way reads back cut any other way, an incomplete or doubled checkpoint is refused in
one line, the formats before it still load, and fp16's loss scale survives a resume on
another number of ranks."""

from __future__ import annotations

import dataclasses
import itertools
import shutil

import pytest
import torch

from disttrain.parallel import checkpoint_files
from disttrain.parallel.checkpoint_files import CheckpointError
from disttrain.parallel.tensor.layers import shard
from disttrain.parallel.universal import slices, state
from disttrain.parallel.universal.store import Reader, Writer, read_index
from disttrain.train import TrainConfig, checkpoint, train


# ---------------------------------------------------------------- pure block maps
@pytest.mark.parametrize("shape", [(), (7,), (3, 4), (2, 3, 4), (1, 5, 1, 3)])
def test_every_flat_range_becomes_contiguous_blocks_that_cover_it(shape):
    n = slices.numel(shape)
    values = torch.arange(n).reshape(shape)
    for start, stop in itertools.combinations(range(n + 1), 2):
        covered = []
        for first, box in slices.contiguous_boxes(shape, start, stop):
            block = values[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
            assert block.flatten().tolist() == list(range(first, first + box.numel))
            covered += block.flatten().tolist()
        assert covered == list(range(start, stop)), (start, stop)


@pytest.mark.parametrize(("how", "size"), list(itertools.product(
    ["rows", "cols", "rows/3", "cols/3"], [1, 2, 3])))
def test_a_split_and_zeros_ranges_of_it_land_where_the_global_tensor_has_them(how, size):
    """Each tp rank's slice (tensor parallelism's own ``shard``), and every flat range of
    it (ZeRO inside a tensor-parallel mesh), maps onto the global tensor exactly."""
    full = torch.randn(6 * size, 6 * size)
    dim, parts = (0 if how.startswith("rows") else 1), (3 if how.endswith("/3") else 1)
    for rank in range(size):
        local = shard(full, how, rank, size)
        placement = slices.split(tuple(local.shape), dim, parts, rank, size)
        assert placement.shape == tuple(full.shape)
        flat = local.reshape(-1)
        for start, stop in [(0, flat.numel()), (5, 23), (flat.numel() - 7, flat.numel())]:
            stored = flat[start:stop].clone()  # a ZeRO shard of the slice
            found = slices.regions(placement, start, stop)
            assert sum(r.box.numel for r in found) == stop - start
            for region in found:
                index = tuple(slice(o, o + s) for o, s in zip(region.box.offsets,
                                                             region.box.sizes))
                assert torch.equal(region.view(stored), full[index])


# ---------------------------------------------------------------- files: any cut to any cut
def zero_ranges(tensor: torch.Tensor, ranks: int) -> list[tuple[int, int]]:
    size = -(-tensor.numel() // ranks)
    return [(r * size, min((r + 1) * size, tensor.numel())) for r in range(ranks)]


def write_as_zero(directory: str, tensor: torch.Tensor, ranks: int) -> None:
    """``tensor`` saved by ``ranks`` ZeRO ranks, each its flat range."""
    placement = slices.replicated(tuple(tensor.shape))
    for rank, (start, stop) in enumerate(zero_ranges(tensor, ranks)):
        writer = Writer(directory, rank)
        shard_flat = tensor.reshape(-1)[start:stop].clone()
        writer.add("w", "param", shard_flat, tuple(tensor.shape),
                   slices.regions(placement, start, stop))
        writer.close()


def test_written_by_three_zero_ranks_read_by_two_tp_ranks_and_whole(tmp_path):
    full = torch.randn(6, 10)
    write_as_zero(str(tmp_path), full, 3)
    reader = Reader(read_index(str(tmp_path)))
    for rank in range(2):
        local = torch.empty(6, 5)  # "cols" over 2
        reader.fill("w", local.view(-1), slices.regions(slices.split((6, 5), 1, 1, rank, 2)))
        assert torch.equal(local, shard(full, "cols", rank, 2))
    assert torch.equal(reader.full("w"), full)


def test_a_missing_or_doubled_part_is_refused_in_one_line(tmp_path):
    full = torch.randn(4, 5)
    write_as_zero(str(tmp_path / "missing"), full, 2)
    (tmp_path / "missing" / "rank-00001.json").unlink()
    with pytest.raises(CheckpointError) as err:
        Reader(read_index(str(tmp_path / "missing"))).full("w")
    assert "holds 10 of the 20 elements of w" in str(err.value) and "\n" not in str(err.value)
    write_as_zero(str(tmp_path / "doubled"), full, 2)
    shutil.copy(tmp_path / "doubled" / "rank-00001.json", tmp_path / "doubled" /
                "rank-00002.json")
    shutil.copy(tmp_path / "doubled" / "rank-00001.pt", tmp_path / "doubled" / "rank-00002.pt")
    with pytest.raises(CheckpointError, match=r"holds 30 of the 20 elements of w .*twice"):
        Reader(read_index(str(tmp_path / "doubled"))).full("w")


def test_another_model_is_refused_naming_the_parameter(tmp_path):
    model = torch.nn.Linear(3, 2)
    state.save(str(tmp_path), state.module_layout(model.named_parameters(), None), 0)
    other = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match=r"parameter weight has shape \(2, 4\) here but "
                                         r"\(2, 3\) in the checkpoint"):
        state.load(str(tmp_path), state.module_layout(other.named_parameters(), None))


# ---------------------------------------------------------------- the loop around it
QUIET = TrainConfig(model="mlp", global_batch=64, steps=4, optimizer="adam", lr=3e-3,
                    eval_every=0, log_every=0, progress=False)


def test_a_state_pt_checkpoint_of_the_format_before_still_resumes_bit_exactly(tmp_path):
    """``state.pt`` (model and optimizer state dicts, rank 0) as disttrain wrote it before
    the universal format: the run continues exactly as the uninterrupted one."""
    from disttrain.train.loop import _Run

    whole = train(QUIET)
    train(dataclasses.replace(QUIET, steps=2, checkpoint_dir=str(tmp_path / "new")))
    old = tmp_path / "old"
    shutil.copytree(tmp_path / "new", old)
    run = _Run(dataclasses.replace(QUIET, steps=2, checkpoint_dir=str(old), resume=True), None)
    legacy = run.strategy.state_dict()  # what the old writer saved
    run.close()
    step = old / "step-00000002"
    shutil.rmtree(step / "universal")
    checkpoint_files.atomic_save(legacy, str(step / "state.pt"))
    checkpoint_files.seal(str(step), 0, 1, lambda: None)
    resumed = train(dataclasses.replace(QUIET, checkpoint_dir=str(old), resume=True))
    assert resumed.start_step == 2 and resumed.losses == whole.losses[2:]
    for name, value in whole.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name


class Scaler:
    def __init__(self, scale: float) -> None:
        self.scale = scale

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale}

    def load_state_dict(self, saved: dict[str, float]) -> None:
        self.scale = saved["scale"]


class NoState:
    def save_state(self, path: str, rank: int) -> None:
        pass

    def load_state(self, path: str, rank: int) -> None:
        pass


def test_the_loss_scale_survives_a_resume_on_another_number_of_ranks(tmp_path):
    meta = {"model": "mlp", "world_size": 4}
    path = checkpoint.save(str(tmp_path), 3, NoState(), None, meta, {"epoch": 0, "start": 0},
                           Scaler(1024.0))
    resumed = Scaler(65536.0)
    checkpoint.load(path, NoState(), 0, {**meta, "world_size": 2}, resumed)
    assert resumed.scale == 1024.0
