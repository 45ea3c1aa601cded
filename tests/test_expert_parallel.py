"""The mixture-of-experts model without processes: which tokens the router keeps (capacity,
first choices first, by position), the load-balancing loss, a sequence's output that does not
depend on the rest of its batch (so any split over ranks drops the same tokens), the
registered model, the configuration's one-line errors, and the bytes formula."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from disttrain.parallel.experts import (
    Experts,
    LayerTraffic,
    apply_expert_parallel,
    capacity,
    ep_bytes_per_step,
    expected_ep_bytes,
)
from disttrain.train.data import DataInfo
from disttrain.train.models import build_model
from disttrain.train.moe import (
    MoEConfig,
    TransformerMoE,
    add_aux_loss,
    moe_aux_loss,
    route,
    routing_stats,
)


def _probs(choices: list[list[int]], n_experts: int) -> torch.Tensor:
    """(1, T, E) probabilities whose ranking per token is ``choices[t]`` (best first)."""
    probs = torch.full((1, len(choices), n_experts), 0.01, dtype=torch.float64)
    for t, ranked in enumerate(choices):
        for place, e in enumerate(ranked):
            probs[0, t, e] = 0.6 - 0.2 * place
    return probs / probs.sum(-1, keepdim=True)


def _kept(routing) -> set[tuple[int, int]]:
    """(token, expert) pairs kept, from a routing whose counts list experts in order."""
    experts = torch.repeat_interleave(torch.arange(len(routing.counts)),
                                      torch.tensor(routing.counts))
    return {(int(t), int(e)) for t, e in zip(routing.token, experts)}


def test_capacity_formula():
    assert capacity(8, 4, 2, 1.0) == 4  # ⌈1 · 2 · 8 / 4⌉
    assert capacity(10, 4, 1, 1.25) == 4  # ⌈3.125⌉
    assert capacity(8, 4, 2, 100.0) == 8  # never more than T: a token picks distinct experts
    assert capacity(8, 64, 1, 0.01) == 1  # at least one
    assert capacity(8, 4, 2, None) == 8  # no limit


def test_an_expert_keeps_the_first_tokens_of_its_queue_by_position():
    """Top-1, capacity 2: expert 0 is everyone's choice; tokens 0 and 1 keep it, 2 and 3
    are dropped; token 4 goes to expert 1."""
    r = route(_probs([[0], [0], [0], [0], [1]], 3), top_k=1, slots=2)
    assert _kept(r) == {(0, 0), (1, 0), (4, 1)}
    assert r.counts == [2, 1, 0] and r.dropped == 2


def test_first_choices_come_before_second_choices():
    """Top-2, capacity 2: token 2's first choice (expert 1) beats tokens 0 and 1's second
    choice of expert 1 although they come earlier: GShard's priority, not position alone."""
    r = route(_probs([[0, 1], [0, 1], [1, 2]], 3), top_k=2, slots=2)
    assert _kept(r) == {(0, 0), (1, 0), (2, 1), (0, 1), (2, 2)}
    assert r.dropped == 1  # token 1's second choice: expert 1 was full
    first = r.gate[(r.token == 2)]
    torch.testing.assert_close(first.sum(), torch.tensor(1.0, dtype=torch.float64))


def test_rows_are_sorted_by_expert_then_token():
    r = route(torch.rand(3, 5, 4, dtype=torch.float64).softmax(-1), top_k=2, slots=5)
    experts = torch.repeat_interleave(torch.arange(4), torch.tensor(r.counts))
    keys = experts * 15 + r.token
    assert torch.equal(keys, keys.sort().values) and r.dropped == 0


def test_balance_loss_is_one_when_balanced_and_grows_with_imbalance():
    balanced = route(_probs([[0], [1], [2], [3]], 4), 1, 4).balance
    lopsided = route(_probs([[0], [0], [0], [0]], 4), 1, 4).balance
    f = torch.eye(4, dtype=torch.float64)[[0, 1, 2, 3]].mean(0)
    p = _probs([[0], [1], [2], [3]], 4)[0].mean(0)
    torch.testing.assert_close(balanced, 4 * (f * p).sum())
    assert lopsided > balanced > 0.9


def _tiny(seed: int = 0, **moe) -> TransformerMoE:
    torch.manual_seed(seed)
    config = MoEConfig(**{"n_experts": 4, "top_k": 2, "capacity_factor": 1.0,
                          "aux_loss_coef": 0.1, **moe})
    return TransformerMoE(16, 8, d_model=16, n_heads=2, n_layers=2, moe=config).double()


@pytest.mark.parametrize("top_k", [1, 2])
def test_a_sequence_is_routed_the_same_in_any_batch(top_k):
    """Capacity is per sequence: each sequence's logits, drops and aux loss are the same
    alone as in a batch of six, which is why ep and dp ranks drop what one process drops."""
    model = _tiny(top_k=top_k)
    x = torch.randint(0, 16, (6, 8), generator=torch.Generator().manual_seed(3))
    together = model(x)
    stats, aux = routing_stats(model), moe_aux_loss(model)
    assert sum(s.dropped for s in stats) > 0  # the capacity binds: the test can fail
    parts, dropped, auxes = [], 0, []
    for i in range(6):
        parts.append(model(x[i:i + 1]))
        dropped += sum(s.dropped for s in routing_stats(model))
        auxes.append(moe_aux_loss(model))
    torch.testing.assert_close(torch.cat(parts), together, rtol=0, atol=1e-12)
    assert dropped == sum(s.dropped for s in stats)
    torch.testing.assert_close(torch.stack(auxes).mean(), aux)


def test_no_capacity_limit_drops_nothing_and_dropping_changes_the_output():
    x = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(5))
    limited, unlimited = _tiny(), _tiny(capacity_factor=None)
    y_limited, y_unlimited = limited(x), unlimited(x)
    assert sum(s.dropped for s in routing_stats(unlimited)) == 0
    assert sum(s.dropped for s in routing_stats(limited)) > 0
    assert not torch.allclose(y_limited, y_unlimited)


def test_the_aux_loss_reaches_the_router_and_copies_keep_no_graph():
    model = _tiny()
    x = torch.randint(0, 16, (2, 8))
    model(x)
    loss = add_aux_loss(lambda out, y: out.sum() * 0, model)(model(x), x)
    torch.testing.assert_close(loss, model.aux_loss)
    loss.backward()
    assert model[1].mlp.router.weight.grad.abs().sum() > 0
    assert copy.deepcopy(model)[1].mlp.aux_loss is None


def test_transformer_moe_is_registered():
    model = build_model("transformer-moe", DataInfo((16,), 32, "lm"))
    assert isinstance(model, TransformerMoE)
    out = model(torch.randint(0, 32, (2, 16)))
    assert out.shape == (2, 16, 32) and model.aux_loss.ndim == 0
    with pytest.raises(ValueError, match="language model"):
        build_model("transformer-moe", DataInfo((1, 8, 8), 10))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"n_experts": 0}, "n_experts must be an int ≥ 1"),
    ({"top_k": 3}, "top_k must be 1 or 2"),
    ({"n_experts": 1, "top_k": 2}, "at most n_experts=1"),
    ({"capacity_factor": 0}, "capacity_factor must be a positive number"),
    ({"aux_loss_coef": -1}, "aux_loss_coef must be a number ≥ 0"),
    ({"d_ff": 0}, "d_ff must be an int ≥ 1"),
])
def test_config_errors_name_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(**kwargs)


def test_experts_that_do_not_divide_over_ep_are_an_error_before_any_collective():
    group = types.SimpleNamespace(world_size=3, rank=0)  # no collective may run
    with pytest.raises(ValueError, match="4 experts do not divide over ep = 3 ranks"):
        apply_expert_parallel(_tiny(), group)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no mixture-of-experts layer"):
        apply_expert_parallel(torch.nn.Linear(2, 2), group)  # type: ignore[arg-type]


def test_experts_run_each_row_through_its_expert():
    torch.manual_seed(0)
    experts = Experts.build(3, 4, 8).double()
    rows = torch.randn(5, 4, dtype=torch.float64)
    out = experts(rows, [2, 0, 3])
    torch.testing.assert_close(out[:2], experts["0"](rows[:2]))
    torch.testing.assert_close(out[2:], experts["2"](rows[2:]))
    with pytest.raises(ValueError, match="3 expert row counts summing to the 5 rows"):
        experts(rows, [2, 2])


def test_bytes_formula():
    """Per layer 2·(sent + received)·h·e plus the counts, then the replicated all-reduce."""
    layers = [LayerTraffic(10, 6, 1), LayerTraffic(3, 0, 1)]
    # h = 16, e = 8, ep = 2, E = 4: counts (2 − 1)·2·8 = 16 bytes per forward
    expected = 2 * 16 * 16 * 8 + 16 + 2 * 3 * 16 * 8 + 16 + 100 * 8  # ring over 2: V
    assert ep_bytes_per_step(layers, 16, 8, 2, 4, 100, rank=0) == expected
    assert ep_bytes_per_step(layers, 16, 8, 1, 4, 100, rank=0) == 0
    # balanced: each rank sends and receives k·N·(ep−1)/ep rows per layer, twice
    assert expected_ep_bytes(32, 2, 16, 2, 4, 8, 4, 0) == pytest.approx(
        2 * (4 * 2 * 32 * 3 / 4 * 16 * 4 + 3 * 2 * 8))
