"""``disttrain run --config run.toml``: every flag of ``disttrain run`` as a key of a TOML
file, in one section per concern, and ``--print-config``, which writes the effective
configuration back in the same form (a file ``--config`` reads again: a round trip).

A key is its flag's name with ``_`` for ``-`` (``--global-batch`` → ``global_batch``) in the
section :data:`SECTIONS` puts it in; its value has the flag's type (a TOML integer for a
count, a number for a rate, a boolean for a switch, a string for the rest)::

    [training]
    global_batch = 64
    steps = 1000

    [schedule]
    lr_schedule = "cosine"
    warmup_steps = 100

Flags on the command line override the file, wherever they stand (``--config run.toml
--steps 10`` and ``--steps 10 --config run.toml`` both run 10 steps); one of ``epochs`` or
``steps`` given on the command line replaces the other from the file. A key that is
unknown, in the wrong section or of the wrong type is a one-line error naming the key and
the file. Reading uses :mod:`tomllib` (``tomli`` on Python 3.10); writing needs no library:
the values are booleans, numbers and strings only.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI (a dependency there)
    import tomli as tomllib  # type: ignore[no-redef]

from disttrain.flags import FROM_FILE, GIVEN, DeprecatedAlias, exclusive_with, note_given

# section → the keys it holds, in the order --print-config writes them
SECTIONS: dict[str, tuple[str, ...]] = {
    "run": ("strategy", "nproc_per_node", "device", "backend", "transport", "comm_timeout",
            "timeout", "json"),
    "model": ("model", "model_config", "dtype", "precision", "activation_checkpointing",
              "compile", "compile_backend"),
    "data": ("dataset", "samples", "input_shape", "num_classes", "data_seed", "seq_len",
             "vocab_size", "token_dtype", "loader_workers", "prefetch"),
    "parallel": ("bucket_cap_mb", "compression", "find_unused_parameters", "algorithm",
                 "schedule", "microbatches", "partition", "pp", "virtual_stages", "tp", "dp",
                 "cp", "cp_variant", "ep", "dp_shard", "dp_replicate", "meta_init",
                 "sequence_parallel", "zero", "servers", "staleness", "staleness_lr",
                 "straggler"),
    "optimizer": ("optimizer", "lr", "momentum", "weight_decay", "no_decay_norms_biases",
                  "clip_grad_norm"),
    "schedule": ("lr_schedule", "warmup_steps", "min_lr"),
    "training": ("epochs", "steps", "global_batch", "accumulate", "seed", "eval_every",
                 "log_every", "untimed_steps", "peak_tflops", "progress", "tensorboard"),
    "checkpoint": ("checkpoint_dir", "checkpoint_every", "resume"),
}
NOT_KEYS = ("help", "config", "print_config")  # flags about the file itself


class ConfigFileError(ValueError):
    """A config file that cannot be used; the message is one line naming the file."""


def key_of(action: argparse.Action) -> str:
    """The file's key for a flag: its long name with ``_`` for ``-``."""
    name = next((s for s in action.option_strings if s.startswith("--")), action.dest)
    return name.removeprefix("--").replace("-", "_")


def flags_by_key(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every flag of ``parser`` a file may set, by key (old spellings are not keys)."""
    return {key_of(a): a for a in parser._actions
            if not isinstance(a, DeprecatedAlias) and key_of(a) not in NOT_KEYS}


def section_of(key: str) -> str | None:
    return next((name for name, keys in SECTIONS.items() if key in keys), None)


# ---------------------------------------------------------------------------- reading
def read(path: Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The flag values (by destination) ``path`` sets, checked against ``parser``'s flags;
    raises ConfigFileError (one line, naming the file and the key)."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigFileError(f"config file {path}: cannot read it ({exc.strerror})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigFileError(f"config file {path} is not valid TOML: {exc}") from None
    flags, values = flags_by_key(parser), dict[str, Any]()
    for section, table in data.items():
        if not isinstance(table, dict):
            where = section_of(section)
            hint = f"; put it under [{where}]" if where else ""
            raise ConfigFileError(f"config file {path}: key '{section}' is outside any "
                                  f"section{hint}")
        if section not in SECTIONS:
            raise ConfigFileError(f"config file {path}: unknown section [{section}] (the "
                                  f"sections: {', '.join(SECTIONS)})")
        for key, value in table.items():
            action = _known(path, section, key, flags)
            values[action.dest] = _checked(path, f"{section}.{key}", value, action)
    if "epochs" in values and "steps" in values and None not in (values["epochs"],
                                                                 values["steps"]):
        raise ConfigFileError(f"config file {path}: give training.epochs or training.steps, "
                              f"not both")
    return values


def _known(path: Path, section: str, key: str,
           flags: dict[str, argparse.Action]) -> argparse.Action:
    where = section_of(key)
    if key in flags and where == section:
        return flags[key]
    if key in flags and where is not None:
        raise ConfigFileError(f"config file {path}: key '{section}.{key}' belongs in "
                              f"[{where}]")
    close = difflib.get_close_matches(key, SECTIONS[section], n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise ConfigFileError(f"config file {path}: unknown key '{section}.{key}'{hint}")


def _checked(path: Path, key: str, value: Any, action: argparse.Action) -> Any:
    """``value`` as the flag would have parsed it, or ConfigFileError."""
    def wrong(what: str) -> ConfigFileError:
        return ConfigFileError(f"config file {path}: key '{key}' must be {what}, got "
                               f"{value!r}")

    if action.nargs == 0:  # a switch: store_true, --x/--no-x
        if not isinstance(value, bool):
            raise wrong("true or false")
        return value
    kind = action.type
    if isinstance(value, bool) or isinstance(value, (dict, list)):
        raise wrong(_describe(kind))
    if kind is int:
        if not isinstance(value, int):
            raise wrong("an integer")
    elif kind is float:
        if not isinstance(value, (int, float)):
            raise wrong("a number")
        value = float(value)
    elif kind in (None, str):
        if not isinstance(value, str):
            raise wrong("a string")
    elif callable(kind):  # Path, or a flag's own parser (numbers pass as their text)
        if not isinstance(value, (str, int, float)) or (
                kind is Path and not isinstance(value, str)):
            raise wrong("a string")
        try:
            value = kind(str(value))
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            raise wrong(f"a valid value ({exc})") from None
    if action.choices is not None and value not in action.choices:
        raise wrong("one of " + ", ".join(json.dumps(c) for c in action.choices))
    return value


def _describe(kind: Any) -> str:
    return {int: "an integer", float: "a number"}.get(kind, "a string")


# ---------------------------------------------------------------------------- writing
def dump(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The effective configuration of ``args`` as TOML that :func:`read` reads back (keys
    whose value is unset, None, are left out: each means the flag's own default)."""
    flags, lines = flags_by_key(parser), list[str]()
    for section, keys in SECTIONS.items():
        body = [f"{key} = {_toml(getattr(args, flags[key].dest))}"
                for key in keys if key in flags and getattr(args, flags[key].dest) is not None]
        if body:
            lines += ([""] if lines else []) + [f"[{section}]", *body]
    return "\n".join(lines) + "\n"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    return json.dumps(str(value), ensure_ascii=False)  # a TOML basic string


# ---------------------------------------------------------------------------- the flags
class _Store(argparse._StoreAction):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        note_given(parser, namespace, self)


class _StoreTrue(argparse._StoreTrueAction):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        note_given(parser, namespace, self)


class BooleanOptional(argparse.BooleanOptionalAction):
    """``--x/--no-x`` that a config file may set too (it records the command line's)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        note_given(parser, namespace, self)


class ConfigFile(argparse.Action):
    """``--config FILE``: set every flag the file names that the command line does not (the
    flags after it override it as they are parsed; those before it are not touched)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        try:
            settings = read(Path(values), parser)
        except ConfigFileError as exc:
            parser.exit(2, f"{parser.prog}: error: {exc}\n")
        given: set[str] = getattr(namespace, GIVEN, set())
        blocked = {other.dest for a in parser._actions if a.dest in given
                   for other in exclusive_with(parser, a)}
        applied = {dest for dest in settings if dest not in given and dest not in blocked}
        for dest in applied:
            setattr(namespace, dest, settings[dest])
        setattr(namespace, FROM_FILE, applied)
        setattr(namespace, self.dest, values)


def track_given(parser: argparse.ArgumentParser) -> None:
    """Make ``parser``'s plain flags (added after this call) record that they were given,
    which ``--config`` needs to let the command line win; DeprecatedAlias and
    :class:`BooleanOptional` record it themselves."""
    parser.register("action", None, _Store)
    parser.register("action", "store", _Store)
    parser.register("action", "store_true", _StoreTrue)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` and ``--print-config``."""
    parser.add_argument("--config", action=ConfigFile, metavar="FILE", default=None,
                        help="read flags from a TOML file, one section per concern "
                             "(docs/training.md); flags on the command line override it")
    parser.add_argument("--print-config", action="store_true",
                        help="print the effective configuration as TOML (what --config "
                             "reads) and exit")
