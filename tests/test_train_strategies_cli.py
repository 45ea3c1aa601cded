"""``disttrain run`` with the pipeline and ZeRO strategies: the issue's pipeline command trains
the single process's model; flags that do not fit the strategy are refused before any rank
starts, with the fix."""

from __future__ import annotations

import re

import pytest
import torch

from disttrain.cli import build_parser, main
from disttrain.train import TrainConfig, train
from disttrain.train.cli import config_from_args
from tests.test_train_cli import accuracy, disttrain


def test_run_1f1b_two_stages_matches_single():
    proc = disttrain("run", "--strategy", "1f1b", "-n", "2", "--microbatches", "4", "--model",
                     "mlp", "--dataset", "digits", "--epochs", "1", "--log-every", "0")
    assert proc.returncode == 0, proc.stderr
    assert "result strategy=1f1b world_size=2 global_batch=32 steps=44" in proc.stdout
    sent = re.search(r"^bytes_per_rank_per_step=(\d+) theory=(\d+) ", proc.stdout, re.MULTILINE)
    assert sent and sent.group(1) == sent.group(2), proc.stdout
    torch.set_num_threads(1)
    one = train(TrainConfig(model="mlp", dataset="digits", epochs=1, log_every=0,
                            progress=False))
    assert accuracy(proc.stdout) == pytest.approx(one.accuracy, abs=1.01 / 359)


@pytest.mark.parametrize("transport,algorithm", [("shm", "auto"), ("torch", "native")])
def test_run_never_shows_zero_bytes_for_collectives_that_ran(transport, algorithm):
    """DDP's gradient all-reduce on 2 ranks: on shared memory it is counted (the bytes each
    rank writes for the other) and equals its theory; handed to Gloo ('native', which
    ``auto`` picks on the torch transport for LeNet's 122 KiB unless a calibration says
    otherwise) its bytes are not visible: the line says so instead of printing 0, and the
    metrics line shows the payload under native_MB."""
    proc = disttrain("run", "--strategy", "ddp", "-n", "2", "--steps", "10", "--log-every",
                     "10", "--transport", transport, "--algorithm", algorithm)
    assert proc.returncode == 0, proc.stderr
    line = re.search(r"^bytes_per_rank_per_step=(\S+) theory=(\d+) bytes_unobserved=(\d+)",
                     proc.stdout, re.MULTILINE)
    assert line, proc.stdout
    comm = re.search(r"comm_MB=\s+([0-9.]+) peak_mem_MB=\s+[0-9.]+ native_MB=\s+([0-9.]+)",
                     proc.stderr)
    assert comm, proc.stderr
    if transport == "shm":
        assert line.group(1) == line.group(2) != "0" and line.group(3) == "0"
        assert float(comm.group(1)) > 0 and float(comm.group(2)) == 0
    else:
        assert line.group(1) == "-" and int(line.group(3)) == 10 * int(line.group(2))
        assert "ran inside torch.distributed" in proc.stdout
        assert float(comm.group(2)) > 0


@pytest.mark.parametrize("args,message", [
    (["--strategy", "ddp", "-n", "2", "--microbatches", "4"],
     "--microbatches does not apply to strategy 'ddp'; it applies to: gpipe, 1f1b, 3d, "
     "torch-gpipe, deepspeed-pipe (for gradient accumulation use --accumulate)"),
    (["--strategy", "pipeline", "--schedule", "interleaved", "-n", "2"],
     "schedule must be one of gpipe, 1f1b, got 'interleaved'"),
    (["--strategy", "gpipe", "--schedule", "1f1b", "-n", "2"],
     "--schedule 1f1b contradicts strategy 'gpipe'"),
    (["--strategy", "1f1b", "-n", "4", "--pp", "3"], "--pp 3 does not divide"),
    (["--strategy", "1f1b", "-n", "2", "--microbatches", "64"],
     "fewer than 64 micro-batches; use --microbatches 32 or less"),
    (["--strategy", "gpipe", "-n", "2", "--accumulate", "2"], "--accumulate must be 1"),
    (["--strategy", "model-parallel", "-n", "2", "--pp", "2"],
     "--pp does not apply to strategy 'model-parallel'"),
    (["--strategy", "zero2", "-n", "2", "--compression", "fp16"],
     "--compression does not apply to strategy 'zero2'; it applies to: ddp"),
    (["--strategy", "1f1b", "-n", "2", "--partition", "3;3"], "--partition must be 'params'"),
    (["--strategy", "torch-gpipe", "-n", "2", "--microbatches", "5"],
     "torch-gpipe needs equal micro-batches"),
    (["--strategy", "ps-sync", "-n", "2", "--staleness", "1"],
     "--staleness does not apply to strategy 'ps-sync'; it applies to: ps-ssp"),
    (["--strategy", "ddp", "-n", "2", "--servers", "1"],
     "--servers does not apply to strategy 'ddp'; it applies to: ps-sync, ps-async, ps-ssp"),
    (["--strategy", "ddp", "-n", "2", "--straggler", "1:2"],
     "--straggler does not apply to strategy 'ddp'"),
    (["--strategy", "ps-async", "-n", "2", "--straggler", "2:2"],
     "--straggler ranks [2] are not workers: with 2 worker(s) the workers are ranks 0..1"),
    (["--strategy", "ps-async", "-n", "2", "--straggler", "1"],
     "--straggler: straggler '1' is not RANK:FACTOR"),
    (["--strategy", "ps-async", "-n", "2", "--straggler", "1:0.5"],
     "must be a finite number ≥ 1"),
    (["--strategy", "ps-ssp", "-n", "2", "--staleness", "-1"], "staleness must be an int ≥ 0"),
    (["--strategy", "ps-sync", "-n", "2", "--servers", "0"], "servers must be an int ≥ 1"),
    (["--strategy", "ps-sync", "-n", "3"], "does not split evenly over 3 data-parallel"),
    (["--strategy", "ps-sync", "-n", "2", "--checkpoint-dir", "ckpt", "--checkpoint-every", "1"],
     "'ps-sync' checkpoints at the end of a run only"),
])
def test_bad_flag_combinations_exit_2_with_the_fix(capsys, args, message):
    assert main(["run", "--steps", "1", "--log-every", "0", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("disttrain run: error: ") and message in err, err


@pytest.mark.parametrize("schedule,strategy", [(None, "1f1b"), ("gpipe", "gpipe"),
                                               ("1f1b", "1f1b")])
def test_strategy_pipeline_is_the_schedule(schedule, strategy):
    """The issue's spelling, ``--strategy pipeline --schedule 1f1b``, is the named strategy."""
    argv = ["run", "--strategy", "pipeline", "-n", "4", "--microbatches", "8", "--pp", "2"]
    args = build_parser().parse_args(argv + (["--schedule", schedule] if schedule else []))
    config = config_from_args(args)
    assert config.strategy == strategy
    assert (config.parallel.microbatches, config.parallel.pp_size) == (8, 2)


def test_partition_flag_parses_layer_counts():
    args = build_parser().parse_args(["run", "--strategy", "gpipe", "--partition", "3,2,1"])
    assert config_from_args(args).parallel.partition == (3, 2, 1)


def test_ps_flags_map_onto_parallel_options():
    argv = ["run", "--strategy", "ps-ssp", "-n", "4", "--servers", "2", "--staleness", "3",
            "--straggler", "3:1.5,1:2"]
    parallel = config_from_args(build_parser().parse_args(argv)).parallel
    assert (parallel.servers, parallel.staleness) == (2, 3)
    assert parallel.straggler == ((1, 2.0), (3, 1.5))


@pytest.mark.parametrize("env,args,message", [
    ({"WORLD_SIZE": "1"}, [], "needs at least one worker, but the job has 1 rank(s)"),
    ({"WORLD_SIZE": "3", "DISTTRAIN_PS_SERVERS": "1"}, ["--servers", "2"],
     "--servers 2 disagrees with DISTTRAIN_PS_SERVERS=1"),
    ({"WORLD_SIZE": "3", "DISTTRAIN_PS_SERVERS": "x"}, [], "DISTTRAIN_PS_SERVERS='x'"),
])
def test_ps_in_a_launched_job_checks_the_servers(monkeypatch, capsys, env, args, message):
    monkeypatch.setenv("RANK", "0")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["run", "--strategy", "ps-sync", "--steps", "1", *args]) == 2
    assert message in capsys.readouterr().err
