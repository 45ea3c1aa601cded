"""Stage-to-stage messages: the wire format, one message per tensor once sizes are known,
sizes that change (batch size, eval between steps), and failures reported at the sizes the
neighbours expect."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from disttrain.parallel.pipeline import build_pipeline
from disttrain.parallel.pipeline.link import StageLink
from disttrain.parallel.pipeline.wire import (
    DTYPES,
    FAILED,
    HEADER_BYTES,
    OK,
    RESHAPE,
    TRAIN,
    Header,
    PipelineError,
    pack,
    view_payload,
)
from tests.dist import init_gloo, run_fresh
from tests.test_pipeline_runtime import _capture, _fresh, make_model


# ---------------------------------------------------------------- the wire format, no processes
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0, 3), (2, 3, 5), (1, 1, 1, 1, 1, 2)])
def test_header_and_payload_round_trip(dtype, shape):
    n = torch.Size(shape).numel()
    dims = tuple(reversed(range(len(shape))))
    # built reversed and permuted back: a non-contiguous tensor (no copy needed to send it)
    tensor = (torch.arange(n) % 3).to(dtype).reshape(shape[::-1]).permute(dims)
    header = Header(OK, 7, 1, 3, 4, 0.125, dtype, tuple(shape))
    message = pack(header, tensor, header.nbytes)
    assert message.numel() == HEADER_BYTES + n * tensor.element_size()
    got = Header.unpack(message)
    assert got == header
    assert torch.equal(view_payload(message, HEADER_BYTES, got), tensor)


def test_a_malformed_header_is_an_error():
    with pytest.raises(PipelineError, match="malformed pipeline header"):
        Header.unpack(torch.zeros(HEADER_BYTES, dtype=torch.uint8))


@pytest.mark.parametrize("field", [{"status": 7}, {"mode": 2}, {"mode": -1},
                                   {"shape": (2, -3)}, {"shape": (-1, -4)}])
def test_a_header_with_unknown_fields_or_negative_sizes_is_malformed(field):
    # packed as a (buggy or foreign) sender would; -1 × -4 even makes a positive size
    header = Header(**{**Header(OK, 1, 0, 0, 2, 0.0, torch.float32, (2, 3)).__dict__, **field})
    buffer = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    header.pack_into(buffer)
    with pytest.raises(PipelineError, match="malformed pipeline header"):
        Header.unpack(buffer)


class _TwoRanks:
    world_size, global_ranks, device = 2, [4, 5], torch.device("cpu")
    transport = SimpleNamespace(in_order=False, name="fake")  # channels: tags of this communicator


@pytest.mark.parametrize("failed", [-1, 2, 99])
def test_a_failure_notice_naming_no_stage_is_an_error(failed):
    link = StageLink(_TwoRanks(), 1)  # type: ignore[arg-type]  # no messages: _check only
    notice = Header(FAILED, 0, 0, failed, 0, 0.0, torch.int64, (0,))
    with pytest.raises(PipelineError, match=f"naming stage {failed} of 2") as exc:
        link._check(notice, 0, "x", (1, 0, 0))
    assert "stage 1 (rank 5)" in str(exc.value) and "stage 0 (rank 4)" in str(exc.value)
    # a stage that exists is reported as failed
    with pytest.raises(PipelineError, match=r"stage 0 \(rank 4\) failed"):
        link._check(replace(notice, microbatch=0), 0, "x", (1, 0, 0))


class _RefusingComm:
    """Three stages' communicator, seen from stage 1, on which Gloo refuses every post
    (the connections to both neighbours are closed)."""

    world_size, global_ranks, device = 3, [4, 5, 6], torch.device("cpu")
    transport = SimpleNamespace(in_order=False, name="fake")  # channels: tags of this communicator

    def __init__(self) -> None:
        self.posts: list[int] = []

    def isend(self, tensor, peer, tag=0, **_):  # type: ignore[no-untyped-def]
        from disttrain.comm.errors import PeerFailedError

        self.posts.append(peer)
        raise PeerFailedError(f"send #1 (p2p) on rank 1: a connection broke while starting "
                              f"to send to rank {peer}", op="send", seq=1, peer=peer)

    irecv = isend


def test_a_refused_post_names_both_stages_and_every_neighbour_is_still_told():
    from disttrain.parallel.pipeline.link import Direction

    comm = _RefusingComm()
    link = StageLink(comm, 1)  # type: ignore[arg-type]
    with pytest.raises(PipelineError) as info:  # posting the receive of an activation
        link.begin(0, {Direction.ACTIVATION: 1, Direction.GRADIENT: 1},
                   {Direction.ACTIVATION: 1})
    assert ("stage 1 (rank 5) could not wait for the next activation from stage 0 (rank 4)"
            in str(info.value)), info.value
    assert "starting to send to rank 0" in str(info.value)
    link = StageLink(comm, 1)  # type: ignore[arg-type]
    link.begin(0, {Direction.ACTIVATION: 1, Direction.GRADIENT: 1}, {})
    with pytest.raises(PipelineError, match=r"stage 1 \(rank 5\) could not send .* to stage 2 "
                                            r"\(rank 6\)"):
        link.send(Direction.ACTIVATION, torch.ones(2), call=1, mode=0, microbatch=0, rows=2)
    comm.posts.clear()
    link.report_failure(RuntimeError("this stage failed"))
    assert sorted(comm.posts) == [0, 2]  # one refusal does not keep the other one untold


# ---------------------------------------------------------------- on real ranks
def _messages(comms) -> tuple[int, int]:
    sent = [c.stats.snapshot().get("send", {}) for c in comms]
    return sum(s.get("msgs_sent", 0) for s in sent), sum(s.get("bytes_sent", 0) for s in sent)


def count_messages(comm) -> list[tuple[int, int]]:
    """Messages and bytes this rank sends in each of 3 steps of GPipe, m = 4."""
    comm = _fresh(comm)
    pipe = build_pipeline(make_model(), comm, schedule="gpipe", microbatches=4)
    x, y = torch.randn(12, 6, dtype=torch.float64), torch.randint(0, 4, (12,))
    per_step = []
    for _ in range(3):
        before = _messages(pipe.link.communicators())
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                        F.cross_entropy)
        after = _messages(pipe.link.communicators())
        per_step.append((after[0] - before[0], after[1] - before[1]))
    return per_step


@pytest.mark.nccl_rules
def test_one_message_per_tensor_once_sizes_are_known(pools):
    for per_step in pools(2).run(count_messages):
        (first, first_bytes), *later = per_step
        assert first == 8  # a header in the size the receiver expects, then the payload
        assert later == [(4, first_bytes)] * 2  # one message each, the same bytes


def rogue_messages(comm, longer: bool) -> list[str]:
    """Stage 0 sends stage 1 an activation, then messages that end short of (``longer``: go
    on past) what stage 1 posted: a whole message off by 64 bytes once sizes are known, and,
    after a ``RESHAPE`` notice, a payload off by 8 bytes. Stage 1 says what it received
    each time, and the bytes its communicator counted for the first (whole) activation."""
    from disttrain.parallel.pipeline.link import Direction

    comm = _fresh(comm)
    link = StageLink(comm, comm.rank)
    tensor = torch.arange(64, dtype=torch.float32).reshape(4, 16)  # 256 payload bytes
    calls = [(tensor, None), (tensor, 64), (tensor[:2], 8)]  # (what, bytes off) per call
    results = []
    for call, (what, off) in enumerate(calls):
        if comm.rank == 1:
            link.begin(TRAIN, {}, {Direction.ACTIVATION: 1})
            results.append(_capture(lambda call=call: link.recv(
                Direction.ACTIVATION, call=call, mode=TRAIN, microbatch=0)))
            if call == 0:
                results.append(f"counted {comm.stats.bytes_recv}")
            continue
        link.begin(TRAIN, {Direction.ACTIVATION: 1}, {})
        if off is None:
            link.send(Direction.ACTIVATION, what, call=call, mode=TRAIN, microbatch=0, rows=4)
        else:  # what a sender of the wrong size would put on the channel
            chan = link._channel(Direction.ACTIVATION, TRAIN, sending=True)
            header = Header(OK, call, TRAIN, 0, 4, 0.0, what.dtype, tuple(what.shape))
            expected = link._out[Direction.ACTIVATION].expected(0)
            if header.nbytes == expected:
                messages = [pack(header, what, expected)]
            else:
                messages = [pack(replace(header, status=RESHAPE), None, expected),
                            what.reshape(-1).view(torch.uint8)]
            last = messages[-1]
            messages[-1] = (torch.cat([last, torch.full((off,), 0x5A, dtype=torch.uint8)])
                            if longer else last[:-off])
            for message in messages:
                chan[0].isend(message, chan[2], chan[1]).wait()
    return results


@pytest.mark.parametrize("longer", [False, True], ids=["short", "long"])
def test_a_message_of_the_wrong_length_is_refused_not_misread(pools, longer):
    """Gloo fills a receive with a shorter message without saying so (the rest of the
    buffer would be read as activations) and aborts the process on a longer one. A
    header-carrying message and a payload sent alone after ``RESHAPE`` are each refused,
    naming both stages; a longer one lands in room past the buffer (not counted as
    received: the byte counts are the messages')."""
    first, counted, wrong, wrong_payload = pools(2).run(rogue_messages, longer)[1]
    assert first == "no error"
    assert counted == f"counted {HEADER_BYTES + 256}"  # the notice, then the payload alone
    how = "longer than" if longer else "shorter than"
    for result, posted in ((wrong, HEADER_BYTES + 256), (wrong_payload, 128)):
        assert result.startswith("PipelineError: stage 1 (rank 1) received the activation of "
                                 "micro-batch 0"), result
        assert f"from stage 0 (rank 0) {how} the {posted} bytes posted" in result


def reference_with_evals(data, evals) -> tuple[list[float], list[torch.Tensor], dict]:
    """Single-process: a step on each batch of ``data`` followed by an evaluation of the
    matching batch of ``evals``."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, outputs = [], []
    for (x, y), inputs in zip(data, evals, strict=True):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        with torch.no_grad():
            outputs.append(model(inputs))
    return losses, outputs, {n: p.detach().clone() for n, p in model.named_parameters()}


def changing_sizes(comm, schedule: str) -> None:
    """Batches of 12, 9 (uneven micro-batches), 12 and 5 rows, each followed by an
    evaluation of another size: every size change is announced, nothing is misread."""
    gen = torch.Generator().manual_seed(3)
    data = [(torch.randn(rows, 6, generator=gen, dtype=torch.float64),
             torch.randint(0, 4, (rows,), generator=gen)) for rows in (12, 9, 12, 5)]
    evals = [torch.randn(rows, 6, generator=gen, dtype=torch.float64) for rows in (7, 4, 7, 16)]
    losses, outputs, params = reference_with_evals(data, evals)
    pipe = build_pipeline(make_model(), comm, schedule=schedule, microbatches=4)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    for step, ((x, y), inputs) in enumerate(zip(data, evals, strict=True)):
        opt.zero_grad()
        loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                               F.cross_entropy)
        assert loss == pytest.approx(losses[step], rel=1e-12)
        opt.step()
        out = pipe.eval_forward(inputs if pipe.is_first else None)
        if pipe.is_last:
            torch.testing.assert_close(out, outputs[step])
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.detach(), params[name], msg=f"param {name}")


@pytest.mark.nccl_rules
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_changing_batch_sizes_and_evaluations_match_single_process(pools, schedule):
    pools(3).run(changing_sizes, schedule)


class _FailsOnCall(nn.Module):
    """Identity that raises on its ``when``-th forward."""

    def __init__(self, when: int) -> None:
        super().__init__()
        self.when, self.calls = when, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.when:
            raise RuntimeError("forward exploded")
        return x


def failure_after_sizes_are_known(comm) -> list[str]:
    """Stage 1 of 3 fails in the first forward of the third step, when both neighbours
    expect payload-sized messages from it: the notices must fit those receives."""
    comm = _fresh(comm)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), _FailsOnCall(when=7),
                          nn.Tanh(), nn.Linear(8, 3))
    pipe = build_pipeline(model, comm, schedule="gpipe", microbatches=3, partition=[2, 2, 2])
    x, y = torch.randn(6, 6), torch.randint(0, 3, (6,))
    return [_capture(lambda: pipe.train_step(x, y, F.cross_entropy)) for _ in range(3)]


@pytest.mark.nccl_rules
def test_a_failure_after_sizes_are_known_reaches_both_neighbours(pools):
    per_rank = pools(3).run(failure_after_sizes_are_known)
    for rank, (first, second, third) in enumerate(per_rank):
        assert first == second == "no error", (rank, first, second)
        if rank == 1:
            assert third == "RuntimeError: forward exploded"
        else:
            assert third.startswith("StageFailedError"), (rank, third)
            assert "stage 1 (rank 1) failed" in third


MISMATCH_TIMEOUT_S = 3.0


def train_against_eval(rank: int, world_size: int, store: str) -> list[str]:
    """A step and an evaluation of 40 rows on both stages, then stage 0 evaluates again
    while stage 1 trains: stage 0's eval activations (10 rows) are larger than the train
    receives stage 1 posted (3 rows), which on a shared tag made Gloo abort stage 1."""
    comm = init_gloo(rank, world_size, store, comm_timeout_s=MISMATCH_TIMEOUT_S)
    pipe = build_pipeline(make_model(), comm, schedule="gpipe", microbatches=4)
    x, y = torch.randn(12, 6, dtype=torch.float64), torch.randint(0, 4, (12,))
    big = torch.randn(40, 6, dtype=torch.float64)
    first = pipe.is_first

    def train() -> None:
        pipe.train_step(x if first else None, y if pipe.is_last else None, F.cross_entropy)

    def evaluate() -> None:
        pipe.eval_forward(big if first else None)

    return [_capture(train), _capture(evaluate), _capture(evaluate if first else train)]


def test_a_stage_evaluating_while_its_neighbour_trains_times_out_naming_both():
    per_rank = run_fresh(train_against_eval, 2)
    for rank, (trained, evaluated, mismatched) in enumerate(per_rank):
        assert trained == evaluated == "no error", (rank, trained, evaluated)
        assert mismatched.startswith("PipelineError"), (rank, mismatched)
        assert "stage 0 (rank 0)" in mismatched and "stage 1 (rank 1)" in mismatched, (
            rank, mismatched)
