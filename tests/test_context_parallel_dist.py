"""Context parallelism on real ranks equals one process: a float64 TransformerLM whose
sequence is split over cp = 2 and 3 ranks (ring and Ulysses) has one process's loss (the
ranks' shares add up to it) and gradients, and after several SGD or Adam steps its
parameters; the bytes each rank sends are the formula's; attention keeps 1/cp of one
process's activations (Ulysses keeps its output twice); the ring posts the next block's
transfer before it attends to the current one. Over tensor-parallel shards (cp = 2 × tp = 2,
with and without sequence parallelism) the parameters match as well. The equivalence runs
under NCCL's matching rules too."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from disttrain.parallel.context import (
    apply_context_parallel,
    attention_activation_bytes,
    bytes_sent,
    split_sequence,
)
from disttrain.parallel.context import ring as ring_module
from disttrain.train.transformer import TransformerLM

VOCAB, SEQ, D_MODEL, HEADS, LAYERS = 32, 12, 24, 6, 2  # SEQ: 2·cp chunks for cp = 2, 3
TP_HEADS = 4  # cp = 2 × tp = 2: Ulysses splits each tp rank's 2 heads over cp
BATCH, STEPS = 2, 3
LR = {"sgd": 0.5, "adam": 1e-2}  # large SGD steps: a wrong gradient shows


def make_model(heads: int = HEADS) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(VOCAB, SEQ, D_MODEL, heads, LAYERS).double()


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
             torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)) for _ in range(steps)]


def optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR[name]) if name == "sgd" else torch.optim.Adam(
        params, lr=LR[name])


def single_process(opt_name: str, heads: int = HEADS
                   ) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process's losses, first-step gradients and final parameters."""
    model = make_model(heads)
    opt = optimizer(opt_name, model.parameters())
    losses, grads = [], {}
    for x, y in batches():
        opt.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        grads = grads or {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return losses, grads, model.state_dict()


def train_cp(comm: Any, variant: str, opt_name: str) -> dict[str, Any]:
    """This rank's share of the losses, its first-step gradients (summed over cp), its final
    parameters and the bytes it sent while training."""
    model = apply_context_parallel(make_model(), comm, variant, algorithm="ring",
                                   all_to_all_algorithm="naive")
    opt = optimizer(opt_name, model.parameters())
    comm.stats.reset()  # the ring's connections are made by apply_context_parallel
    losses, grads = [], {}
    for x, y in batches():
        x, y = (split_sequence(t, comm.rank, comm.world_size) for t in (x, y))
        opt.zero_grad()
        loss = model.loss(model(x), y)
        loss.backward()
        model.reduce_context_parallel_grads()
        grads = grads or {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    dtypes = {p.dtype for p in model.parameters()}
    return {"losses": losses, "grads": grads, "state": model.state_dict(),
            "bytes": comm.stats.bytes_sent, "ops": comm.stats.snapshot(), "dtypes": dtypes}


def relative_error(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                   skip_key_bias: bool = False) -> tuple[float, str]:
    """The largest ‖a − e‖ / ‖e‖ over the tensors, and its name. ``skip_key_bias``: leave
    out the key third of every QKV bias, whose gradient is zero in exact arithmetic (a
    constant added to every key shifts a query's scores alike) and rounding noise in
    practice, which Adam scales up into full-size steps that differ with the order of the
    sums: it cannot change the model's output (the losses are compared as well)."""
    assert sorted(actual) == sorted(expected)
    worst = (0.0, "")
    for name, e in expected.items():
        a = actual[name]
        if skip_key_bias and name.endswith("attention.qkv.bias"):
            a, e = a.view(3, -1)[[0, 2]], e.view(3, -1)[[0, 2]]
        worst = max(worst, (float((a - e).norm() / e.norm().clamp_min(1e-30)), name))
    return worst


@pytest.mark.nccl_rules
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
@pytest.mark.parametrize("variant", ["ring", "ulysses"])
@pytest.mark.parametrize("cp", [2, 3])
def test_context_parallel_equals_single_process(pools, cp, variant, opt_name):
    losses, grads, state = single_process(opt_name)
    results = pools(cp).run(train_cp, variant, opt_name)
    shares = [sum(r["losses"][step] for r in results) for step in range(STEPS)]
    assert shares == pytest.approx(losses, rel=1e-12, abs=0)
    for rank, result in enumerate(results):
        assert result["dtypes"] == {torch.float64}
        err, name = relative_error(result["grads"], grads)
        assert err < 1e-10, (rank, name, err)
        err, name = relative_error(result["state"], state, skip_key_bias=opt_name == "adam")
        assert err < 1e-9, (rank, name, err)
        expected = bytes_sent(variant, cp, rank, batch=BATCH, seq=SEQ, hidden=D_MODEL,
                              n_layers=LAYERS, params=sum(t.numel() for t in state.values()),
                              element_size=8, param_element_size=8)
        assert result["bytes"] == STEPS * expected, (rank, result["ops"])


def attention_activations(comm: Any, variant: str) -> tuple[int, int]:
    """Bytes autograd keeps in the first block's attention: one process's, this rank's."""

    def measure(model: torch.nn.Module, tokens: torch.Tensor) -> int:
        attention: Any = model[1].attention
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        kept: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                kept.setdefault(storage.data_ptr(), storage.nbytes())
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        before = attention.register_forward_pre_hook(lambda *_: hooks.__enter__())
        after = attention.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))
        model(tokens)
        before.remove()
        after.remove()
        return sum(kept.values())

    x, _ = batches(1)[0]
    single = measure(make_model(), x)
    model = apply_context_parallel(make_model(), comm, variant)
    return single, measure(model, split_sequence(x, comm.rank, comm.world_size))


@pytest.mark.parametrize("variant", ["ring", "ulysses"])
@pytest.mark.parametrize("cp", [2, 3])
def test_attention_keeps_one_cp_th_of_the_activations(pools, cp, variant):
    for single, mine in pools(cp).run(attention_activations, variant):
        assert single == attention_activation_bytes(BATCH, SEQ, D_MODEL, HEADS, 1, 8)
        assert mine == attention_activation_bytes(BATCH, SEQ, D_MODEL, HEADS, cp, 8,
                                                  variant)
        if variant == "ring":
            assert mine * cp == single


class _Recorder:
    """A communicator that logs when the ring posts and waits for its messages."""

    def __init__(self, comm: Any, log: list[str]) -> None:
        self.comm, self.log = comm, log
        self.rank, self.world_size = comm.rank, comm.world_size

    def _logged(self, kind: str, work: Any) -> Any:
        self.log.append(kind)
        log, wait = self.log, work.wait
        work_wait = type("Logged", (), {"wait": lambda _self: (log.append("wait"), wait())})
        return work_wait()

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Any:
        return self._logged("send", self.comm.isend(tensor, dst, tag))

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Any:
        return self._logged("recv", self.comm.irecv(tensor, src, tag))


def ring_event_order(comm: Any) -> list[str]:
    log: list[str] = []
    attend = ring_module._attend

    def logged_attend(*args: Any) -> Any:
        log.append("attend")
        return attend(*args)

    ring_module._attend = logged_attend  # type: ignore[assignment]
    try:
        q, k, v = torch.randn(3, 1, 2, 4, 3, dtype=torch.float64).unbind(0)
        ring_module.ring_attention(q, k, v, _Recorder(comm, log))  # type: ignore[arg-type]
    finally:
        ring_module._attend = attend  # type: ignore[assignment]
    return log


def test_ring_overlaps_the_next_transfer_with_the_current_attention(pools):
    for rank, log in enumerate(pools(3).run(ring_event_order)):
        # steps 0 and 1 post the next block's exchange, attend, then wait; step 2 attends
        assert log == ["send", "recv", "attend", "wait", "wait"] * 2 + ["attend"], rank


def loss_on_a_fresh_group(comm: Any) -> float:
    """One step of ring attention on a group made now: no pair of it has met yet, so the
    ring's first contacts (every rank first sending to its right) would form a cycle that
    NCCL's lazily created pairs cannot get out of, unless the ring connects first."""
    group = comm.new_group(list(range(comm.world_size)))
    try:
        model = apply_context_parallel(make_model(), group, "ring")
        x, y = (split_sequence(t, group.rank, group.world_size) for t in batches(1)[0])
        loss = model.loss(model(x), y)
        loss.backward()
        return loss.item()
    finally:
        group.close()


@pytest.mark.nccl_rules
def test_ring_connects_a_fresh_group_before_its_first_exchange(pools):
    (expected, _, _) = single_process("sgd")
    assert sum(pools(3).run(loss_on_a_fresh_group)) == pytest.approx(expected[0], rel=1e-12)


def train_cp_tp(comm: Any, variant: str, sequence_parallel: bool) -> dict[str, Any]:
    """cp = 2 × tp = 2 on four ranks: the tensor-parallel shard over a context-parallel
    group, plain SGD; its losses and the unsplit parameters after the steps."""
    from disttrain.parallel.mesh import MeshShape, build_mesh
    from disttrain.parallel.tensor import apply_tensor_parallel, full_state_dict

    mesh = build_mesh(comm, MeshShape(cp=2, tp=2))
    shard = apply_tensor_parallel(make_model(TP_HEADS), mesh.tp, sequence_parallel,
                                  algorithm="ring")
    model = apply_context_parallel(shard, mesh.cp, variant, algorithm="ring",
                                   all_to_all_algorithm="naive")
    opt = optimizer("sgd", model.parameters())
    mesh.cp.stats.reset()
    losses = []
    for x, y in batches():
        x, y = (split_sequence(t, mesh.cp_rank, mesh.cp_size) for t in (x, y))
        opt.zero_grad()
        loss = model.loss(model(x), y)
        loss.backward()
        shard.reduce_sequence_parallel_grads()
        model.reduce_context_parallel_grads()
        opt.step()
        losses.append(loss.item())
    expected = bytes_sent(variant, 2, mesh.cp_rank, batch=BATCH, seq=SEQ, hidden=D_MODEL // 2,
                          n_layers=LAYERS, params=sum(p.numel() for p in shard.parameters()),
                          element_size=8, param_element_size=8)
    return {"cp_rank": mesh.cp_rank, "losses": losses, "bytes": mesh.cp.stats.bytes_sent,
            "expected_bytes": STEPS * expected, "state": full_state_dict(shard, shard.group)}


@pytest.mark.nccl_rules
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp-sp"])
@pytest.mark.parametrize("variant", ["ring", "ulysses"])
def test_context_parallel_over_tensor_parallel_shards(pools, variant, sequence_parallel):
    losses, _, state = single_process("sgd", TP_HEADS)
    results = pools(4).run(train_cp_tp, variant, sequence_parallel)
    for result in results:  # each tp rank's share is its cp rank's
        partner = next(r for r in results if r["cp_rank"] != result["cp_rank"])
        shares = [a + b for a, b in zip(result["losses"], partner["losses"])]
        assert shares == pytest.approx(losses, rel=1e-12, abs=0)
        err, name = relative_error(result["state"], state)
        assert err < 1e-9, (name, err)
        assert result["bytes"] == result["expected_bytes"]  # on the cp group: cp's alone


def gathered_logits(comm: Any, variant: str) -> float:
    """The ranks' logits joined by ``gather_sequence``, against one process's."""
    x, _ = batches(1)[0]
    model = apply_context_parallel(make_model(), comm, variant)
    with torch.no_grad():
        logits = model.gather_sequence(model(split_sequence(x, comm.rank, comm.world_size)))
        expected = make_model()(x)
    return float((logits - expected).norm() / expected.norm())


@pytest.mark.parametrize("variant", ["ring", "ulysses"])
def test_gather_sequence_joins_the_logits_in_sequence_order(pools, variant):
    assert max(pools(3).run(gathered_logits, variant)) < 1e-12
