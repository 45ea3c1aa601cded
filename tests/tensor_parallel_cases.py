"""Shared pieces of the tensor-parallel tests: a small TransformerLM, its data, the
single-process reference, and rank functions for the pools (importable, so picklable)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from disttrain.train.transformer import TransformerLM

VOCAB, SEQ, D_MODEL, HEADS, LAYERS = 48, 12, 24, 12, 2  # divide by 2, 3 and 4
BATCH, STEPS, LR = 4, 3, 1e-2


def make_model(seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(VOCAB, SEQ, D_MODEL, HEADS, LAYERS)


def batches(rows: int = BATCH, steps: int = STEPS, seq: int = SEQ,
            seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (rows, seq), generator=gen),
             torch.randint(0, VOCAB, (rows, seq), generator=gen)) for _ in range(steps)]


def reference(data: list[tuple[torch.Tensor, torch.Tensor]]) -> TransformerLM:
    """The model after single-process Adam steps on the full batches."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
    return model


def without_key_bias(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with the key third of every QKV bias zeroed. Adding a constant to every
    key adds the same q·b to a query's scores, which softmax ignores: that bias has a zero
    gradient in exact arithmetic, and rounding noise (~1e-10 here) that Adam divides by its
    own square root into full-size steps, different for any other order of the same sums.
    It cannot change the model's output (the tests compare the outputs as well)."""
    out = dict(state)
    for name, t in state.items():
        if name.endswith("attention.qkv.bias"):
            t = t.clone()
            t.view(3, -1)[1].zero_()
            out[name] = t
    return out


def worst_relative_error(actual: dict[str, torch.Tensor],
                         expected: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest ‖a − e‖ / ‖e‖ over the tensors (key biases aside, see
    :func:`without_key_bias`), and its name (keys must match)."""
    assert sorted(actual) == sorted(expected), (sorted(actual), sorted(expected))
    actual, expected = without_key_bias(actual), without_key_bias(expected)
    worst = (0.0, "")
    for name, e in expected.items():
        a = actual[name]
        assert a.shape == e.shape, (name, a.shape, e.shape)
        err = float((a - e).norm() / e.norm().clamp_min(1e-12))
        worst = max(worst, (err, name))
    return worst
