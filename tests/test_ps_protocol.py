"""Bad messages on real ranks: a worker sends malformed, oversized, mis-addressed and
out-of-order requests before and during training; the server answers each with its error
status, logs it, and goes on serving both workers, whose training still matches the
single-process reference exactly."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from disttrain.comm import Communicator
from disttrain.parallel.parameter_server.channel import seal
from disttrain.parallel.parameter_server.protocol import (
    END_CLOCK,
    MAGIC,
    TAG_REPLY,
    TAG_REQUEST,
    TAG_REQUEST_PAYLOAD,
    Header,
    Msg,
    Status,
    empty_header,
)
from tests.ps_cases import CLICKS, ps_train, reference

SERVER, BAD_WORKER, OTHER_WORKER = 2, 0, 1  # 1 server + 2 workers: workers come first
F64, F32, I64 = 2, 1, 5  # dtype codes
USERS, MLP_WEIGHT = 0, 2  # tensor indices in ClickModel: users.weight, …, mlp.0.weight
TOTAL = CLICKS.num_users * 8 + CLICKS.num_items * 8 + 16 * 16 + 16 + 16 + 1


def raw_request(comm: Communicator, header: Header, payloads: tuple[torch.Tensor, ...] = ()
                ) -> Header:
    """Send a hand-made request; follow a GRANT with ``payloads`` (each sealed for it, unless
    it is a uint8 tensor: sent as it is); return the final reply."""
    reply = empty_header()
    work = comm.irecv(reply, SERVER, TAG_REPLY)
    comm.send(header.to_tensor(), SERVER, TAG_REQUEST)
    work.wait()
    answer = Header.from_tensor(reply)
    if answer.type == Msg.GRANT and answer.status == Status.OK:
        reply = empty_header()
        work = comm.irecv(reply, SERVER, TAG_REPLY)
        for i, payload in enumerate(payloads):  # sealed, unless it is raw bytes already
            message = payload if payload.dtype == torch.uint8 else seal(payload, header.seq, i)
            comm.send(message, SERVER, TAG_REQUEST_PAYLOAD)
        work.wait()
        answer = Header.from_tensor(reply)
    assert answer.type == Msg.REPLY and answer.seq == header.seq
    return answer


def _bad_before_training() -> list[tuple[Header, tuple[torch.Tensor, ...], Status]]:
    pull = {"type": Msg.PULL, "sender": BAD_WORKER, "key": 0, "count": 4, "dtype": F64}
    rows = {"type": Msg.SPARSE_PULL, "sender": BAD_WORKER, "key": USERS, "dtype": F64}
    push_rows = {**rows, "type": Msg.SPARSE_PUSH, "count": 1}
    return [
        (Header(**pull, magic=0x1234), (), Status.BAD_MAGIC),
        (Header(**{**pull, "protocol": 7}), (), Status.BAD_VERSION),
        (Header(**{**pull, "type": 99}), (), Status.BAD_TYPE),
        (Header(**{**pull, "type": Msg.GRANT}), (), Status.BAD_TYPE),
        (Header(**{**pull, "sender": OTHER_WORKER}), (), Status.BAD_SENDER),
        (Header(**{**pull, "dtype": 99}), (), Status.BAD_DTYPE),
        (Header(**{**pull, "type": Msg.PUSH, "dtype": F32}), (), Status.BAD_DTYPE),
        (Header(**{**pull, "type": Msg.PUSH, "count": 10**12}), (), Status.TOO_LARGE),
        (Header(**{**pull, "key": TOTAL}), (), Status.UNKNOWN_KEY),
        (Header(**{**pull, "count": TOTAL + 1}), (), Status.BAD_SIZE),
        (Header(**{**pull, "type": Msg.PUSH, "key": TOTAL - 3, "count": 4}), (), Status.BAD_SIZE),
        (Header(**{**pull, "count": -5}), (), Status.BAD_SIZE),
        (Header(**{**pull, "clock": 7}), (), Status.BAD_CLOCK),
        (Header(**{**rows, "key": MLP_WEIGHT, "count": 1}), (), Status.UNKNOWN_KEY),
        (Header(**{**rows, "count": CLICKS.num_users + 1}), (), Status.BAD_SIZE),
        (Header(**{**rows, "count": 2}), (torch.tensor([5, 3]),), Status.BAD_ROWS),
        (Header(**push_rows), (torch.tensor([10**6]), torch.zeros(8, dtype=torch.float64)),
         Status.BAD_ROWS),
        (Header(Msg.CLOCK, BAD_WORKER, version=10**6), (), Status.BAD_CLOCK),
        (Header(**{**pull, "type": Msg.PUSH, "extra": END_CLOCK, "version": 10**6}), (),
         Status.BAD_CLOCK),
        (Header(Msg.HELLO, BAD_WORKER, key=12345), (), Status.CONFIG_MISMATCH),
        (Header(Msg.DONE, BAD_WORKER, count=5), (), Status.BAD_SIZE),  # one flag per worker
    ]


def send_bad_messages(comm: Communicator, worker: int, clock: int) -> list[int]:
    """The hook of the bad worker: a battery before training, two more at clock 2."""
    if worker != 0:
        return []
    if clock == -1:
        cases = _bad_before_training()
    elif clock == 2:
        stale = Header(Msg.PULL, BAD_WORKER, key=0, count=4, dtype=F64, clock=1)
        rows = Header(Msg.SPARSE_PULL, BAD_WORKER, key=USERS, count=1, dtype=F64, clock=2)
        cases = [(stale, (), Status.BAD_CLOCK), (rows, (torch.tensor([-1]),), Status.BAD_ROWS)]
    else:
        return []
    statuses = []
    for seq, (header, payloads, _) in enumerate(cases, start=1000 + 100 * clock):
        fields = {k: getattr(header, k) for k in header.__dataclass_fields__}
        statuses.append(raw_request(comm, Header(**{**fields, "seq": seq}), payloads).status)
    assert statuses == [expected for _, _, expected in cases], statuses
    return statuses


def test_server_rejects_bad_messages_and_keeps_serving(pools: Any) -> None:
    steps, b = 4, 8
    results = pools(3).run(ps_train, 1, steps, b, model_name="clicks", sparse=True,
                           mode="sync", hook=send_bad_messages)
    sent = [s for r in results[:SERVER] for batch in r["hook_results"] for s in batch]
    assert len(sent) == len(_bad_before_training()) + 2
    report = results[SERVER]["report"]
    assert report.rejected == {Status(s).name: n for s, n in Counter(sent).items()}
    assert report.version == steps
    expected = reference("clicks", "sgd", steps, 2 * b)
    for worker in results[:SERVER]:
        for got, want in zip(worker["params"], expected, strict=True):
            torch.testing.assert_close(got, want)


def test_magic_constant_is_what_the_docs_say() -> None:
    assert MAGIC.to_bytes(4, "big") == b"DTPS"
