"""``disttrain run --config FILE``: every flag as a key in its section, the command line over
the file wherever it stands, one-line errors for bad keys, and ``--print-config`` writing
what ``--config`` reads back (a round trip); the training page's recipe is such a file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from disttrain.cli import build_parser, main
from disttrain.train.cli import config_from_args, run_parser
from disttrain.train.config_file import SECTIONS, flags_by_key

ROOT = Path(__file__).resolve().parent.parent
IGNORED = {"func", "command", "verbose", "config", "print_config", "given_flags",
           "config_file_flags"}  # not settings of the run


def parse(*argv: str):
    return build_parser().parse_args(["run", *argv])


def settings(args) -> dict:
    return {k: v for k, v in vars(args).items() if k not in IGNORED}


def printed(capsys, *argv: str) -> str:
    assert main(["run", *argv, "--print-config"]) == 0
    return capsys.readouterr().out


def test_every_flag_has_a_key_in_one_section():
    keys = set(flags_by_key(run_parser()))
    placed = [k for section in SECTIONS.values() for k in section]
    assert len(placed) == len(set(placed)), "a key in two sections"
    missing = sorted(keys - set(placed))
    assert not missing, (f"add {missing} to a section of SECTIONS in "
                         f"disttrain/train/config_file.py (and to docs/training.md's keys)")
    page = (ROOT / "docs" / "training.md").read_text()
    for section, keys in SECTIONS.items():
        listed = re.search(rf"^\| `\[{section}\]` \| (.*) \|$", page, re.MULTILINE)
        assert listed, f"docs/training.md has no row for [{section}]"
        assert listed.group(1) == ", ".join(f"`{k}`" for k in keys), section


def test_print_config_round_trips(tmp_path, capsys):
    argv = ["--strategy", "zero2", "-n", "2", "--model", "transformer", "--dataset",
            "synthetic-lm", "--steps", "30", "--optimizer", "adamw", "--lr", "3e-4",
            "--lr-schedule", "cosine", "--warmup-steps", "10", "--min-lr", "3e-5",
            "--clip-grad-norm", "1.0", "--peak-tflops", "auto", "--no-progress",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--straggler", "1:2",
            "--json", str(tmp_path / "out.json"), "--comm-timeout", "30"]
    text = printed(capsys, *argv)
    assert "[schedule]\nlr_schedule = \"cosine\"\nwarmup_steps = 10\nmin_lr = 3e-05\n" in text
    file = tmp_path / "run.toml"
    file.write_text(text)
    assert printed(capsys, "--config", str(file)) == text
    assert settings(parse("--config", str(file))) == settings(parse(*argv))


def test_the_command_line_wins_wherever_it_stands(tmp_path):
    file = tmp_path / "run.toml"
    file.write_text('[optimizer]\nlr = 0.1\noptimizer = "adam"\n\n[training]\nepochs = 3\n'
                    'global_batch = 64\n')
    before, after = parse("--lr", "0.05", "--config", str(file)), parse(
        "--config", str(file), "--lr", "0.05")
    for args in (before, after):  # 0.05 is also the default: given, it still wins
        assert (args.lr, args.optimizer, args.epochs) == (0.05, "adam", 3)
    for args in (parse("--steps", "7", "--config", str(file)),
                 parse("--config", str(file), "--steps", "7")):
        config = config_from_args(args)  # --steps replaces the file's epochs
        assert (config.steps, config.epochs, config.global_batch) == (7, None, 64)
    old = parse("--batch", "16", "--config", str(file))  # an old spelling counts as given
    assert old.global_batch == 16


@pytest.mark.parametrize("text,error", [
    ('[training]\nstepz = 10\n', "unknown key 'training.stepz' (did you mean 'steps'?)"),
    ('[training]\nsteps = "ten"\n', "key 'training.steps' must be an integer, got 'ten'"),
    ('[training]\nsteps = 1.5\n', "key 'training.steps' must be an integer"),
    ('[optimizer]\nlr = "fast"\n', "key 'optimizer.lr' must be a number"),
    ('[optimizer]\nlr = true\n', "key 'optimizer.lr' must be a number"),
    ('[checkpoint]\nresume = 1\n', "key 'checkpoint.resume' must be true or false"),
    ('[schedule]\nlr_schedule = "step"\n',
     'key \'schedule.lr_schedule\' must be one of "constant", "linear", "cosine"'),
    ('[model]\nlr = 0.1\n', "key 'model.lr' belongs in [optimizer]"),
    ('lr = 0.1\n', "key 'lr' is outside any section; put it under [optimizer]"),
    ('[optimiser]\nlr = 0.1\n', "unknown section [optimiser]"),
    ('[training]\nepochs = 1\nsteps = 2\n', "give training.epochs or training.steps"),
    ('[training\n', "is not valid TOML"),
])
def test_a_bad_file_is_one_line_naming_the_file_and_key(tmp_path, capsys, text, error):
    file = tmp_path / "run.toml"
    file.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        parse("--config", str(file))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(file) in err and error in err, err


def test_a_missing_file_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse("--config", str(tmp_path / "none.toml"))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "none.toml: cannot read it" in err


def test_the_training_pages_recipe_is_a_config_file(tmp_path, capsys):
    page = (ROOT / "docs" / "training.md").read_text()
    recipe = re.search(r"```toml\n(.*?)```", page, re.DOTALL)
    assert recipe, "docs/training.md shows no ```toml recipe"
    file = tmp_path / "run.toml"
    file.write_text(recipe.group(1))
    config = config_from_args(parse("--config", str(file)))
    assert config.lr_schedule == "cosine" and config.warmup_steps > 0
    assert printed(capsys, "--config", str(file)).startswith("[run]")


def test_run_prints_the_rate_and_tokens_each_logged_step(tmp_path):
    from tests.test_train_cli import disttrain

    out = tmp_path / "result.json"
    proc = disttrain("run", "--model", "transformer", "--dataset", "synthetic-lm", "--steps",
                     "4", "--global-batch", "8", "--lr-schedule", "linear", "--warmup-steps",
                     "2", "--log-every", "1", "--peak-tflops", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    rates = [float(r) for r in re.findall(r" lr=([0-9.e+-]+) tokens/s=\s*[0-9.]+ mfu=\s*"
                                          r"[0-9.]+%", proc.stderr)]
    assert rates == pytest.approx([0.05 / 3, 0.1 / 3, 0.025, 0.0], rel=1e-4), proc.stderr
    row = json.loads(out.read_text())
    assert row["learning_rates"] == pytest.approx([0.05 / 3, 0.1 / 3, 0.025, 0.0])
    assert row["tokens_per_s"] == pytest.approx(row["samples_per_s"] * 32)  # seq_len 32
    assert 0 < row["mfu"] < 1 and row["model_flops_per_token"] > 0
    assert re.search(r"^result .* tokens/s=[0-9.]+ mfu=[0-9.]+%$", proc.stdout, re.MULTILINE)
