"""Devices and 16-bit training in the shared loop: ``--device`` (CPU here; CUDA in
scripts/gpu_check.sh), the one-line error where CUDA is asked for and absent, and fp16 with
the loop's dynamic loss scaler against the single process.

The scaler starts at 2²⁴ here, so the first steps overflow in fp16 for certain: they must be
skipped on every rank (the replicas stay equal to the single process, which skips the same
steps), the scale must back off, and the parameters must stay finite. A loop that did not
scale, unscale or skip would end with scaled (2²⁴× too large) or inf/nan parameters.
"""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys

import pytest
import torch

from disttrain.parallel import mixed_precision
from disttrain.train import ParallelOptions, TrainConfig, train
from disttrain.train.device import check_device, cuda_missing, require_available, resolve_device

NO_CUDA = cuda_missing() is not None
FP16_TOL = {"rtol": 2e-3, "atol": 2e-4}  # fp16 products; sums in another order per rank
HUGE_SCALE = 2.0**24


def quiet(**kwargs) -> TrainConfig:
    return TrainConfig(model="mlp", log_every=0, progress=False, eval_every=0, **kwargs)


def params(result) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in result.model.state_dict().items()}


@pytest.fixture
def huge_scale(monkeypatch):
    monkeypatch.setattr(mixed_precision, "LossScalerConfig",
                        functools.partial(mixed_precision.LossScalerConfig,
                                          init_scale=HUGE_SCALE))


# ---------------------------------------------------------------- devices
def test_device_names_are_checked():
    assert check_device("auto") == "auto" and check_device("cuda:1") == "cuda:1"
    for bad in ("gpu", "cuda:x", "cuda:", "tpu"):
        with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda"):
            check_device(bad)
    with pytest.raises(ValueError, match="device must be one of"):
        TrainConfig(device="gpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(not NO_CUDA, reason="CUDA is available here")
def test_cuda_asked_for_where_there_is_none_is_a_one_line_error():
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA is not available") as info:
        require_available("cuda")
    assert "--device cpu" in str(info.value)
    run = subprocess.run([sys.executable, "-m", "disttrain", "run", "--device", "cuda",
                          "--steps", "1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "CUDA is not available" in lines[0], run.stderr
    assert "Traceback" not in run.stderr


# ---------------------------------------------------------------- fp16 with loss scaling
def test_fp16_single_process_skips_overflowing_steps_and_trains(huge_scale):
    result = train(quiet(steps=20, precision="fp16", global_batch=32))
    skipped = result.extras["skipped_steps"]
    assert 1 <= skipped < 12  # 2²⁴ overflows; a handful of halvings later it trains
    assert result.extras["loss_scale"] == HUGE_SCALE * 0.5**skipped
    assert all(torch.isfinite(t).all() for t in params(result).values())
    last = sum(result.losses[-4:]) / 4
    assert last < result.losses[skipped] - 0.05, "the steps after the overflows must train"


STRATEGIES = [("ddp", ParallelOptions()), ("zero2", ParallelOptions()),
              ("1f1b", ParallelOptions(microbatches=4))]


def rank_train_scaled(comm, config: TrainConfig, init_scale: float):
    saved = mixed_precision.LossScalerConfig
    mixed_precision.LossScalerConfig = functools.partial(  # type: ignore[misc]
        saved, init_scale=init_scale)
    try:
        result = train(config, comm)
    finally:
        mixed_precision.LossScalerConfig = saved  # type: ignore[misc]
    return params(result), result.without_model()


@pytest.mark.parametrize("strategy,options", STRATEGIES)
def test_fp16_strategies_match_the_fp16_single_process(pools, strategy, options):
    """A scale that never overflows here (2¹⁰): every update is applied, unscaled."""
    config = quiet(steps=4, precision="fp16", global_batch=32)
    monkey = functools.partial(mixed_precision.LossScalerConfig, init_scale=2.0**10)
    saved, mixed_precision.LossScalerConfig = mixed_precision.LossScalerConfig, monkey
    try:
        reference = train(config)
    finally:
        mixed_precision.LossScalerConfig = saved  # type: ignore[misc]
    assert reference.extras["skipped_steps"] == 0
    per_rank = pools(2).run(rank_train_scaled, dataclasses.replace(
        config, strategy=strategy, parallel=options), 2.0**10)
    want = params(reference)
    for rank, (got, result) in enumerate(per_rank):
        assert result.extras == {**result.extras, "skipped_steps": 0, "loss_scale": 2.0**10}
        for name, tensor in got.items():
            torch.testing.assert_close(tensor, want[name], **FP16_TOL,
                                       msg=f"{strategy} rank {rank} {name}")


@pytest.mark.parametrize("strategy,options", STRATEGIES)
def test_fp16_overflows_are_skipped_alike_on_every_rank(pools, strategy, options):
    """From 2²⁴ the first steps overflow, on some ranks only where a rank holds part of the
    gradients (a ZeRO shard, a pipeline stage): every rank must skip every one of them (the
    decision is all-reduced), back off alike, and train afterwards."""
    config = quiet(steps=20, precision="fp16", global_batch=32, strategy=strategy,
                   parallel=options)
    per_rank = pools(2).run(rank_train_scaled, config, HUGE_SCALE)
    skipped = {result.extras["skipped_steps"] for _, result in per_rank}
    scales = {result.extras["loss_scale"] for _, result in per_rank}
    assert len(skipped) == 1 and len(scales) == 1, (skipped, scales)
    (count,), (scale,) = skipped, scales
    assert 1 <= count < 12 and scale == HUGE_SCALE * 0.5**count
    for got, result in per_rank:
        assert all(torch.isfinite(t).all() for t in got.values())
        last = sum(result.losses[-4:]) / 4
        assert last < result.losses[count] - 0.05, "the steps after the overflows must train"


def test_bf16_ddp_matches_bf16_single(pools):
    config = quiet(steps=4, precision="bf16", global_batch=32)
    reference = train(config)
    per_rank = pools(2).run(rank_train_scaled, dataclasses.replace(config, strategy="ddp"), 1.0)
    for got, result in per_rank:
        assert "skipped_steps" not in result.extras  # no scaler without fp16
        for name, tensor in got.items():
            torch.testing.assert_close(tensor, params(reference)[name], rtol=1e-2, atol=1e-3)


def test_fp16_is_refused_where_updates_bypass_the_loop():
    from disttrain.train.loop import checked_setup

    with pytest.raises(ValueError, match=r"needs dynamic loss scaling.*ps-sync.*bf16"):
        checked_setup(quiet(steps=1, strategy="ps-sync", precision="fp16"), 2)


def test_the_local_backend_follows_the_device_and_refuses_nccl_on_shared_gpus(monkeypatch):
    from disttrain.train.device import local_backend

    assert local_backend("auto", "cpu", "torch", 4) == "gloo"
    assert local_backend(None, "cpu", "shm", 2) == "gloo"
    with pytest.raises(ValueError, match="--transport shm moves bytes itself"):
        local_backend("nccl", "cpu", "shm", 2)
    # as seen on a machine with one GPU (the checks of the counts, not CUDA itself)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert local_backend("auto", "cuda", "torch", 1) == "nccl"
    assert local_backend("gloo", "cuda", "torch", 2) == "gloo"
    with pytest.raises(ValueError, match=r"2 ranks would share 1 GPU.*--backend gloo"):
        local_backend("auto", "cuda", "torch", 2)


def test_fp16_resumes_with_its_loss_scale(tmp_path, huge_scale):
    """The scale is part of the checkpoint: a run stopped after 3 steps (2²⁴ backed off to
    some 2^k) and resumed takes the same steps as one that ran through."""
    config = quiet(precision="fp16", global_batch=32, checkpoint_dir=str(tmp_path))
    whole = train(dataclasses.replace(config, steps=8, checkpoint_dir=None))
    train(dataclasses.replace(config, steps=3))
    resumed = train(dataclasses.replace(config, steps=8, resume=True))
    assert resumed.start_step == 3
    assert resumed.extras["loss_scale"] == whole.extras["loss_scale"] < HUGE_SCALE
    for name, tensor in params(resumed).items():
        torch.testing.assert_close(tensor, params(whole)[name])
