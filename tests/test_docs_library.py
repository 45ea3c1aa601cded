"""docs/library.md runs: every ```python block marked ``<!-- snippet: NAME -->`` is executed
as the page shows it, on real ranks, and must end with the parameters of one process.

The page's ``model`` block (the user's model, data, optimizer, scheduler and loss) runs
first in every rank's namespace, then one strategy's block, with ``comm`` the rank's
Communicator (what ``disttrain.init()`` returns), in float64 (:func:`default_dtype`). The
reference is the same loop on one process (:func:`reference`, checked against the page's
own ``single`` block), clipped by torch where the strategy's block clips. Two substitutions,
each of a claim the page makes: ``ZeRO1`` for ``ZeRO2`` ("takes the same arguments"), and
``pp=1`` for ``pp=2`` on the mesh, so that 4 ranks exercise both dp × tp (2 × 2) and tp × pp
(2 × 2). The ``starting`` block runs as a user's script, in float32, under ``disttrain
launch -n 2``.

A planted fault fails here: a plan whose fc2 is column-wise (a shape error), fc1 told its
input is already in the region (``input="entered"``: embed's gradient lacks the other
rank's part, 1e-2 off), DDP or the mesh reading another replica's share, the ZeRO clipping
hook without its all-reduce (4.5e-5 off), the pipeline's loss scaled by 4 (3e-7 off: Adam
nearly cancels it, float64 does not).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "library.md"
MARKED = re.compile(r"<!-- snippet: ([\w-]+) -->\n```python\n(.*?)```", re.S)
TOLERANCE = 1e-10  # in float64 (below); the strategies sum in other orders: ~1e-15
SCRIPT_TOLERANCE = 1e-5  # the launched script, in float32: ~4e-7


def snippets() -> dict[str, str]:
    """Every marked block of the page, by name."""
    found = dict(MARKED.findall(PAGE.read_text()))
    assert len(found) == len(MARKED.findall(PAGE.read_text())), "a snippet name is repeated"
    return found


BLOCKS = snippets()


def substituted(code: str, replace: dict[str, str]) -> str:
    for old, new in replace.items():
        assert old in code, f"docs/library.md no longer shows {old!r}"
        code = code.replace(old, new)
    return code


@contextmanager
def default_dtype(dtype: torch.dtype = torch.float64) -> Iterator[None]:
    """Tensors made without a dtype (the model, the data) are ``dtype`` inside. float64
    leaves nothing for rounding to hide, not even a wrong clip under Adam, which is nearly
    blind to a gradient's scale. The pools' ranks serve other tests afterwards, so the
    default comes back."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def execute(names: list[str], namespace: dict[str, Any], blocks: dict[str, str],
            replace: dict[str, str] | None = None) -> dict[str, Any]:
    """Run the model block, then ``names``' blocks, in ``namespace`` (as one script), in
    float64."""
    with default_dtype():
        for name in ["model", *names]:
            code = substituted(blocks[name], replace or {}) if name != "model" else blocks[name]
            exec(compile(code, f"docs/library.md[{name}]", "exec"), namespace)
    return namespace


def whole(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


# ---------------------------------------------------------------- in the ranks
def run_strategy(comm: Any, names: list[str], blocks: dict[str, str],
                 replace: dict[str, str] | None) -> dict[str, torch.Tensor]:
    """One rank: the page's blocks; the state dict its block ends with (a stage's part for
    a pipeline)."""
    namespace = execute(names, {"comm": comm, "__name__": "docs_library"}, blocks, replace)
    return whole(namespace["state"])


def run_mesh(comm: Any, blocks: dict[str, str], replace: dict[str, str] | None
             ) -> dict[str, Any]:
    """One rank of the mesh block: its stage's parameters, the tp slices joined back."""
    from disttrain.parallel.tensor import full_state_dict

    namespace = execute(["mesh"], {"comm": comm, "__name__": "docs_library"}, blocks,
                        replace)
    pipe, tp, mesh = namespace["pipe"], namespace["tp"], namespace["mesh"]
    return {"state": full_state_dict(pipe.named_module(), tp.group),
            "shape": (mesh.dp_size, mesh.tp_size, mesh.pp_size)}


# ---------------------------------------------------------------- one process
def reference(clip: float | None = None, dtype: torch.dtype = torch.float64
              ) -> dict[str, torch.Tensor]:
    """The page's one-process loop, clipped to ``clip`` as torch clips when given."""
    ns: dict[str, Any] = {"__name__": "docs_library"}
    clipped = 0
    with default_dtype(dtype):
        exec(compile(BLOCKS["model"], "docs/library.md[model]", "exec"), ns)
        torch.manual_seed(0)
        model = ns["ResidualMLP"]()
        optimizer = ns["make_optimizer"](model.parameters())
        scheduler = ns["make_scheduler"](optimizer)
        for x, y in ns["batches"]():
            optimizer.zero_grad()
            ns["loss_fn"](model(x), y).backward()
            if clip is not None:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                clipped += float(norm) > clip
            optimizer.step()
            scheduler.step()
    assert clip is None or clipped, f"no step's norm exceeded {clip}: clipping untested"
    return whole(model.state_dict())


def assert_equal_to(expected: dict[str, torch.Tensor], *parts: dict[str, torch.Tensor],
                    complete: bool = True, tolerance: float = TOLERANCE) -> None:
    """Every key of every part equals the reference; together they hold all of it."""
    seen: set[str] = set()
    for part in parts:
        assert set(part) <= set(expected), sorted(set(part) - set(expected))
        for key, value in part.items():
            assert value.shape == expected[key].shape, (key, value.shape)
            error = float((value - expected[key]).abs().max())
            assert value.dtype == expected[key].dtype, (key, value.dtype)
            assert error < tolerance, f"{key}: differs from one process by {error:.3g}"
        seen |= set(part)
    if complete:
        assert seen == set(expected), sorted(set(expected) - seen)


@pytest.fixture(scope="module")
def one_process() -> dict[str, torch.Tensor]:
    return reference()


def test_the_page_marks_every_python_block():
    """An unmarked block would go untested."""
    text = PAGE.read_text()
    assert text.count("```python") == len(BLOCKS)
    assert set(BLOCKS) == {"starting", "model", "single", "ddp", "zero2", "zero3",
                           "zero-clip", "pipeline", "tp", "mesh"}


def test_the_one_process_loop_is_the_reference(one_process):
    ns = execute(["single"], {"__name__": "docs_library"}, BLOCKS)
    assert_equal_to(one_process, whole(ns["state"]))
    initial = ns["ResidualMLP"]()  # the loop moved the parameters (else any no-op passes)
    moved = (initial.head.weight.detach() - one_process["head.weight"]).abs().max()
    assert float(moved) > 1e-3


def test_data_parallel_with_clipping_equals_one_process(pools):
    expected = reference(clip=1.0)
    for state in pools(2).run(run_strategy, ["ddp"], BLOCKS, None):
        assert_equal_to(expected, state)


def with_clipping(blocks: dict[str, str], name: str) -> dict[str, str]:
    """``name``'s block with the page's clipping hook registered before its loop."""
    loop = blocks[name].index("for x, y in")
    return {**blocks, name: blocks[name][:loop] + blocks["zero-clip"] + blocks[name][loop:]}


@pytest.mark.parametrize(("name", "replace", "clip"), [
    ("zero2", {"ZeRO2": "ZeRO1"}, 1.0),
    ("zero2", None, None),
    ("zero2", None, 1.0),
    ("zero3", None, None),
    ("zero3", None, 1.0),
], ids=["zero1-clip", "zero2", "zero2-clip", "zero3", "zero3-clip"])
def test_zero_equals_one_process(pools, name, replace, clip):
    blocks = BLOCKS if clip is None else with_clipping(BLOCKS, name)
    expected = reference(clip=clip)
    for state in pools(2).run(run_strategy, [name], blocks, replace):
        assert_equal_to(expected, state)


def test_the_pipeline_equals_one_process_and_names_its_stages(pools, one_process):
    first, last = pools(2).run(run_strategy, ["pipeline"], BLOCKS, None)
    assert "embed.weight" in first and "blocks.1.fc2.bias" in first
    assert "blocks.2.fc1.weight" in last and "head.weight" in last
    assert not set(first) & set(last)
    assert_equal_to(one_process, first, last)


def test_tensor_parallelism_by_plan_equals_one_process(pools, one_process):
    for state in pools(2).run(run_strategy, ["tp"], BLOCKS, None):
        assert_equal_to(one_process, state)


@pytest.mark.parametrize("replace", [None, {"pp=2": "pp=1"}], ids=["tp2-pp2", "dp2-tp2"])
def test_the_mesh_equals_one_process(pools, one_process, replace):
    results = pools(4).run(run_mesh, BLOCKS, replace)
    assert {r["shape"] for r in results} == {(1, 2, 2) if replace is None else (2, 2, 1)}
    assert_equal_to(one_process, *(r["state"] for r in results))


# ---------------------------------------------------------------- what the prose claims
class StandIn:
    """Enough of a communicator to build a shard (building one calls no collective)."""

    def __init__(self, world_size: int) -> None:
        self.rank, self.world_size = 0, world_size


@pytest.mark.parametrize(("plan", "ranks", "words"), [
    ({"block.*.fc1": "ColumnWise()"}, 2, ["'block.*.fc1' matches no module of ResidualMLP"]),
    ({"blocks.*.fc1": "ColumnWise()", "blocks.*.fc2": "RowWise()"}, 3,
     ["blocks.0.fc1", "128 output features", "over 3 tensor-parallel ranks"]),
])
def test_a_plan_that_does_not_fit_is_one_line_naming_the_module(plan, ranks, words):
    from disttrain.parallel.tensor import ColumnWise, RowWise, parallelize

    styles = {"ColumnWise()": ColumnWise(), "RowWise()": RowWise()}
    ns = execute([], {"__name__": "docs_library"}, BLOCKS)
    with pytest.raises(ValueError) as info:
        parallelize(ns["ResidualMLP"](), StandIn(ranks), {k: styles[v] for k, v in plan.items()})
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_the_mesh_on_8_ranks_is_laid_out_as_the_page_says():
    from disttrain.parallel.mesh import MeshShape

    shape = MeshShape.infer(8, tp=2, pp=2)
    assert shape == MeshShape(dp=2, tp=2, pp=2)
    assert shape.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [shape.coords(r).pp_rank for r in range(4)] == [0, 0, 1, 1]
    assert [shape.coords(r).dp_rank for r in range(8)] == [0] * 4 + [1] * 4


# ---------------------------------------------------------------- the whole script
def test_the_script_runs_under_disttrain_launch(tmp_path):
    """``starting`` with the model and the DDP loop in place of its ``...``, as a user's
    train.py, on 2 ranks started by ``disttrain launch``."""
    body = BLOCKS["model"] + BLOCKS["ddp"] + (
        f"torch.save(state, {str(tmp_path)!r} + f'/rank{{comm.rank}}.pt')\n")
    script = substituted(BLOCKS["starting"], {"...": body + "#"})
    (tmp_path / "train.py").write_text(script)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-m", "disttrain", "launch", "-n", "2",
                           str(tmp_path / "train.py")], capture_output=True, text=True,
                          timeout=180, env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    expected = reference(clip=1.0, dtype=torch.float32)  # the script as a user runs it
    for rank in range(2):
        state = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert_equal_to(expected, state, tolerance=SCRIPT_TOLERANCE)
