"""``--strategy 1f1b --virtual-stages V`` in the shared loop: interleaved 1F1B trains one
process's model (fp32, Adam; loss, parameters), sends the bytes of the formula every step,
reports its bubble's theory, resumes from its checkpoints exactly; and ``disttrain run``
refuses what cannot interleave before any rank starts, with the fix."""

from __future__ import annotations

import dataclasses

import pytest

from disttrain.cli import build_parser, main
from disttrain.train import ParallelOptions, train
from disttrain.train.cli import config_from_args
from tests.test_train_strategies import assert_matches, quiet, rank_train


def test_interleaved_1f1b_matches_single_and_sends_the_formula(pools):
    config = quiet(steps=4, optimizer="adam", lr=2e-3)
    reference = train(config)
    opts = ParallelOptions(microbatches=4, virtual_stages=2)  # mlp: 6 layers in 4 pieces
    per_rank = pools(2).run(rank_train, dataclasses.replace(config, strategy="1f1b",
                                                            parallel=opts))
    assert_matches(per_rank, reference, split=True)
    for rank, (_, result) in enumerate(per_rank):
        assert result.losses == pytest.approx(reference.losses, rel=1e-5)
        # each chunk's boundary activations (or gradients), m messages with a header each
        assert result.bytes_sent_per_step == [result.theory_bytes_per_step] * 4
        extras = result.extras
        assert extras["virtual_stages"] == 2 and len(extras["layers"]) == 4  # 2 chunks
        assert extras["bubble_theory"] == pytest.approx(1 / 9)  # (p − 1)/(v·m + p − 1)
        assert extras["peak_stashed"] == [5, 3][rank]  # chunk-micro-batches, as on paper


def test_three_stages_of_two_chunks_match_single(pools):
    config = quiet(steps=3, global_batch=48)
    reference = train(config)
    opts = ParallelOptions(microbatches=6, virtual_stages=2)  # one layer per piece
    per_rank = pools(3).run(rank_train, dataclasses.replace(config, strategy="1f1b",
                                                            parallel=opts))
    assert_matches(per_rank, reference, split=True)
    for _, result in per_rank:
        assert result.bytes_sent_per_step == [result.theory_bytes_per_step] * 3


def test_interleaved_checkpoint_resumes_exactly(pools, tmp_path):
    config = quiet(strategy="1f1b", parallel=ParallelOptions(microbatches=2, virtual_stages=2),
                   eval_every=0, checkpoint_dir=str(tmp_path))
    whole = pools(2).run(rank_train, dataclasses.replace(config, steps=4, checkpoint_dir=None))
    pools(2).run(rank_train, dataclasses.replace(config, steps=2))
    resumed = pools(2).run(rank_train, dataclasses.replace(config, steps=4, resume=True))
    for (want, _), (got, result) in zip(whole, resumed):
        assert result.start_step == 2 and set(got) == set(want)
        for name in want:
            assert got[name].equal(want[name]), name


def test_the_flag_maps_onto_the_config():
    args = build_parser().parse_args(["run", "--strategy", "pipeline", "--virtual-stages", "3"])
    config = config_from_args(args)
    assert config.strategy == "1f1b" and config.parallel.virtual_stages == 3


MLP = ["--model", "mlp", "-n", "2"]


@pytest.mark.parametrize("args,message", [
    (["--strategy", "gpipe", *MLP, "--virtual-stages", "2"],
     "--virtual-stages does not apply to strategy 'gpipe'; it applies to: 1f1b"),
    (["--strategy", "3d", *MLP, "--pp", "2", "--virtual-stages", "2"],
     "--virtual-stages does not apply to strategy '3d'"),
    (["--strategy", "1f1b", *MLP, "--virtual-stages", "2", "--microbatches", "3"],
     "in groups of 2, as Megatron-LM does: use a --microbatches that is a multiple of 2, not 3"),
    (["--strategy", "1f1b", *MLP, "--virtual-stages", "4"],
     "cuts model 'mlp' into 2 stages × 4 = 8 pieces of at least one layer, but it has 6 "
     "layers: use --virtual-stages 3 or less"),
    (["--strategy", "1f1b", "--model", "mlp", "-n", "2", "--pp", "1", "--virtual-stages", "2"],
     "interleaves the chunks of several pipeline stages; this run has one"),
    (["--strategy", "1f1b", *MLP, "--virtual-stages", "2", "--partition", "3,3"],
     "balance [3, 3] has 2 stages but the pipeline has 4"),
    (["--strategy", "1f1b", *MLP, "--virtual-stages", "0"], "virtual_stages must be an int ≥ 1"),
])
def test_what_cannot_interleave_is_refused_before_any_rank_starts(capsys, monkeypatch, args,
                                                                  message):
    from disttrain.train import spawn

    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(spawn, "run_local", no_ranks)
    assert main(["run", "--steps", "1", "--log-every", "0", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("disttrain run: error: ") and message in err, err
    assert err.count("\n") == 1, err  # one line
