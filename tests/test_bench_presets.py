"""``disttrain bench``'s workloads and rows without running them: presets and their
overrides, the reference's threads, DeepSpeed rows skipped with a note when it is missing,
the comparisons against torch and DeepSpeed, and the table's memory and byte cells."""

from __future__ import annotations

import pytest

from disttrain.baselines import deepspeed_rows as deepspeed_baseline
from disttrain.bench import experiments as experiments_module
from disttrain.bench.experiments import BenchConfig, experiments, plan
from disttrain.bench.presets import DEFAULT_PRESET, PRESETS, get_preset
from disttrain.bench.report import cells, markdown_table, text_table
from disttrain.bench.strategy_bench import add_comparisons, train_config
from disttrain.cli import main
from disttrain.train import STRATEGIES


def test_the_default_config_is_the_default_preset():
    preset, config = get_preset(DEFAULT_PRESET), BenchConfig()
    assert (config.model, config.dataset, config.optimizer, config.lr, config.global_batch) == (
        preset.model, preset.dataset, preset.optimizer, preset.lr, preset.global_batch)
    assert config.length == (preset.epochs, preset.steps) == BenchConfig.from_preset().length
    assert (config.transport, config.algorithm) == ("auto", "auto")


def test_flags_override_the_preset_and_reach_every_row():
    config = BenchConfig.from_preset("lenet-digits", steps=5, lr=0.1, optimizer="adam",
                                     strategies=("ddp", "ps-sync", "ps-async"),
                                     staleness_lr="none")
    assert config.length == (None, 5) and config.model == "lenet"
    runs = {run.label: train_config(config, run) for run in plan(config)}
    for tconfig in runs.values():
        assert (tconfig.model, tconfig.dataset, tconfig.optimizer, tconfig.lr, tconfig.steps) \
            == ("lenet", "digits", "adam", 0.1, 5)
    assert runs["ps-async n=2+1"].parallel.staleness_lr == "none"
    assert runs["ps-sync n=2+1"].parallel.staleness_lr is None  # sync has no staleness
    assert runs["ddp n=2"].parallel.staleness_lr is None
    from disttrain.train.loop import checked_setup

    for run in plan(config):
        checked_setup(train_config(config, run), run.ranks)  # none refused


def test_every_preset_plans_runnable_rows():
    """Every preset's model builds on its data and its rows pass the checks made before
    any rank starts (the DeepSpeed rows need DeepSpeed: skipped here when it is absent)."""
    from disttrain.train.loop import checked_setup

    for name in PRESETS:
        config = BenchConfig.from_preset(name)
        for run in plan(config):
            checked_setup(train_config(config, run), run.ranks)
    seed = BenchConfig.from_preset("distributedtest")
    wanted = {"ddp", "torch-ddp", "model-parallel", "gpipe", "torch-zero1", "zero1", "zero3",
              "deepspeed-zero1"}
    assert wanted <= set(seed.strategies or ())


def test_unknown_preset_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--preset", "resnet-imagenet"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'resnet-imagenet'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown preset"):
        BenchConfig.from_preset("nope")


def test_the_reference_uses_the_cores_the_ranks_use(monkeypatch):
    monkeypatch.setattr(experiments_module.os, "sched_getaffinity", lambda pid: {0, 1, 2},
                        raising=False)
    runs = {run.label: run for run in plan(BenchConfig(strategies=("ddp",), world_sizes=(2, 4)))}
    config = BenchConfig(strategies=("ddp",), world_sizes=(2, 4))
    assert config.threads_of(runs["single n=1"]) == 3  # the largest -n, up to the cores
    assert config.threads_of(runs["ddp n=4"]) == 1
    assert BenchConfig(world_sizes=(2,)).threads_of(runs["single n=1"]) == 2
    assert BenchConfig(reference_threads=1).threads_of(runs["single n=1"]) == 1
    with pytest.raises(ValueError, match="--reference-threads"):
        BenchConfig(reference_threads=0)


def test_deepspeed_rows_are_skipped_with_a_note_when_it_is_missing(monkeypatch):
    monkeypatch.setattr(deepspeed_baseline, "available", lambda: False)
    config = BenchConfig(strategies=("zero1", "deepspeed-zero1", "deepspeed-zero3"))
    assert [run.label for run in plan(config)] == ["single n=1", "zero1 n=2"]
    skipped = config.skipped()
    assert [name for name, _ in skipped] == ["deepspeed-zero1", "deepspeed-zero3"]
    assert all("pip install 'disttrain[baselines]'" in why for _, why in skipped)
    text = markdown_table([], {"skipped": skipped})
    assert "* deepspeed-zero1 skipped: DeepSpeed is not installed" in text
    monkeypatch.setattr(deepspeed_baseline, "available", lambda: True)
    assert len(plan(config)) == 4 and not config.skipped()


def test_deepspeed_rows_are_registered_baselines():
    for name in ("deepspeed-ddp", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3",
                 "torch-fsdp"):
        assert name in STRATEGIES and experiments()[name].is_baseline


def _row(strategy, speed, **extra):
    exp = experiments()[strategy]
    return {"strategy": strategy, "world_size": 2, "servers": 0, "global_batch": 64,
            "samples_per_s": speed, "error": None, "compare_to": exp.compare_to,
            "compare_to_deepspeed": exp.compare_to_deepspeed, "accuracy": 0.9,
            "final_loss": 0.5, **extra}


def test_rows_are_compared_with_torch_and_deepspeed():
    rows = [_row("torch-fsdp", 100.0), _row("deepspeed-zero3", 50.0), _row("zero3", 150.0)]
    add_comparisons(rows[2], rows)
    assert rows[2]["vs_torch"] == 1.5 and rows[2]["vs_deepspeed"] == 3.0


def test_cells_show_memory_and_native_bytes():
    row = _row("ddp", 10.0, model_state_bytes=16 << 20, model_state_formula_bytes=16 << 20,
               activation_peak_bytes=3 << 20, peak_mem_bytes=400 << 20,
               bytes_sent_per_rank_per_step=0, theory_bytes_per_rank_per_step=1 << 20,
               bytes_unobserved=5 << 20, algorithm="auto")
    add_comparisons(row, [row])
    cell = dict(zip(("state", "formula", "act", "RSS", "sent"),
                    [cells(row)[i] for i in (8, 9, 10, 11, 12)]))
    assert cell == {"state": "16 MiB", "formula": "16 MiB", "act": "3 MiB", "RSS": "400 MiB",
                    "sent": "native"}
    row["bytes_sent_per_rank_per_step"] = 1024
    assert "1 KiB+native" in text_table([row])


@pytest.mark.parametrize("value,text", [(11234, "11k"), (1500, "1.5k"), (950, "950"),
                                        (130.5, "130"), (12.25, "12.2"), (2.5e6, "2.5M"),
                                        (12e9, "12G"), (0.75, "0.75")])
def test_human_counts(value, text):
    from disttrain.bench.plots import human_count

    assert human_count(value) == text


@pytest.mark.parametrize("value,text", [(1.2 * 2**30, "1.2 GiB"), (3 * 2**20, "3 MiB"),
                                        (100 * 2**10, "100 KiB"), (0, "0 B"), (512, "512 B")])
def test_human_bytes(value, text):
    from disttrain.bench.plots import human_bytes

    assert human_bytes(value) == text


def test_a_model_that_does_not_fit_the_presets_dataset_is_refused_before_any_rank():
    """``--model mlp`` on the default preset's token data: one line naming both, exit 2."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "disttrain", "bench", "--strategies", "ddp",
                           "--model", "mlp", "--steps", "2"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--model mlp --dataset synthetic-lm" in done.stderr
    assert "[1/" not in done.stderr  # no run started
