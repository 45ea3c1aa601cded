"""``disttrain checkpoint``: a disttrain checkpoint exported to the ecosystem's formats, and theirs
imported.

    disttrain checkpoint export --format dcp CKPT OUT           torch.distributed.checkpoint
    disttrain checkpoint export --format safetensors CKPT OUT   transformers' from_pretrained
    disttrain checkpoint import --format dcp|safetensors SRC OUT

CKPT is a --checkpoint-dir (its latest checkpoint), a step-* directory or a universal
checkpoint; an import writes a universal checkpoint that ZeRO and the loop's strategies
load. Bad input exits 2 with one line that names the file.
"""

from __future__ import annotations

import argparse
import json
import sys


def configure(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("checkpoint", help="export a checkpoint as DCP or safetensors, "
                              "or import one", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    export = actions.add_parser("export", help="write a disttrain checkpoint as DCP or "
                                "safetensors")
    export.add_argument("--model-config", default=None, metavar="FILE.json",
                        help="safetensors: the transformers config to write as config.json "
                             "(default: the one the checkpoint kept, if any)")
    imports = actions.add_parser("import", help="read DCP or safetensors into a universal "
                                 "checkpoint")
    for sub in (export, imports):
        sub.add_argument("--format", required=True, choices=("dcp", "safetensors"))
        sub.add_argument("source", metavar="SOURCE")
        sub.add_argument("out", metavar="OUT")
        sub.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from disttrain.train.interop import export_checkpoint, import_checkpoint

    try:
        if args.action == "export":
            export_checkpoint(args.source, args.out, args.format, _config(args.model_config))
        else:
            import_checkpoint(args.source, args.out, args.format)
    except (ValueError, ImportError, OSError) as exc:  # CheckpointError is a ValueError
        print(f"disttrain checkpoint: error: {exc}", file=sys.stderr)
        return 2
    print(f"disttrain checkpoint: wrote {args.out}")
    return 0


def _config(path: str | None) -> dict[str, object] | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--model-config {path} cannot be read as JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--model-config {path} must hold a JSON object")
    return config
