"""The GPU paths that a CPU can check: NCCL's watchdog against disttrain's timeouts, a
collective's stream fence, one GPU per NCCL rank, the named GPU made current, torch's
meshes on the module's device, and the Python floor."""

from __future__ import annotations

import ast
import logging
import sys
import types
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from torch import nn

from disttrain.comm import watchdog
from disttrain.comm.context import longest_wait_s
from disttrain.comm.staging import on_current_stream
from disttrain.comm.work import CollectiveWork, ProgressThread
from disttrain.launch.join import InitError, check_gpus_for_nccl
from disttrain.train import device as devmod

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- NCCL's watchdog
@pytest.mark.parametrize("timeout_s", [1.0, 20.0, 300.0])
def test_the_watchdog_acts_only_after_disttrain_named_the_late_rank(timeout_s):
    group = watchdog.group_timeout_s("nccl", timeout_s)
    assert group >= longest_wait_s(timeout_s) + watchdog.MARGIN_S  # our error comes first
    assert watchdog.group_timeout_s("gloo", timeout_s) == timeout_s  # no watchdog on Gloo


def test_nccl_error_handling_cleans_up_without_tearing_the_process_down(caplog):
    env: dict[str, str] = {}
    watchdog.apply("nccl", env)
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    watchdog.apply("gloo", gloo := {})
    assert gloo == {}
    mine = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    watchdog.apply("nccl", mine)
    assert mine == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}  # the user's choice is kept
    tearing = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    with caplog.at_level(logging.WARNING):
        watchdog.apply("nccl", tearing)
    assert tearing["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert "SIGABRT" in caplog.text


def test_groups_made_by_init_and_new_group_follow_the_policy():
    """The policy is applied where the groups are made, not only documented."""
    rendezvous = (ROOT / "disttrain/launch/rendezvous.py").read_text()
    assert "watchdog.apply(backend, os.environ)" in rendezvous
    assert "watchdog.group_timeout_s(backend, op_timeout_s)" in rendezvous
    transport = (ROOT / "disttrain/comm/transports/torch_p2p.py").read_text()
    assert "watchdog.group_timeout_s(backend, self.timeout_s)" in transport


# ---------------------------------------------------------------- stream fences
class _FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)


class _FakeEvent:
    def __init__(self) -> None:
        self.stream: _FakeStream | None = None

    def record(self, stream: _FakeStream) -> None:
        self.stream = stream


def test_waiting_on_another_stream_orders_it_after_the_collectives_last_kernels(monkeypatch):
    """An async collective captured on stream A, waited for while stream B is current: B
    must wait for an event recorded on A after the task (the ``avg`` division and the
    algorithms' closing copies run there), not only the host for the task's return."""
    side, default = _FakeStream("side"), _FakeStream("default")
    current = [side]
    fake = types.SimpleNamespace(
        current_stream=lambda: current[0], Event=_FakeEvent,
        stream=lambda s: types.SimpleNamespace(__enter__=lambda *a: None,
                                               __exit__=lambda *a: None))

    class _Ctx:
        def __init__(self, stream: _FakeStream) -> None:
            self.stream = stream

        def __enter__(self) -> None:
            current.insert(0, self.stream)

        def __exit__(self, *exc: object) -> None:
            current.pop(0)

    fake.stream = _Ctx
    monkeypatch.setattr(torch, "cuda", fake)
    ran_on: list[str] = []
    task, fence = on_current_stream(lambda: ran_on.append(current[0].name))
    future: Future[None] = Future()
    task()  # the progress thread runs it, on the stream captured at the call
    future.set_result(None)
    current[0] = default  # the caller now waits with the default stream current
    CollectiveWork(future, "all_reduce #1 (ring)", ProgressThread("t"), 5.0,
                   fence=fence).wait()
    assert ran_on == ["side"]
    assert isinstance(fence.event, _FakeEvent) and fence.event.stream is side
    assert default.waited == [fence.event]  # ordered after the side stream's kernels


# ---------------------------------------------------------------- devices and GPUs
def test_nccl_refuses_ranks_that_would_share_a_gpu():
    check_gpus_for_nccl(2, 2, {})  # one each
    check_gpus_for_nccl(4, 1, {"CUDA_VISIBLE_DEVICES": "3"})  # each rank sees its own GPU
    with pytest.raises(InitError, match="4 ranks on 2 GPU") as exc:
        check_gpus_for_nccl(4, 2, {})
    assert "backend='gloo'" in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(InitError, match="finds none"):
        check_gpus_for_nccl(1, 0, {})


def test_a_named_gpu_becomes_the_current_device_and_nccl_refuses_sharing_it(monkeypatch):
    chosen: list[object] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    devmod.select_local_gpu("cuda:1", local_rank=0)
    assert chosen == [torch.device("cuda:1")]  # the model's GPU is the current one
    devmod.select_local_gpu("cuda", local_rank=1)
    assert chosen[-1] == 1
    with pytest.raises(ValueError, match="all 2 ranks on one GPU"):
        devmod.local_backend("nccl", "cuda:1", "torch", 2)
    assert devmod.local_backend("gloo", "cuda:1", "torch", 2) == "gloo"


def test_torch_meshes_follow_the_module_and_refuse_a_backend_that_cannot_move_it():
    from disttrain.baselines.torch_data_parallel import mesh_device_type

    comm = types.SimpleNamespace(transport=types.SimpleNamespace(device_type="cpu"))
    on_cpu = types.SimpleNamespace(module=nn.Linear(2, 2))
    assert mesh_device_type(on_cpu, comm, "torch-fsdp") == "cpu"  # type: ignore[arg-type]
    elsewhere = types.SimpleNamespace(module=nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match="torch-fsdp") as exc:
        mesh_device_type(elsewhere, comm, "torch-fsdp")  # type: ignore[arg-type]
    assert "meta tensors" in str(exc.value) and "\n" not in str(exc.value)


# ---------------------------------------------------------------- Python floor
# standard modules added after the oldest Python that pyproject admits (3.10): importing one
# at module level without a fallback stops `disttrain` from starting there
NEWER_STDLIB = {"tomllib": (3, 11), "wsgiref.types": (3, 11)}


def _floor() -> tuple[int, int]:
    text = (ROOT / "pyproject.toml").read_text()
    line = next(x for x in text.splitlines() if x.startswith("requires-python"))
    major, minor = line.split(">=")[1].strip().strip('"').split(".")[:2]
    return int(major), int(minor)


def _guarded(tree: ast.Module, node: ast.AST) -> bool:
    """Whether ``node`` sits in a ``try`` that catches ImportError (or a version check)."""
    for parent in ast.walk(tree):
        if isinstance(parent, ast.Try) and node in ast.walk(parent) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError",
                                                               "ModuleNotFoundError")
                for h in parent.handlers):
            return True
        if isinstance(parent, ast.If) and "version_info" in ast.unparse(parent.test) and (
                node in ast.walk(parent)):
            return True
    return False


def test_no_module_imports_a_standard_module_newer_than_the_python_floor():
    floor = _floor()
    offenders = []
    for path in sorted((ROOT / "disttrain").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                since = NEWER_STDLIB.get(name)
                if since and since > floor and not _guarded(tree, node):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert not offenders, f"needs Python {offenders}; guard it or raise requires-python"
    assert sys.version_info[:2] >= floor
