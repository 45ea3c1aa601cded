"""A rogue worker's payloads: one shorter than granted (Gloo completes such a receive without
saying so), one longer (Gloo aborts a receiver sent more than it posted), one sealed for an
earlier request. Each is refused with BAD_PAYLOAD and never applied; the server names the
worker and, where the mode outlives a lost worker (async), drops it while the honest worker
trains to the end; in sync mode it stops and tells the honest worker who failed. Plus the
trailer's rules without processes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from disttrain.comm import Communicator
from disttrain.parallel.parameter_server import (
    PSConfig,
    PSWorker,
    assign_roles,
    build_parameter_server,
)
from disttrain.parallel.parameter_server.channel import (
    TRAILER_BYTES,
    receive_buffer,
    seal,
    unseal,
)
from disttrain.parallel.parameter_server.protocol import Header, Msg, ProtocolError, Status
from tests.ps_cases import (
    COUNTER_SLOTS,
    TIMEOUT_S,
    catching,
    counter_batch,
    loss_of,
    make_counter,
    plain_sgd,
)
from tests.test_ps_protocol import raw_request

ROGUE, HONEST, SERVER = 0, 1, 2  # 1 server + 2 workers: workers come first
F64 = 2  # dtype code
STEPS = 3


def rogue_payload(case: str, seq: int) -> torch.Tensor:
    """What the rogue sends after the GRANT of a PUSH of every slot (request ``seq``)."""
    if case == "short":
        return torch.zeros(1, dtype=torch.float64)  # one zero where 64 were granted
    if case == "long":
        return seal(torch.zeros(COUNTER_SLOTS + 8, dtype=torch.float64), seq, 0)
    assert case == "stale"
    return seal(torch.ones(COUNTER_SLOTS, dtype=torch.float64), seq - 1, 0)


def rogue_run(comm: Communicator, mode: str, case: str) -> dict[str, Any]:
    roles = assign_roles(comm.world_size, 1)
    config = PSConfig(mode=mode, timeout_s=TIMEOUT_S, staleness_lr="none")
    if roles.role(comm.rank).kind == "server":
        server = build_parameter_server(comm, roles, make_counter(), plain_sgd, config)
        outcome = catching(server.serve)
        return {**outcome, "values": server.shard.param.detach().clone()}
    model = make_counter()
    if comm.rank == ROGUE:
        ps = PSWorker(comm, model, roles, config)
        seq = ps.channels[0].seq + 1
        push = Header(Msg.PUSH, ROGUE, key=0, count=COUNTER_SLOTS, dtype=F64, clock=ps.clock,
                      seq=seq)
        return {"status": raw_request(comm, push, (rogue_payload(case, seq),)).status}

    def train() -> Any:
        # the first pull is in here too: a sync server may stop before it is answered
        ps = PSWorker(comm, model, roles, config)
        for _ in range(STEPS):
            ps.pull()
            x, y = counter_batch(ps.clock, 2)
            model.zero_grad()
            loss_of("counter", model, x[HONEST:HONEST + 1], y[HONEST:HONEST + 1]).backward()
            ps.push()
        return ps.close()

    return catching(train)


@pytest.mark.parametrize("case", ["short", "long", "stale"])
def test_a_bad_payload_is_refused_and_its_worker_dropped(pools: Any, case: str) -> None:
    rogue, honest, server = pools(3).run(rogue_run, "async", case)
    assert rogue["status"] == Status.BAD_PAYLOAD, rogue
    assert honest["error"] is None, honest
    assert honest["result"].steps == STEPS and honest["result"].lost_workers == (ROGUE,)
    assert server["error"] is None, server
    reason = server["result"].lost[ROGUE]
    word = {"short": "shorter", "long": "longer", "stale": "stale"}[case]
    assert "worker 0 (rank 0) sent a bad payload" in reason and word in reason, reason
    # only the honest worker's updates were applied: slot c·W + 1 of each clock c
    values = server["values"]
    assert not values.isnan().any()
    assert values.nonzero().reshape(-1).tolist() == [2 * c + HONEST for c in range(STEPS)]


def test_in_sync_mode_a_bad_payload_stops_the_server_naming_the_worker(pools: Any) -> None:
    rogue, honest, server = pools(3).run(rogue_run, "sync", "short")
    assert rogue["status"] == Status.BAD_PAYLOAD, rogue
    assert server["error"] == "PSPayloadError", server
    assert "worker 0 (rank 0) sent a bad payload" in server["message"], server
    assert honest["error"] == "PSPeerFailedError", honest
    assert "because worker 0 (rank 0) failed" in honest["message"], honest
    assert not server["values"].any()  # nothing applied: the clock never completed


# ------------------------------------------------------------------ the trailer, no processes
def test_a_sealed_payload_unseals_to_itself() -> None:
    payload = torch.arange(5, dtype=torch.float32)
    message = seal(payload, seq=7, index=1)
    assert message.numel() == 20 + TRAILER_BYTES
    buffer = receive_buffer(20)
    buffer[:message.numel()] = message
    assert torch.equal(unseal(buffer, 20, 7, 1, torch.float32), payload)


@pytest.mark.parametrize(("arrived", "reserve", "word"), [
    (lambda: seal(torch.ones(4), 3, 0)[:10], 0, "shorter"),
    (lambda: torch.ones(4), 0, "shorter"),  # the old protocol: no trailer
    (lambda: seal(torch.ones(6), 3, 0), 1024, "longer"),
    (lambda: seal(torch.ones(4), 2, 0), 0, "stale"),
    (lambda: seal(torch.ones(4), 3, 1), 0, "sealed as payload 1"),
])
def test_a_payload_that_is_not_the_granted_one_is_refused(arrived: Any, reserve: int,
                                                           word: str) -> None:
    buffer = receive_buffer(16, reserve)
    message = arrived().view(-1).view(torch.uint8)
    assert buffer.numel() == max(reserve, 16 + TRAILER_BYTES) and not buffer.any()
    buffer[:message.numel()] = message
    with pytest.raises(ProtocolError, match=word) as err:
        unseal(buffer, 16, 3, 0, torch.float32)
    assert err.value.status == Status.BAD_PAYLOAD
