"""Gradient clipping by the global norm (--clip-grad-norm, train/clipping.py): every strategy
clips the whole model's gradient as one process does, whatever each rank holds of it
(float64, plain SGD, so a wrong norm moves the parameters by its own factor)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from disttrain.train import ParallelOptions, TrainConfig, train
from tests.test_train_float64 import MESH, PIPELINE

MAX_NORM = 0.05  # below every step's norm here: every step is clipped


def norms_and_state(comm: Any, config: TrainConfig) -> tuple[list[float], dict]:
    seen: list[float] = []
    result = train(config, comm, hooks=[lambda record: seen.append(record.grad_norm)])
    return seen, {k: v.detach().clone() for k, v in result.model.state_dict().items()}


CASES = [
    ("ddp", 2, PIPELINE, {}),
    ("zero1", 2, PIPELINE, {}),
    ("zero2", 2, PIPELINE, {}),
    ("zero3", 3, PIPELINE, {}),
    ("gpipe", 3, PIPELINE, {"microbatches": 4}),
    ("1f1b", 2, PIPELINE, {"microbatches": 4, "pp_size": 2}),
    ("tp", 2, MESH, {}),
    ("tp-sp", 3, MESH, {}),
    ("3d", 4, MESH, {"tp_size": 2, "pp_size": 2, "microbatches": 2}),
    ("3d", 4, MESH, {"tp_size": 2, "dp_size": 2}),
]


@pytest.mark.parametrize(("strategy", "world", "base", "options"), CASES,
                         ids=[f"{c[0]}-{c[1]}" + ("-pp" if "pp_size" in c[3] else "")
                              for c in CASES])
def test_every_strategy_clips_the_global_norm_as_one_process(pools, strategy, world, base,
                                                             options):
    config = dataclasses.replace(base, clip_grad_norm=MAX_NORM, strategy=strategy,
                                 parallel=ParallelOptions(**options))
    single = dataclasses.replace(config, strategy="single", parallel=ParallelOptions())
    want_norms, want = norms_and_state(None, single)
    assert all(n > MAX_NORM for n in want_norms)  # the clip acts on every step
    for rank, (norms, state) in enumerate(pools(world).run(norms_and_state, config)):
        assert norms == pytest.approx(want_norms, rel=1e-10), rank  # the same, on every rank
        for name, value in state.items():
            torch.testing.assert_close(value, want[name], rtol=1e-9, atol=1e-12,
                                       msg=f"rank {rank} {name}")


def test_one_process_clips_as_torch_does():
    """The clipper's norm and scaled gradients are torch.nn.utils.clip_grad_norm_'s."""
    from disttrain.train.clipping import GradClipper
    from disttrain.train.strategies.base import Strategy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    twin = torch.nn.Sequential(*(m for m in __import__("copy").deepcopy(model)))
    x = torch.randn(6, 5)
    for m in (model, twin):
        m(x).pow(2).sum().backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy = Strategy(model, optimizer, None)
    strategy.use_grad_clipping(GradClipper(strategy, 0.3))
    want = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.3)
    optimizer.step()  # the clipper runs as the step's pre-hook
    assert strategy.clipper.norms == [pytest.approx(float(want), rel=1e-6)]
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, (q - 0.1 * q.grad).detach(), msg=name)


@pytest.mark.parametrize(("strategy", "options", "word"), [
    ("ps-sync", {}, "servers"), ("torch-fsdp", {}, "its own way")])
def test_clipping_where_no_global_norm_exists_is_refused_in_one_line(strategy, options, word):
    from disttrain.train.strategies import get_strategy

    config = dataclasses.replace(MESH if strategy == "3d" else PIPELINE, strategy=strategy,
                                 clip_grad_norm=1.0, parallel=ParallelOptions(**options))
    with pytest.raises(ValueError, match=word) as exc:
        get_strategy(strategy).check_config(config, 4)
    assert "\n" not in str(exc.value)


def user_loop_with_ddp(comm: Any) -> float:
    """A hand-written loop: DataParallel, backward, disttrain.clip_grad_norm_, step."""
    import disttrain
    from disttrain.parallel import DataParallel

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    model = DataParallel(module, comm)
    x = torch.randn(8, 4)
    rows = slice(comm.rank * 4, (comm.rank + 1) * 4)
    model(x[rows]).pow(2).mean().backward()
    return disttrain.clip_grad_norm_(model, 0.1)


def test_a_hand_written_ddp_loop_clips_the_global_norm(pools):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    x = torch.randn(8, 4)
    # the replicas' mean loss over their halves is this, on the whole batch
    (module(x[:4]).pow(2).mean() / 2 + module(x[4:]).pow(2).mean() / 2).backward()
    want = float(torch.nn.utils.clip_grad_norm_(module.parameters(), 0.1))
    assert pools(2).run(user_loop_with_ddp) == [pytest.approx(want, rel=1e-6)] * 2


def fp16_norms(comm: Any, strategy: str) -> tuple[list[float], int]:
    """fp16 on 4 steps, the loss scaler's first scale so large that the first step
    overflows, then 2^8: the norms the clipper saw, and the steps the scaler skipped."""
    from disttrain.parallel import mixed_precision

    scaler = mixed_precision.LossScaler
    init, update = scaler.__init__, scaler.update

    def huge_first_scale(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.scale_value = 2.0**120  # inf in fp16 after the first backward

    def then_small(self: Any) -> None:
        update(self)
        self.scale_value = min(self.scale_value, 2.0**8)

    scaler.__init__, scaler.update = huge_first_scale, then_small  # type: ignore[method-assign]
    try:
        config = TrainConfig(model="mlp", dataset="digits", strategy=strategy, steps=4,
                             global_batch=32, precision="fp16", clip_grad_norm=0.5,
                             eval_every=0, log_every=0, progress=False)
        norms: list[float] = []
        result = train(config, comm, hooks=[lambda step: norms.append(step.grad_norm)])
        return norms, result.extras["skipped_steps"]
    finally:
        scaler.__init__, scaler.update = init, update  # type: ignore[method-assign]


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_fp16_clipping_follows_the_loss_scalers_skip(pools, strategy):
    """Every rank skips the overflowing first step (its norm inf, nothing clipped or
    applied) and clips the next ones after unscaling (norms of an unscaled gradient, the
    same on every rank)."""
    (norms, skipped), (other, also) = pools(2).run(fp16_norms, strategy)
    assert norms[0] == other[0] == float("inf") and skipped == also == 1
    # after unscaling: ~0.6 here; clipping the scaled gradient would see 2^8 times that
    assert norms == other and all(0 < n < 100 for n in norms[1:])


def _lm_and_batch() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    from disttrain.train.transformer import TransformerLM

    torch.manual_seed(0)
    model = TransformerLM(vocab_size=24, max_len=8, d_model=16, n_heads=4, n_layers=2).double()
    tokens = torch.randint(0, 24, (4, 9), generator=torch.Generator().manual_seed(1))
    return model, tokens[:, :-1], tokens[:, 1:]


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten())


def hand_written_norms(comm: Any) -> dict[str, Any]:
    """clip_grad_norm_ on what parallelize returned, on a pipeline, and refusing a shard's
    bare module, after one backward of the same batch."""
    from disttrain import clip_grad_norm_
    from disttrain.parallel.pipeline import build_pipeline
    from disttrain.parallel.tensor import parallelize

    model, x, y = _lm_and_batch()
    tp = parallelize(model, comm)
    tp.loss(tp.module(x), y).backward()
    out: dict[str, Any] = {"tp": clip_grad_norm_(tp, 1e9)}
    try:
        clip_grad_norm_(tp.module, 1e9)
    except TypeError as exc:
        out["refused"] = str(exc)
    model, x, y = _lm_and_batch()
    pipe = build_pipeline(model, comm, schedule="1f1b", microbatches=2)
    pipe.train_step(x, y, _cross_entropy)
    out["pipeline"] = clip_grad_norm_(pipe, 1e9)
    return out


def test_a_hand_written_loop_clips_tensor_parallel_and_pipeline_models(pools):
    model, x, y = _lm_and_batch()
    _cross_entropy(model(x), y).backward()
    want = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    for out in pools(2).run(hand_written_norms):
        assert out["tp"] == pytest.approx(want, rel=1e-9)
        assert out["pipeline"] == pytest.approx(want, rel=1e-9)
        assert "pass the object parallelize() returned" in out["refused"]
