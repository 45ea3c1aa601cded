"""What can be checked of a Hugging Face model's split over a mesh before any rank starts
(the mesh checks call it; a module of its own so that it needs none of the strategies)."""

from __future__ import annotations

from typing import Any

import torch

from disttrain.train.config import TrainConfig


def check_hf_mesh(config: TrainConfig, tp: int, zero: int | None,
                  sequence_parallel: bool) -> None:
    """A Hugging Face model's split, before any rank starts (one-line ValueErrors): the
    sizes its plan divides by tp (heads, key/value heads, MLP width, vocabulary), the
    sequence under sequence parallelism, and ZeRO inside the mesh only at stages 1 and 2
    without sequence parallelism (the plan's norms are summed on whole gradients)."""
    from disttrain.parallel.presets import PRESETS
    from disttrain.train.data import build_dataset
    from disttrain.train.models import hf_model

    if config.strategy not in PRESETS:  # a baseline (torch-tp, ...): not disttrain's own
        raise ValueError(f"strategy {config.strategy!r} splits disttrain's TransformerLM; "
                         f"{config.model} is split by disttrain's tp, tp-sp and 3d (its "
                         f"built-in plan)")
    if zero and (zero == 3 or sequence_parallel):
        raise ValueError(f"--zero {zero} inside a tensor-parallel mesh of a Hugging "
                         f"Face model: use --zero 1 or 2 without --sequence-parallel")
    info = build_dataset(config.dataset, config.data).info
    with torch.device("meta"):  # shapes only
        model: Any = hf_model(config.model, info, config.model_config)
    c = model.config
    sizes = {"num_attention_heads": c.num_attention_heads,
             "num_key_value_heads": getattr(c, "num_key_value_heads", None)
             or c.num_attention_heads, "vocab_size": c.vocab_size,
             "MLP width": getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None)
             or 4 * c.hidden_size}
    if sequence_parallel:
        sizes["sequence length (--seq-len)"] = info.input_shape[-1]
    for what, size in sizes.items():
        if size % tp:
            raise ValueError(f"tensor parallelism over {tp} ranks splits {config.model}'s "
                             f"{what}={size}, which does not divide by {tp}; use a --tp that "
                             f"divides it or change --model-config")
