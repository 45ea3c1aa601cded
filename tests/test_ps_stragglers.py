"""Straggler experiments on real ranks: which steps each worker is slowed on.

``--straggler RANK:FACTOR`` slows one worker for the whole run; ``RANK:FACTOR:EVERY`` makes
the slow-down transient: it starts on RANK and moves to the next worker every EVERY steps.
The tests count the clocks each worker slept on (``WorkerReport.slow_clocks``), never time.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.ps_cases import ps_train, reference

B = 5


@pytest.mark.parametrize(("mode", "every", "slow"), [
    ("sync", 2, [(2, 3), (0, 1, 4, 5)]),  # starts on worker 1, moves on every 2 clocks
    ("async", None, [(), (0, 1, 2, 3, 4, 5)]),  # persistent: RANK:FACTOR as before
])
def test_stragglers_slow_the_steps_they_promise(pools: Any, mode: str, every: int | None,
                                                slow: list[tuple[int, ...]]) -> None:
    steps = 6
    results = pools(3).run(ps_train, 1, steps, B, mode=mode, straggler={1: 2.0},
                           straggler_every=every, compute_s=0.002)
    workers = [r for r in results if r["role"] == "worker"]
    assert [w["report"].slow_clocks for w in workers] == slow
    for w, clocks in zip(workers, slow, strict=True):
        assert (w["report"].straggler_sleep_s > 0) == bool(clocks)
    if mode == "sync":  # sleeping moves no update: still one process on the global batch
        for w in workers:
            for got, want in zip(w["params"], reference("mlp", "sgd", steps, 2 * B),
                                 strict=True):
                torch.testing.assert_close(got, want)


def test_the_rotating_flag_reaches_run_and_bench_configs(capsys: Any) -> None:
    from disttrain.bench.experiments import BenchConfig, plan
    from disttrain.bench.strategy_bench import train_config
    from disttrain.cli import build_parser, main
    from disttrain.train import ParallelOptions
    from disttrain.train.cli import config_from_args
    from disttrain.train.loop import checked_setup

    argv = ["run", "--strategy", "ps-ssp", "-n", "2", "--straggler", "1:2:5"]
    parallel = config_from_args(build_parser().parse_args(argv)).parallel
    assert (parallel.straggler, parallel.straggler_every) == (((1, 2.0),), 5)
    bench = BenchConfig(strategies=("ps-sync", "ddp"), world_sizes=(2,), straggler=((1, 2.0),),
                        straggler_every=5)
    options = {r.label: train_config(bench, r).parallel for r in plan(bench)}
    assert options["ps-sync n=2+1"].straggler_every == 5
    assert options["ddp n=2"].straggler_every is None
    with pytest.raises(ValueError, match="straggler_every needs a straggler"):
        ParallelOptions(straggler_every=3)
    ddp = config_from_args(build_parser().parse_args(["run", "--strategy", "ddp", "-n", "2",
                                                      "--straggler", "1:2:5"]))
    with pytest.raises(ValueError, match="--straggler does not apply to strategy 'ddp'"):
        checked_setup(ddp, 2)
    for command, extra in [("run", ["--strategy", "ps-sync", "-n", "2"]), ("bench", [])]:
        code: object
        try:
            code = main([command, *extra, "--straggler", "1:2:0"])
        except SystemExit as exc:
            code = exc.code
        assert code == 2
        assert "--straggler: straggler_every (the EVERY of RANK:FACTOR:EVERY) must be an int " \
            "≥ 1" in capsys.readouterr().err
