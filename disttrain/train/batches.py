"""Batches that are not ``(inputs, targets)`` tensors and outputs that are not logits: the
loop's side of a Hugging Face-style training script.

A dataset may yield dicts (``{"input_ids": ..., "labels": ...}``, as tokenized Hugging Face
datasets do) and a model may return a ``ModelOutput`` (``.loss`` when it was given labels,
and ``.logits``). The loop and every strategy keep their ``(inputs, targets)`` pairs and
``loss_fn(output, targets)``; what changes is read here, in four rules:

* **a dict batch is the model's keyword arguments**: ``fetch`` returns ``(the dict, its
  labels)``, and :func:`unpack_dict_inputs` (a forward pre-hook on the model) turns every
  strategy's ``model(batch)`` into ``model(**batch)``, through DDP, ZeRO and
  tensor-parallel shards alike (a shard is a copy of the model, hook included);
* **targets are aligned with the logits**: a causal LM shifts its labels inside (position
  t predicts label t + 1); :func:`batch_aligner` shifts a dict batch's labels once, when it
  is fetched, so that what a strategy scores outside the model (a pipeline's last stage,
  evaluation's accuracy) is what the model scores inside (``-100`` marks a position
  without a target, as in transformers);
* **a loss the model computed is the loss**: :func:`model_loss` is the output's ``.loss``
  when there is one (the model was given labels), else the mean cross-entropy of
  :func:`logits_of` the output against the aligned targets, ``-100`` ignored. For a causal
  LM both are the mean over the same tokens: transformers' labels loss equals
  disttrain's cross-entropy on the aligned targets;
* **logits are the output's**: a tensor, or a ``ModelOutput``'s (or dict's) ``logits``,
  or a tuple's first element.

Tuple batches, such as the built-in ``synthetic-lm`` (inputs, next tokens), are untouched:
a Hugging Face model called on a tensor returns logits and no loss, and every strategy
trains on the cross-entropy of the logits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from disttrain.parallel.mixed_precision import at_least_fp32

IGNORE_INDEX = -100  # a target position without a label (transformers' convention)
Batch = tuple[Any, Any]


def _as_keywords(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    if len(args) == 1 and isinstance(args[0], Mapping) and not kwargs:
        return (), dict(args[0])
    return None


def unpack_dict_inputs(model: nn.Module) -> RemovableHandle:
    """Let ``model(batch)`` with a dict ``batch`` mean ``model(**batch)`` (a forward
    pre-hook on ``model``; other calls are left as they are)."""
    return model.register_forward_pre_hook(_as_keywords, with_kwargs=True)


def logits_of(output: Any) -> torch.Tensor:
    """The logits in a model's output: the tensor itself, a ``ModelOutput``'s or a dict's
    ``logits``, or a tuple's first element; a one-line TypeError for anything else."""
    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(
        output, "logits", None)
    if logits is None and isinstance(output, (tuple, list)) and output:
        logits = output[0]
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"the model returned a {type(output).__name__} without logits; return "
                        f"a tensor, a tuple whose first element is the logits, or an object "
                        f"with .logits (a transformers ModelOutput)")
    return logits


def own_loss(output: Any) -> torch.Tensor | None:
    """The loss the model computed itself (``output.loss``, a dict's ``"loss"``), or None."""
    if isinstance(output, torch.Tensor):
        return None
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the targets that are not ``-100``; works for classes
    (B, C)/(B,) and tokens (B, T, V)/(B, T); at least fp32."""
    return F.cross_entropy(at_least_fp32(logits.flatten(0, -2)), targets.flatten(),
                           ignore_index=IGNORE_INDEX)


def model_loss(output: Any, targets: torch.Tensor | None) -> torch.Tensor:
    """The loss a step minimizes: the model's own (it was given labels), else the
    cross-entropy of its logits against ``targets``."""
    loss = own_loss(output)
    if loss is not None:
        return loss
    if targets is None:
        raise ValueError("a dict batch without 'labels' gave the model nothing to score: "
                         "add labels to the dataset's items (or return (inputs, targets))")
    return cross_entropy(logits_of(output), targets)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """A causal LM's labels aligned with its logits: position t's target is label t + 1,
    the last position has none (``-100``)."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def shifts_labels(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers causal LM (its loss shifts the labels inside):
    one of the classes transformers' ``AutoModelForCausalLM`` builds."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(type(model), "loss_function"):
        return False
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return False
    names = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
    return any(type(model).__name__ in (n if isinstance(n, tuple) else (n,)) for n in names)


def batch_aligner(model: nn.Module) -> Callable[[Batch], Batch]:
    """What the loop applies to every fetched batch of ``model``'s: a dict batch of a causal
    LM gets its labels shifted into the targets (the dict keeps them, for the model's own
    loss); any other batch is returned as it is."""
    shift = shifts_labels(model)

    def align(batch: Batch) -> Batch:
        inputs, targets = batch
        if shift and isinstance(inputs, Mapping) and isinstance(targets, torch.Tensor):
            return inputs, shift_labels(targets)
        return batch

    return align


def scores(output: Any, targets: torch.Tensor,
           loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] = model_loss
           ) -> tuple[int, int, float]:
    """``(correct, counted, loss summed over them)`` of one evaluation batch: targets of
    ``-100`` are not counted, and ``loss_fn``'s mean (the model's own loss by default, when
    it has one) is weighted by the count."""
    logits = logits_of(output)
    counted = targets != IGNORE_INDEX
    count = int(counted.sum())
    if count == 0:
        return 0, 0, 0.0
    correct = int(((logits.argmax(dim=-1) == targets) & counted).sum())
    return correct, count, float(loss_fn(output, targets)) * count
