"""Parameter server, pure parts (no processes): roles, config, key partitioning, the header
protocol, clocks and staleness, the server shard's optimizer step and checkpoints."""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
import torch
from torch import nn

from disttrain.parallel.checkpoint_files import CheckpointError
from disttrain.parallel.parameter_server import (
    ClickData,
    ClickModel,
    ClockTable,
    ProtocolError,
    PSConfig,
    ServerShard,
    StalenessHistogram,
    TensorSpec,
    assign_roles,
    load_checkpoint,
    make_click_data,
    parse_straggler,
    parse_straggler_spec,
    partition,
    servers_from_env,
    specs_of,
)
from disttrain.parallel.parameter_server.config import staleness_lr_factor
from disttrain.parallel.parameter_server.partition import gather_flat, scatter_flat
from disttrain.parallel.parameter_server.protocol import (
    MAGIC,
    Header,
    Msg,
    Status,
    decode_reply,
    decode_request,
    dtype_code,
)
from disttrain.parallel.parameter_server.shard import checkpoint_path, save_checkpoint


# ---------------------------------------------------------------- roles and config
def test_roles_put_workers_first_and_servers_last() -> None:
    roles = assign_roles(5, 2)
    assert roles.worker_ranks == (0, 1, 2) and roles.server_ranks == (3, 4)
    assert [str(roles.role(r)) for r in (1, 4)] == ["worker 1 (rank 1)", "server 1 (rank 4)"]
    with pytest.raises(ValueError, match="leaves no worker"):
        assign_roles(2, 2)
    with pytest.raises(ValueError, match="world size ≥ 2"):
        assign_roles(1, 1)
    with pytest.raises(ValueError, match="not in this job"):
        roles.role(5)


def test_servers_from_env_reads_the_launcher_variable() -> None:
    assert servers_from_env({}) is None
    assert servers_from_env({"DISTTRAIN_PS_SERVERS": "2"}) == 2
    for bad in ("0", "two", "-1"):
        with pytest.raises(ValueError, match="DISTTRAIN_PS_SERVERS"):
            servers_from_env({"DISTTRAIN_PS_SERVERS": bad})


def test_straggler_flag_parses_and_rejects_nonsense() -> None:
    assert parse_straggler("3:2, 4:1.5") == {3: 2.0, 4: 1.5}
    for bad, message in [("3", "RANK:FACTOR"), ("x:2", "RANK:FACTOR"), ("3:0.5", "≥ 1"),
                         ("3:2,3:4", "twice"), ("-1:2", "≥ 0")]:
        with pytest.raises(ValueError, match=message):
            parse_straggler(bad)


def test_rotating_straggler_flag_parses_and_rejects_nonsense() -> None:
    assert parse_straggler_spec("1:2") == ({1: 2.0}, None)  # RANK:FACTOR means what it did
    assert parse_straggler_spec("1:2:5") == ({1: 2.0}, 5)
    assert parse_straggler_spec("0:3:4, 2:1.5:4") == ({0: 3.0, 2: 1.5}, 4)
    for bad, message in [("1:2:0", "≥ 1"), ("1:2:x", "RANK:FACTOR:EVERY"),
                         ("1:2:5:6", "RANK:FACTOR:EVERY"), ("1:2:2.5", "RANK:FACTOR:EVERY"),
                         ("1:2:5,3:2", "same"), ("1:2:5,3:2:4", "same"), ("1:0.5:5", "≥ 1")]:
        with pytest.raises(ValueError, match=message):
            parse_straggler_spec(bad)
    with pytest.raises(ValueError, match="parse_straggler_spec"):
        parse_straggler("1:2:5")  # the old parser must not drop EVERY silently
    with pytest.raises(ValueError, match="no straggler"):
        PSConfig(straggler_every=3)
    with pytest.raises(ValueError, match="≥ 1"):
        PSConfig(straggler={1: 2.0}, straggler_every=0)


def test_rotating_straggler_moves_to_the_next_worker_every_n_clocks() -> None:
    persistent = PSConfig(straggler={1: 2.0})
    assert [persistent.straggler_factor(r, c, 3) for r in range(3) for c in (0, 7)] == [
        1.0, 1.0, 2.0, 2.0, 1.0, 1.0]
    rotating = PSConfig(straggler={1: 2.0}, straggler_every=2)
    slow = [[c for c in range(12) if rotating.straggler_factor(r, c, 3) > 1] for r in range(3)]
    assert slow == [[4, 5, 10, 11], [0, 1, 6, 7], [2, 3, 8, 9]]
    two = PSConfig(straggler={0: 3.0, 1: 1.5}, straggler_every=1)  # never on one worker at once
    assert [[two.straggler_factor(r, c, 3) for r in range(3)] for c in range(3)] == [
        [3.0, 1.5, 1.0], [1.0, 3.0, 1.5], [1.5, 1.0, 3.0]]


def test_config_validates_and_bounds_the_timeout() -> None:
    assert PSConfig(mode="ssp", staleness=3).bound == 3
    assert PSConfig(mode="sync", staleness=3).bound == 0
    assert PSConfig(mode="async").bound is None
    cases: list[tuple[dict[str, Any], str]] = [
        ({"mode": "bsp"}, "mode"), ({"staleness": -1}, "staleness"), ({"timeout_s": 0},
        "timeout_s"), ({"sparse_params": ("a", "a")}, "distinct"), ({"straggler": {2: 0.5}},
        "≥ 1")]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            PSConfig(**kwargs)
    assert PSConfig().resolve_timeout(20.0) == pytest.approx(18.0)
    with pytest.raises(ValueError, match="below the communicator's"):
        PSConfig(timeout_s=30).resolve_timeout(20.0)


# ---------------------------------------------------------------- partitioning
SPECS = (TensorSpec("emb", (10, 4), sparse=True), TensorSpec("w", (3, 5)), TensorSpec("b", (3,)),
         TensorSpec("scalar", ()))


@pytest.mark.parametrize("servers", [1, 2, 3, 4, 7])
def test_partition_covers_every_key_once_on_row_boundaries(servers: int) -> None:
    part = partition(SPECS, servers)
    assert part.bounds[0] == 0 and part.bounds[-1] == part.total == 40 + 15 + 3 + 1
    assert list(part.bounds) == sorted(part.bounds)
    row_starts = {off + r * spec.row_size for spec, off in zip(SPECS, part.offsets)
                  for r in range(spec.rows + 1)}
    assert set(part.bounds) <= row_starts  # every cut is at a row boundary
    sizes = [part.bounds[s + 1] - part.bounds[s] for s in range(servers)]
    if servers <= 3:  # balanced within one (4-element) row either side
        assert max(sizes) - min(sizes) <= 8
    covered = sorted((seg.start, seg.length) for seg in part.segments())
    assert sum(n for _, n in covered) == part.total
    for seg in part.segments():
        assert seg.length == (seg.row_end - seg.row_start) * SPECS[seg.tensor].row_size


def test_a_large_table_is_split_across_servers() -> None:
    part = partition((TensorSpec("table", (100, 8), sparse=True), TensorSpec("bias", (4,))), 2)
    segs = part.segments(tensor=0)
    assert [(s.server, s.row_start, s.row_end) for s in segs] == [(0, 0, 50), (1, 50, 100)]
    assert part.dense_pieces(0) == [] and part.dense_pieces(1) == [(800, 4)]


def test_flat_gather_and_scatter_round_trip() -> None:
    part = partition(SPECS, 3)
    tensors = [torch.randn(s.shape) for s in SPECS]
    for s in range(3):
        lo, hi = part.server_range(s)
        flat = gather_flat(tensors, part, lo, hi - lo, torch.float32)
        expected = torch.cat([t.reshape(-1) for t in tensors])[lo:hi]
        assert torch.equal(flat, expected)
        zeros = [torch.zeros(sp.shape) for sp in SPECS]
        scatter_flat(zeros, part, lo, flat)
        assert torch.equal(torch.cat([z.reshape(-1) for z in zeros])[lo:hi], expected)


def test_specs_of_checks_sparse_names() -> None:
    model = ClickModel(5, 6, dim=2, hidden=3)
    specs = specs_of(model, ("users.weight",))
    assert [s.sparse for s in specs[:2]] == [True, False]
    with pytest.raises(ValueError, match="not trainable parameters"):
        specs_of(model, ("user.weight",))
    with pytest.raises(ValueError, match="whole rows"):
        specs_of(model, ("mlp.0.bias",))


# ---------------------------------------------------------------- protocol
def test_header_round_trip() -> None:
    h = Header(Msg.PUSH, 3, key=17, count=5, dtype=dtype_code(torch.float64), clock=2, version=9,
               seq=4)
    assert Header.from_tensor(h.to_tensor()) == h
    assert decode_request(h.to_tensor(), 3, max_elems=5) == h


@pytest.mark.parametrize(("change", "status"), [
    ({"magic": MAGIC + 1}, Status.BAD_MAGIC), ({"protocol": 1}, Status.BAD_VERSION),
    ({"type": 42}, Status.BAD_TYPE), ({"type": Msg.GRANT}, Status.BAD_TYPE),
    ({"sender": 1}, Status.BAD_SENDER), ({"dtype": 99}, Status.BAD_DTYPE),
    ({"count": -1}, Status.BAD_SIZE), ({"count": 1001}, Status.TOO_LARGE),
    ({"extra": 1}, Status.BAD_TYPE), ({"type": Msg.PUSH, "extra": 2}, Status.BAD_TYPE),
])
def test_bad_request_headers_are_rejected_with_their_status(change: dict[str, int],
                                                           status: Status) -> None:
    good = {"type": Msg.PULL, "sender": 3, "key": 0, "count": 10, "dtype": 1}
    with pytest.raises(ProtocolError) as info:
        decode_request(Header(**{**good, **change}).to_tensor(), 3, max_elems=1000)
    assert info.value.status == status


def test_replies_must_answer_the_request() -> None:
    request = Header(Msg.PULL, 2, seq=7)
    decode_reply(Header(Msg.REPLY, 0, seq=7).to_tensor(), 0, request, Msg.REPLY)
    for reply in [Header(Msg.REPLY, 0, seq=6), Header(Msg.GRANT, 0, seq=7),
                  Header(Msg.REPLY, 1, seq=7)]:
        with pytest.raises(ProtocolError, match="malformed reply"):
            decode_reply(reply.to_tensor(), 0, request, Msg.REPLY)


# ---------------------------------------------------------------- clocks and staleness
def test_sync_reads_wait_for_the_slowest_worker() -> None:
    table = ClockTable(bound=0, workers=2)
    assert table.may_read(0)
    assert table.finish(0) == [] and not table.may_read(1)  # worker 1 has not finished clock 0
    assert table.finish(1) == [0] and table.may_read(1)
    assert table.finish(1) == [] and table.leave(0) == [1]  # a worker that leaves stops blocking


def test_ssp_lets_fast_workers_run_ahead_by_the_bound() -> None:
    table = ClockTable(bound=2, workers=2, on_arrival=True)
    for clock in range(1, 4):
        assert table.finish(0) == []  # applied on arrival: no clock waits to be applied
        assert table.may_read(clock) == (clock <= 2)  # worker 1 is still at clock 0
    table.finish(1)  # worker 1 finished clock 0: worker 0 may read for clock 3 = 1 + s
    assert table.may_read(3) and not table.may_read(4)
    assert table.leave(1) == [] and table.may_read(5)  # nobody waits for a finished worker
    async_table = ClockTable(bound=None, workers=2)
    async_table.finish(0)
    assert async_table.may_read(100) and async_table.finish(0) == []


def test_only_ssp_with_a_positive_bound_applies_on_arrival() -> None:
    assert PSConfig(mode="ssp", staleness=2).on_arrival and PSConfig(mode="async").on_arrival
    assert not PSConfig(mode="ssp", staleness=0).on_arrival  # SSP(0) is BSP
    assert not PSConfig(mode="sync").on_arrival


def test_staleness_histogram() -> None:
    hist = StalenessHistogram()
    for s in (0, 0, 1, 3):
        hist.add(s)
    merged = hist.merge([StalenessHistogram({1: 2})])
    assert merged.as_dict() == {0: 2, 1: 3, 3: 1} and merged.max == 3
    assert merged.mean == pytest.approx(6 / 6) and "max 3" in str(merged)


# ---------------------------------------------------------------- the shard
def _shard(opt: str = "adam") -> tuple[ServerShard, nn.Module]:
    torch.manual_seed(0)
    model = ClickModel(6, 5, dim=3, hidden=4).double()
    part = partition(specs_of(model, ("users.weight", "items.weight")), 2)
    lo, hi = part.server_range(0)
    params = list(model.parameters())
    make = ((lambda p: torch.optim.Adam(p, lr=0.1)) if opt == "adam"
            else (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)))
    return ServerShard(part, 0, gather_flat(params, part, lo, hi - lo, torch.float64), make), model


@pytest.mark.parametrize("opt", ["adam", "sgd"])
def test_shard_update_equals_the_optimizer_on_the_averaged_gradient(opt: str) -> None:
    shard, model = _shard(opt)
    part, (lo, hi) = shard.partition, shard.partition.server_range(0)
    reference = [p.detach().clone().requires_grad_() for p in model.parameters()]
    ref_opt = (torch.optim.Adam(reference, lr=0.1) if opt == "adam"
               else torch.optim.SGD(reference, lr=0.1, momentum=0.9))
    for clock in range(3):
        grads = [[torch.randn_like(p) for p in reference] for _ in range(2)]
        for g in grads:
            shard.add_dense((clock, -1), slice(0, hi - lo),
                            gather_flat(g, part, lo, hi - lo, torch.float64))
            shard.contribute((clock, -1), pulled_version=clock)
        assert shard.apply((clock, -1)) == [0, 0]
        for p, a, b in zip(reference, *grads):
            p.grad = (a + b) / 2
        ref_opt.step()
    torch.testing.assert_close(shard.param.data,
                               gather_flat(reference, part, lo, hi - lo, torch.float64))
    assert shard.version == 3


@pytest.mark.parametrize("rule,factors", [("inverse", [1.0, 1.0, 1 / 2, 1 / 3]),
                                           ("none", [1.0, 1.0, 1.0, 1.0])])
def test_staleness_aware_learning_rate(rule: str, factors: list[float]) -> None:
    """Async updates computed on versions v, each applied at version 3: SGD moves the
    parameters by lr × factor(3 − v) × gradient, and the optimizer keeps its own rate."""
    part = partition(specs_of(nn.Linear(2, 2, bias=False), ()), 1)
    shard = ServerShard(part, 0, torch.zeros(4, dtype=torch.float64),
                        lambda p: torch.optim.SGD(p, lr=0.5), staleness_lr=rule)
    shard.version = 3
    for pulled, factor in zip([3, 2, 1, 0], factors):
        before = shard.param.data.clone()
        shard.add_dense((pulled, 0), slice(0, 4), torch.ones(4, dtype=torch.float64))
        shard.contribute((pulled, 0), pulled_version=pulled)
        assert shard.apply((pulled, 0)) == [3 - pulled]
        torch.testing.assert_close(before - shard.param.data,
                                   torch.full((4,), 0.5 * factor, dtype=torch.float64))
        shard.version = 3  # every update lands at version 3
        assert shard.optimizer.param_groups[0]["lr"] == 0.5
    assert staleness_lr_factor(rule, [0, 0]) == 1.0  # a synchronous clock is never scaled
    with pytest.raises(ValueError, match="staleness_lr"):
        PSConfig(staleness_lr="sqrt")


def test_shard_sparse_rows_and_addressing_errors() -> None:
    shard, _ = _shard()
    seg = shard.table(0)  # users.weight: rows 0..5 on server 0
    assert (seg.row_start, seg.row_end) == (0, 6)
    local = shard.check_rows(seg, torch.tensor([1, 4]))
    shard.add_rows((0, -1), seg, local, torch.ones(2, 3, dtype=torch.float64))
    assert shard._pending[(0, -1)].grad[:18].view(6, 3).sum(1).tolist() == [0, 3, 0, 0, 3, 0]
    for ids in ([4, 1], [1, 1], [6], [-1]):
        with pytest.raises(ProtocolError, match="strictly increasing"):
            shard.check_rows(seg, torch.tensor(ids))
    for key, status in [(2, Status.UNKNOWN_KEY), (99, Status.UNKNOWN_KEY)]:
        with pytest.raises(ProtocolError) as info:
            shard.table(key)
        assert info.value.status == status
    with pytest.raises(ProtocolError, match="is not on server 0"):
        shard.dense_slice(shard.end, 1)
    with pytest.raises(ProtocolError, match="do not fit"):
        shard.dense_slice(shard.start, shard.end - shard.start + 1)


def test_shard_checkpoint_round_trip(tmp_path: object) -> None:
    shard, _ = _shard()
    for clock in range(2):
        shard.add_dense((clock, -1), slice(0, 4), torch.ones(4, dtype=torch.float64))
        shard.contribute((clock, -1), clock)
        shard.apply((clock, -1))
    path = checkpoint_path(str(tmp_path), 0)
    save_checkpoint(path, shard.state_dict(clock=1))
    save_checkpoint(path, shard.state_dict(clock=2))  # replaces the first one whole
    assert sorted(os.listdir(tmp_path)) == ["ps-server-000"]
    assert sorted(os.listdir(path)) == ["manifest.json", "shard.pt"]
    fresh, _ = _shard()
    assert fresh.load_state_dict(load_checkpoint(path)) == 2
    assert fresh.version == 2 and torch.equal(fresh.param.data, shard.param.data)
    exp_avg = fresh.optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(exp_avg, shard.optimizer.state_dict()["state"][0]["exp_avg"])
    state = load_checkpoint(path)
    state["range"] = [0, 1]
    with pytest.raises(ValueError, match="does not fit"):
        fresh.load_state_dict(state)


def test_a_damaged_shard_checkpoint_is_refused_naming_the_file(tmp_path: object) -> None:
    shard, _ = _shard()
    path = checkpoint_path(str(tmp_path), 0)
    save_checkpoint(path, shard.state_dict(clock=0))
    file = os.path.join(path, "shard.pt")
    data = bytearray(open(file, "rb").read())
    data[-200] ^= 0xFF  # a flipped byte inside the tensors: torch would load it
    open(file, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=re.escape(f"{file} is damaged: its SHA-256")):
        load_checkpoint(path)
    os.unlink(os.path.join(path, "manifest.json"))
    with pytest.raises(CheckpointError, match=r"has no manifest\.json"):
        load_checkpoint(path)


# ---------------------------------------------------------------- the click model
def test_click_data_is_deterministic_and_learnable_shape() -> None:
    spec = ClickData(num_users=50, num_items=40, samples=500, seed=1)
    (x1, y1), (x2, y2) = make_click_data(spec), make_click_data(spec)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == (500, 2) and 0.2 < y1.mean().item() < 0.8
    assert int(x1[:, 0].max()) < 50 and int(x1[:, 1].max()) < 40
    counts = torch.bincount(x1[:, 0], minlength=50).sort(descending=True).values
    assert counts[:5].sum() > counts[-25:].sum()  # skewed popularity
    model = ClickModel(50, 40, dim=4, hidden=8)
    assert model(x1).shape == (500,)
    assert set(model.sparse_ids(x1)) == {"users.weight", "items.weight"}


def test_a_failed_message_names_its_peer_as_dead_or_silent() -> None:
    # a broken connection means the peer died: a mode that outlives workers may drop it; a
    # transport timeout means it is silent, which nobody may take for a death
    import threading

    from disttrain.comm import CommTimeoutError, PeerFailedError
    from disttrain.parallel.parameter_server.protocol import (
        PSPeerFailedError,
        PSTimeoutError,
        Watch,
        finish,
    )

    for error, expected in ((PeerFailedError("closed"), PSPeerFailedError),
                            (CommTimeoutError("timed out after 9s"), PSTimeoutError)):
        watch = Watch(None, threading.Event())  # type: ignore[arg-type]
        watch.error = error
        with pytest.raises(expected, match=r"worker 1 \(rank 1\)") as info:
            finish(watch, "worker 1 (rank 1)", 1, "waiting")
        assert info.value.rank == 1
