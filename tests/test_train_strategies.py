"""Every strategy in the shared loop trains the single process's model: ZeRO 1-3, model
parallel, GPipe, 1F1B (also in a pp × dp grid), and torch's ZeroRedundancyOptimizer and
pipelining baselines; their bytes per step equal the formulas; ZeRO checkpoints resume on
another world size and stage; pipeline checkpoints resume exactly.

Tolerances: every run is float32 and sees exactly the samples of the reference; only the
order of floating-point sums differs (gradients averaged over ranks or accumulated over
micro-batches instead of summed over one batch), a relative error of ~1e-7 per step that
4-6 steps of SGD or Adam keep below 1e-6. rtol=1e-5 / atol=1e-6 is tight enough that a
missed gradient average, a skipped micro-batch or a lost optimizer state fails by orders of
magnitude. Accuracy may differ by one held-out sample (359 in digits) when a logit sits on
a tie within that error.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from disttrain.train import ParallelOptions, TrainConfig, train

ONE_SAMPLE = 1.01 / 359  # one held-out digit
TOL = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def quiet(**kwargs) -> TrainConfig:
    return TrainConfig(model="mlp", log_every=0, progress=False, **kwargs)


def params(result) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in result.model.state_dict().items()}


def rank_train(comm, config: TrainConfig):
    result = train(config, comm)
    return params(result), result.without_model()


def rank_train_error(comm, config: TrainConfig) -> str:
    try:
        train(config, comm)
    except ValueError as exc:
        return str(exc)
    return "no error"


def assert_matches(per_rank, reference, *, split: bool = False) -> None:
    """Every rank's parameters equal the reference's (``split``: each rank holds a part,
    together all of it), and the loss and accuracy agree."""
    want = params(reference)
    seen: set[str] = set()
    for rank, (got, result) in enumerate(per_rank):
        assert split or set(got) == set(want)
        for name, tensor in got.items():
            torch.testing.assert_close(tensor, want[name], **TOL, msg=f"rank {rank} {name}")
        seen |= set(got)
        assert result.steps == reference.steps
        assert result.final_loss == pytest.approx(reference.final_loss, rel=1e-5)
        assert result.accuracy == pytest.approx(reference.accuracy, abs=ONE_SAMPLE)
    assert seen == set(want), "the stages together hold every parameter"


# ---------------------------------------------------------------- ZeRO
@pytest.mark.nccl_rules
@pytest.mark.parametrize("strategy,accumulate", [("zero1", 1), ("zero2", 2), ("zero3", 2)])
def test_zero_matches_single_and_sends_the_formula(pools, strategy, accumulate):
    config = quiet(steps=4, global_batch=48, accumulate=accumulate, optimizer="adam", lr=2e-3)
    reference = train(config)
    ring = ParallelOptions(algorithm="ring")  # 'auto' may pick 'native', whose bytes are unseen
    per_rank = pools(2).run(rank_train, dataclasses.replace(config, strategy=strategy,
                                                            parallel=ring))
    assert_matches(per_rank, reference)
    for _, result in per_rank:
        # measured by comm.stats; the formula counts the shards' padding and, for stages 2
        # and 3, one reduce-scatter (and two gathers) per micro-batch
        assert result.bytes_sent_per_step == [result.theory_bytes_per_step] * 4
        assert result.bytes_unobserved == 0
        memory = result.extras["model_state_bytes"]
        formula = result.extras["model_state_bytes_formula"]
        for part in ("params", "grads", "optimizer"):  # Adam's step counters: a few bytes
            assert memory[part] == pytest.approx(formula[part], rel=1e-3), part
    # Ψ = 26122 parameters (even: no padding on 2 ranks); a ring all-reduce sends 4Ψ bytes.
    # zero1: reduce-scatter + all-gather = 4Ψ; zero2 with 2 micro-batches: two reduce-scatters
    # + one all-gather = 1.5 × 4Ψ; zero3: 2 gathers + 1 reduce-scatter per micro-batch, 3 × 4Ψ
    psi_bytes = sum(t.numel() * 4 for t in per_rank[0][0].values())
    factor = {"zero1": 1.0, "zero2": 1.5, "zero3": 3.0}[strategy]
    assert per_rank[0][1].theory_bytes_per_step == factor * psi_bytes


def test_zero_checkpoint_resumes_on_another_world_size_and_stage(pools, tmp_path):
    """Saved by zero1 on 4 ranks after 3 steps, resumed by zero2 on 2 ranks: the same
    parameters after 6 steps as one process (Adam: the moments must survive the move)."""
    config = quiet(global_batch=48, optimizer="adam", lr=2e-3, eval_every=0,
                   checkpoint_dir=str(tmp_path))
    reference = train(dataclasses.replace(config, steps=6, checkpoint_dir=None))
    pools(4).run(rank_train, dataclasses.replace(config, strategy="zero1", steps=3))
    assert (tmp_path / "step-00000003" / "universal" / "rank-00003.pt").exists()
    resumed = pools(2).run(rank_train, dataclasses.replace(config, strategy="zero2", steps=6,
                                                           resume=True))
    assert all(r.start_step == 3 for _, r in resumed)
    assert_matches(resumed, reference)


# ---------------------------------------------------------------- pipelines
@pytest.mark.parametrize("strategy,peak_stashed", [
    ("gpipe", [4, 4]),  # every stage holds all m micro-batches
    ("1f1b", [2, 1]),  # stage s holds at most p − s
    ("model-parallel", [1, 1]),
])
@pytest.mark.nccl_rules
def test_pipelines_match_single(pools, strategy, peak_stashed):
    config = quiet(steps=4)
    reference = train(config)
    opts = ParallelOptions(microbatches=4) if strategy != "model-parallel" else ParallelOptions()
    per_rank = pools(2).run(rank_train, dataclasses.replace(config, strategy=strategy,
                                                            parallel=opts))
    assert_matches(per_rank, reference, split=True)
    for rank, (_, result) in enumerate(per_rank):
        assert result.dp_size == 1
        # every rank reports the pipeline's loss: the whole batch's, as one process sees it
        assert result.losses == pytest.approx(reference.losses, rel=1e-5)
        # activations (or gradients) at the stage boundary + one header per message
        assert result.bytes_sent_per_step == [result.theory_bytes_per_step] * 4
        assert result.extras["stage"] == rank
        assert result.extras["peak_stashed"] == peak_stashed[rank]
        assert 0 < result.extras["idle_fraction"] < 1


@pytest.mark.nccl_rules
def test_pp_dp_grid_matches_single(pools):
    """4 ranks = 2 replicas of a 2-stage 1F1B pipeline: replica r reads shard r of each
    global batch, and the stages average gradients over their dp group."""
    config = quiet(steps=3, global_batch=48)
    reference = train(config)
    opts = ParallelOptions(microbatches=3, pp_size=2)
    per_rank = pools(4).run(rank_train, dataclasses.replace(config, strategy="1f1b",
                                                            parallel=opts))
    assert_matches(per_rank, reference, split=True)
    for rank, (got, result) in enumerate(per_rank):
        assert result.dp_size == 2 and result.extras["stage"] == rank % 2
        assert result.losses == pytest.approx(reference.losses, rel=1e-5)
        # P2P to the neighbour stage + the dp all-reduce of gradients and loss (at dp = 2
        # every all-reduce algorithm sends its payload once; 'native' ones are counted as
        # unobserved). The grid's all-reduce also carries one float32 flag per parameter
        # tensor and per replica (failure reporting), which the formula leaves out.
        sent = (sum(result.bytes_sent_per_step) + result.bytes_unobserved) / 3
        flags = 4 * (len(got) + 2)
        assert 0 <= sent - result.theory_bytes_per_step <= flags


def test_pipeline_checkpoint_resumes_exactly(pools, tmp_path):
    """Each stage writes its layers' slices under the model's names, so a resume continues
    bit for bit with the same split, and with another one too (the stages compute the
    same sums wherever the layers sit)."""
    config = quiet(strategy="gpipe", parallel=ParallelOptions(microbatches=2), eval_every=0,
                   checkpoint_dir=str(tmp_path))
    whole = pools(2).run(rank_train, dataclasses.replace(config, steps=6, checkpoint_dir=None))
    pools(2).run(rank_train, dataclasses.replace(config, steps=3))
    assert sorted(p.name for p in (tmp_path / "step-00000003" / "universal").iterdir()) == [
        "rank-00000.json", "rank-00000.pt", "rank-00001.json", "rank-00001.pt"]
    want = {k: v for state, _ in whole for k, v in state.items()}
    for partition in (None, (2, 4)):
        resumed = pools(2).run(rank_train, dataclasses.replace(
            config, steps=6, resume=True, checkpoint_dir=str(tmp_path), parallel=ParallelOptions(
                microbatches=2, partition=partition)))
        got = {k: v for state, _ in resumed for k, v in state.items()}
        assert all(result.start_step == 3 for _, result in resumed)
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
        (tmp_path / "latest").write_text("step-00000003")  # the second resume starts there too


# ---------------------------------------------------------------- torch's baselines
def test_torch_zero1_matches_single_across_a_checkpoint(pools, tmp_path):
    """2 steps, a checkpoint (torch consolidates the optimizer shards on rank 0), a resume
    to 4 steps: one process's parameters after 4 steps."""
    config = quiet(steps=4, optimizer="adam", lr=2e-3, eval_every=0)
    reference = train(config)
    config = dataclasses.replace(config, strategy="torch-zero1", checkpoint_dir=str(tmp_path))
    pools(2).run(rank_train, dataclasses.replace(config, steps=2))
    per_rank = pools(2).run(rank_train, dataclasses.replace(config, resume=True))
    assert all(r.start_step == 2 for _, r in per_rank)
    assert_matches(per_rank, reference)
    for _, result in per_rank:
        assert result.bytes_sent_per_step is None  # torch's traffic bypasses disttrain.comm
        psi_bytes = sum(t.numel() * 4 for t in per_rank[0][0].values())
        assert result.theory_bytes_per_step == pytest.approx(1.5 * psi_bytes)


def test_torch_gpipe_matches_single(pools):
    config = quiet(steps=4)
    reference = train(config)
    per_rank = pools(2).run(rank_train, dataclasses.replace(
        config, strategy="torch-gpipe", parallel=ParallelOptions(microbatches=4)))
    assert_matches(per_rank, reference)  # the stages share their layers for the result
    for _, result in per_rank:
        assert result.losses == pytest.approx(reference.losses, rel=1e-5)
        assert result.bytes_sent_per_step is None and result.theory_bytes_per_step > 0
