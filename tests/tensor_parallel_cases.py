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


class UserBlock(torch.nn.Module):
    """A residual MLP block of a user's own model (not a transformer, not a Sequential)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc1, self.fc2 = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class UserModel(torch.nn.Module):
    """Blocks and a classifier: what docs/tensor_parallel.md's plan example splits."""

    def __init__(self, width: int = 12, classes: int = 5) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(UserBlock(width) for _ in range(2))
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def user_model_by_plan(comm) -> float:
    """The docs' plan on a user's model, float64 and plain SGD: the worst relative error
    of the parameters after three steps against one process."""
    from disttrain.parallel.tensor import ColumnWise, RowWise, SequenceParallel, parallelize

    torch.manual_seed(0)
    model = UserModel().double()
    reference = UserModel().double()
    reference.load_state_dict(model.state_dict())
    tp = parallelize(model, comm, {"blocks.*.norm": SequenceParallel(),
                                   "blocks.*.fc1": ColumnWise(), "blocks.*.fc2": RowWise()},
                     sequence_parallel=False)
    opt = torch.optim.SGD(tp.module.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(6, 12, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 5, (6,), generator=gen)
        opt.zero_grad()
        ref_opt.zero_grad()
        tp.loss(tp.module(x), y).backward()
        tp.reduce_sequence_parallel_grads()
        F.cross_entropy(reference(x), y).backward()
        opt.step()
        ref_opt.step()
    state, want = tp.full_state_dict(), reference.state_dict()
    assert sorted(state) == sorted(want)
    return max(float((state[k] - want[k]).norm() / want[k].norm()) for k in want)
