"""Learning-rate schedules: the rates as data, the rate each strategy's optimizer really
uses, and a resume in the middle of a cosine schedule with warmup that ends bit-exactly
where the uninterrupted run does."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from disttrain.train import DataOptions, ParallelOptions, TrainConfig, train
from disttrain.train.loop import checked_setup
from disttrain.train.schedule import LRSchedule, LRScheduler, rates


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def quiet(**kwargs) -> TrainConfig:
    return TrainConfig(log_every=0, progress=False, eval_every=0, **kwargs)


def params(result) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in result.model.state_dict().items()}


# ---------------------------------------------------------------- the rates, as data
def test_warmup_rises_from_a_fraction_and_decay_ends_at_min_lr():
    cosine = LRSchedule("cosine", lr=1.0, warmup_steps=3, min_lr=0.1, total_steps=9)
    got = rates(cosine)
    assert got[:3] == [1 / 4, 2 / 4, 3 / 4]  # (k+1)/(W+1): torchtitan's, never 0
    assert got[-1] == pytest.approx(0.1, abs=1e-15)  # the last step runs at min_lr
    decay = got[3:]  # progress (k+1-W)/(K-W) = 1/6 … 6/6 along half a cosine
    want = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * i / 6)) for i in range(1, 7)]
    assert decay == pytest.approx(want, abs=1e-15)
    assert all(a > b for a, b in itertools.pairwise(decay))
    linear = rates(LRSchedule("linear", lr=2.0, warmup_steps=0, min_lr=0.0, total_steps=4))
    assert linear == [1.5, 1.0, 0.5, 0.0]
    assert rates(LRSchedule("constant", lr=2.0, warmup_steps=1, total_steps=3)) == [1.0, 2, 2]
    assert rates(LRSchedule("cosine", lr=1.0, warmup_steps=5, total_steps=3)) == [
        1 / 6, 2 / 6, 3 / 6]  # a run shorter than its warmup only warms up
    assert not LRSchedule("constant", lr=1.0).varies


@pytest.mark.parametrize("kwargs,fix", [
    ({"lr_schedule": "step"}, "lr_schedule must be one of constant, linear, cosine"),
    ({"min_lr": 0.5}, "min_lr must be a number between 0 and lr"),
    ({"warmup_steps": -1}, "warmup_steps must be an int"),
    ({"peak_tflops": 0}, "peak_tflops must be a positive number"),
])
def test_bad_schedule_settings_say_what_to_fix(kwargs, fix):
    with pytest.raises(ValueError, match=fix):
        TrainConfig(lr=0.1, **kwargs)


def test_each_group_keeps_its_own_base_rate_read_before_a_resume():
    w, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([{"params": [w]}, {"params": [b], "lr": 0.5}], lr=1.0)
    scheduler = LRScheduler(LRSchedule("linear", 1.0, 0, 0.2, 4), lambda: [opt])
    saved = torch.optim.SGD([{"params": [w]}, {"params": [b], "lr": 0.5}], lr=1.0)
    saved.param_groups[0]["lr"], saved.param_groups[1]["lr"] = 0.6, 0.3  # a step's rates
    opt.load_state_dict(saved.state_dict())  # a resume: new group dicts, scheduled rates
    assert scheduler.set_step(1) == pytest.approx(0.6)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.6, 0.3])
    scheduler.set_step(3)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.2, 0.1])


def test_servers_and_deepspeed_refuse_a_schedule_in_one_line():
    with pytest.raises(ValueError, match="servers apply the updates"):
        checked_setup(quiet(strategy="ps-sync", steps=2, warmup_steps=2), 3)
    with pytest.raises(ValueError, match="DeepSpeed's engine steps its optimizer itself"):
        checked_setup(quiet(strategy="deepspeed-zero2", steps=2, lr_schedule="cosine"), 2)
    checked_setup(quiet(strategy="ps-sync", steps=2), 3)  # constant: as before


# ---------------------------------------------------------------- the loop applies them
def test_the_loop_records_and_applies_each_steps_rate():
    config = quiet(model="mlp", steps=6, global_batch=64, optimizer="adam", lr=1e-2,
                   lr_schedule="linear", warmup_steps=2, min_lr=1e-3)
    records: list = []
    result = train(config, hooks=[records.append])
    assert result.learning_rates == rates(LRSchedule("linear", 1e-2, 2, 1e-3, 6))
    assert [r.lr for r in records] == result.learning_rates  # what the hooks see
    constant = train(dataclasses.replace(config, lr_schedule="constant", warmup_steps=0))
    assert constant.learning_rates == [1e-2] * 6
    assert any(not torch.equal(a, b) for a, b in zip(params(result).values(),
                                                      params(constant).values()))


def rank_params(comm, config: TrainConfig):
    result = train(config, comm)
    return params(result), result.learning_rates


TRANSFORMER = {"model": "transformer", "dataset": "synthetic-lm",
               "data": DataOptions(num_samples=256)}
REACH = [  # strategy, ranks, options: each one's optimizers (a ZeRO shard's, a stage's, ...)
    ("zero2", 2, {}, {"model": "mlp"}),
    ("1f1b", 2, {"microbatches": 2}, {"model": "mlp"}),
    ("tp", 2, {}, TRANSFORMER),
    ("3d", 4, {"tp_size": 2, "pp_size": 1, "zero": 1}, TRANSFORMER),  # ZeRO inside the mesh
]


@pytest.mark.parametrize("strategy,ranks,options,model", REACH, ids=[r[0] for r in REACH])
def test_every_strategys_update_uses_the_scheduled_rate(pools, strategy, ranks, options, model):
    """One step of warmup 1 (half the rate) equals, to the bit, a constant run at lr / 2:
    the schedule reached the optimizer that applied the update on every rank."""
    base = quiet(strategy=strategy, steps=1, global_batch=16, lr=0.05,
                 parallel=ParallelOptions(**options), **model)
    warm = pools(ranks).run(rank_params, dataclasses.replace(base, warmup_steps=1))
    half = pools(ranks).run(rank_params, dataclasses.replace(base, lr=0.025))
    untouched = pools(ranks).run(rank_params, base)
    for (got, lrs), (want, _), (full, _) in zip(warm, half, untouched):
        assert lrs == [0.025]
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
        assert any(not torch.equal(got[n], full[n]) for n in full)


# ---------------------------------------------------------------- resume, bit-exact
class Stop(Exception):
    """Ends a run after a step, as a crash would (every rank at the same step)."""


def stop_after(step: int):
    def hook(record) -> None:
        if record.step > step:
            raise Stop
    return hook


def interrupted_then_resumed(config: TrainConfig, comm=None) -> tuple[dict, list[float], int]:
    """Run ``config`` until a crash in step 8 (checkpoint of step 7 written), then the same
    command again with resume: the resumed leg's parameters, rates and first step."""
    try:
        train(dataclasses.replace(config, checkpoint_every=7), comm, hooks=[stop_after(7)])
    except Stop:
        pass
    resumed = train(dataclasses.replace(config, checkpoint_every=7, resume=True), comm)
    return params(resumed), resumed.learning_rates, resumed.start_step


COSINE = {"steps": 12, "lr_schedule": "cosine", "warmup_steps": 4, "min_lr": 1e-4,
          "optimizer": "adam", "lr": 3e-3}


def test_resume_mid_cosine_equals_the_uninterrupted_run(tmp_path):
    config = quiet(model="mlp", global_batch=64, **COSINE)
    whole = train(config)
    got, lrs, start = interrupted_then_resumed(
        dataclasses.replace(config, checkpoint_dir=str(tmp_path)))
    assert start == 7 and lrs == whole.learning_rates[7:]
    for name, want in params(whole).items():
        torch.testing.assert_close(got[name], want, rtol=0, atol=0, msg=name)


def rank_whole(comm, config: TrainConfig):
    result = train(config, comm)
    return params(result), result.learning_rates


def rank_resumed(comm, config: TrainConfig):
    return interrupted_then_resumed(config, comm)


def test_resume_mid_cosine_under_zero2_equals_the_uninterrupted_run(pools, tmp_path):
    config = quiet(model="mlp", global_batch=64, strategy="zero2", **COSINE)
    whole = pools(2).run(rank_whole, config)
    resumed = pools(2).run(rank_resumed, dataclasses.replace(config,
                                                             checkpoint_dir=str(tmp_path)))
    for (want, want_lrs), (got, lrs, start) in zip(whole, resumed):
        assert start == 7 and lrs == want_lrs[7:]
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def test_resume_with_another_schedule_is_refused(tmp_path):
    config = quiet(model="mlp", global_batch=64, steps=3, lr_schedule="cosine",
                   checkpoint_dir=str(tmp_path))
    train(config)
    with pytest.raises(ValueError, match="was written with lr_schedule="):
        train(dataclasses.replace(config, lr_schedule="linear", steps=5, resume=True))
