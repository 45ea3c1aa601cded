"""Staging (disttrain.comm.staging): tensors on another device than the transport's.

A CPU-only machine has no second device, so the ranks mark some CPU tensors as "foreign"
and stage them into separate CPU buffers: everything but the copy between devices runs as
on a GPU (the call runs on the stages, asynchronous calls copy back in ``wait()`` or the
first ``is_completed()`` that says True, outputs land in the caller's tensors, inputs are
left alone). The copies between a GPU and pinned memory run in scripts/gpu_check.sh.
"""

from __future__ import annotations

import time

import torch

from disttrain.comm import Communicator, staging


def _fake_device(marked: set[int], made: list[torch.Tensor]) -> None:
    def foreign(value: object, device_type: str) -> bool:
        return isinstance(value, torch.Tensor) and id(value) in marked

    def stage_for(tensor: torch.Tensor, device_type: str, copy: bool) -> torch.Tensor:
        stage = tensor.detach().clone() if copy else torch.full_like(tensor, -7.0)
        made.append(stage)
        return stage

    staging.foreign = foreign  # type: ignore[assignment]
    staging.stage_for = stage_for  # type: ignore[assignment]


def staged_calls(comm: Communicator) -> dict[str, object]:
    marked: set[int] = set()
    made: list[torch.Tensor] = []
    saved = staging.foreign, staging.stage_for
    _fake_device(marked, made)

    def mark(t: torch.Tensor) -> torch.Tensor:
        marked.add(id(t))
        return t

    r, p = comm.rank, comm.world_size
    out: dict[str, object] = {}
    try:
        t = mark(torch.full((5,), float(r + 1)))
        comm.all_reduce(t)
        out["all_reduce"] = t.tolist()
        t = mark(torch.full((5,), float(r + 1)))
        work = comm.all_reduce(t, async_op=True)
        assert work is not None
        while not work.is_completed():  # polled to completion: copied back without wait()
            time.sleep(0.001)
        out["polled"] = t.tolist()
        work.wait()
        t = mark(torch.full((3,), float(r)))
        src = torch.full((3,), float(r))
        gathered = mark(torch.zeros(3 * p))
        comm.all_gather(gathered, mark(src))
        out["all_gather"] = gathered.tolist()
        out["input_kept"] = src.tolist()
        keep = mark(torch.full((3 * p,), 5.0))
        comm.gather(keep if r != 0 else mark(torch.zeros(3 * p)), mark(torch.ones(3)), root=0)
        out["gather_off_root"] = keep.tolist()
        got = mark(torch.zeros(4))
        if r == 0:
            comm.isend(mark(torch.arange(4, dtype=torch.float32)), 1, tag=3).wait()
        elif r == 1:
            work = comm.irecv(got, 0, tag=3)
            work.wait()
        out["recv"] = got.tolist()
        out["stages"] = len(made)
    finally:
        staging.foreign, staging.stage_for = saved  # type: ignore[assignment]
    return out


def test_staged_tensors_get_their_results_and_keep_their_inputs(pools):
    per_rank = pools(2).run(staged_calls)
    for r, out in enumerate(per_rank):
        assert out["all_reduce"] == [3.0] * 5
        assert out["polled"] == [3.0] * 5
        assert out["all_gather"] == [0.0] * 3 + [1.0] * 3
        assert out["input_kept"] == [float(r)] * 3
        if r == 1:  # off the root, gather's output is left as it was, not the stage's
            assert out["gather_off_root"] == [5.0] * 6
        assert out["recv"] == ([0.0, 1.0, 2.0, 3.0] if r == 1 else [0.0] * 4)
        assert out["stages"] == 7  # every marked tensor of the calls ran on a stage


def test_foreign_is_only_the_other_kind_of_device():
    assert not staging.foreign(torch.zeros(1), "cpu")
    assert staging.foreign(torch.zeros(1), "cuda")  # a CPU tensor on an NCCL communicator
    assert not staging.foreign(torch.zeros(1, device="meta"), "cpu")  # no stage for that
    assert not staging.foreign([1, 2], "cuda")
