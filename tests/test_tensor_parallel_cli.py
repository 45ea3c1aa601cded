"""``disttrain run`` with the mesh strategies: the flags map onto the config, ``--pp-size``
still works with a one-time note, and settings that cannot run are refused before any rank
starts, with the fix."""

from __future__ import annotations

import re

import pytest

from disttrain.cli import build_parser, main
from disttrain.train.cli import config_from_args
from tests.test_train_cli import disttrain

LM = ["--model", "transformer", "--dataset", "synthetic-lm"]


def test_mesh_flags_map_onto_parallel_options():
    argv = ["run", "--strategy", "3d", "-n", "8", "--dp", "2", "--tp", "2", "--pp", "2",
            "--sequence-parallel", "--microbatches", "4"]
    parallel = config_from_args(build_parser().parse_args(argv)).parallel
    assert (parallel.dp_size, parallel.tp_size, parallel.pp_size) == (2, 2, 2)
    assert parallel.sequence_parallel and parallel.microbatches == 4
    zero = build_parser().parse_args(["run", "--strategy", "3d", "--zero", "1"])
    assert config_from_args(zero).parallel.zero == 1


def test_pp_size_is_a_deprecated_alias_of_pp(capsys):
    args = build_parser().parse_args(["run", "--strategy", "1f1b", "--pp-size", "2",
                                      "--pp-size", "2"])
    assert config_from_args(args).parallel.pp_size == 2
    err = capsys.readouterr().err
    assert err.count("--pp-size is deprecated; use --pp (same meaning)") == 1, err


@pytest.mark.parametrize("args,message", [
    (["--strategy", "tp", "-n", "2"], "model 'lenet' is not a TransformerLM: use --model "
                                      "transformer --dataset synthetic-lm"),
    (["--strategy", "tp", "-n", "3", *LM],
     "tensor parallelism over 3 ranks splits n_heads=4, which does not divide by 3"),
    (["--strategy", "tp-sp", "-n", "4", "--seq-len", "10", *LM],
     "it has 10 tokens; use a sequence length divisible by 4 (--seq-len)"),
    (["--strategy", "3d", "-n", "4", "--dp", "3", "--tp", "2", *LM],
     "--dp 3 × --pp 1 × --tp 2 = 6 ranks, but the world has 4"),
    (["--strategy", "3d", "-n", "4", "--tp", "3", *LM],
     "--pp 1 × --tp 3 = 3 does not divide the world size 4"),
    (["--strategy", "3d", "-n", "2", "--tp", "2", "--zero", "1", *LM],
     "--zero 1 shards over the dp groups of a mesh with pp = 1; this mesh has dp 1"),
    (["--strategy", "3d", "-n", "4", "--cp", "2", "--zero", "3", *LM],
     "--zero 3 drops each gradient once it is reduce-scattered over dp, before context "
     "parallelism sums it over cp: use --zero 1 with --cp"),
    (["--strategy", "3d", "-n", "4", "--tp", "2", "--pp", "2", "--accumulate", "2", *LM],
     "--accumulate must be 1"),
    (["--strategy", "3d", "-n", "4", "--tp", "2", "--pp", "2", "--partition", "time", *LM],
     "use params or layer counts per stage"),
    (["--strategy", "3d", "-n", "4", "--tp", "2", "--microbatches", "4", *LM],
     "give --pp ≥ 2 with them"),
    (["--strategy", "ddp", "-n", "2", "--tp", "2"],
     "--tp does not apply to strategy 'ddp'; it applies to: 3d"),
    (["--strategy", "tp", "-n", "2", "--zero", "1", *LM],
     "--zero does not apply to strategy 'tp'; it applies to: 3d"),
])
def test_bad_mesh_settings_exit_2_with_the_fix(capsys, args, message):
    assert main(["run", "--steps", "1", "--log-every", "0", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("disttrain run: error: ") and message in err, err


def test_run_tp_sends_the_formula():
    proc = disttrain("run", "--strategy", "tp", "-n", "2", *LM, "--samples", "96",
                     "--steps", "3", "--global-batch", "8", "--algorithm", "ring",
                     "--log-every", "0", "--eval-every", "0")
    assert proc.returncode == 0, proc.stderr
    assert "result strategy=tp world_size=2 global_batch=8 steps=3" in proc.stdout
    sent = re.search(r"^bytes_per_rank_per_step=(\d+) theory=(\d+) ", proc.stdout, re.MULTILINE)
    assert sent and sent.group(1) == sent.group(2), proc.stdout
