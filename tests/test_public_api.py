"""A public Python API that holds: every name the docs show imports, every package the docs
import from declares it in ``__all__``, and every old spelling of a moved name still works
with one DeprecationWarning (disttrain.deprecated; the record of moves is there).

The docs are read as a user reads them: ``from disttrain.x import A, B`` and ``import
disttrain.x`` lines, and every dotted ``disttrain.x.y`` a page or the README names, in code
or in prose. A page that shows a name that does not exist fails here, naming the page.
"""

from __future__ import annotations

import importlib
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import disttrain
from disttrain import deprecated
from tests.dist import COMM_TIMEOUT_S

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FROM_IMPORT = re.compile(r"^\s*from\s+(disttrain(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n#]+)",
                         re.MULTILINE)
IMPORT = re.compile(r"^\s*import\s+(disttrain(?:\.\w+)*)", re.MULTILINE)
DOTTED = re.compile(r"(?<![\w/.-])(disttrain(?:\.[A-Za-z_]\w*)+)")


def doc_references() -> dict[str, set[str]]:
    """``"module:name"`` (a from-import) or ``"dotted.path"`` → the pages that show it."""
    found: dict[str, set[str]] = {}
    for page in PAGES:
        text, name = page.read_text(), page.relative_to(ROOT).as_posix()
        for match in FROM_IMPORT.finditer(text):
            for item in match.group(2).strip("() \n").split(","):
                imported = item.split(" as ")[0].strip()
                if imported.isidentifier():
                    found.setdefault(f"{match.group(1)}:{imported}", set()).add(name)
        for pattern in (IMPORT, DOTTED):
            for match in pattern.finditer(text):
                found.setdefault(match.group(1), set()).add(name)
    return found


REFERENCES = doc_references()


def resolve(reference: str) -> tuple[Any, ModuleType | None, str | None]:
    """(the object, the module a from-import takes it from, the name) for a reference."""
    if ":" in reference:
        module_name, name = reference.split(":")
        module = importlib.import_module(module_name)
        if not hasattr(module, name):  # a submodule: from disttrain.comm import topology
            return importlib.import_module(f"{module_name}.{name}"), None, None
        return getattr(module, name), module, name
    parts = reference.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            obj = getattr(obj, attribute)
        return obj, None, None
    raise ModuleNotFoundError(reference)


def test_the_docs_show_names():
    """The scan finds what the pages show (it would pass vacuously otherwise)."""
    assert "disttrain.train:TrainConfig" in REFERENCES
    assert "disttrain.comm.topology:HierarchyConfig" in REFERENCES
    assert "disttrain.init" in REFERENCES


@pytest.mark.parametrize("reference", sorted(REFERENCES))
def test_every_name_the_docs_show_imports(reference):
    pages = ", ".join(sorted(REFERENCES[reference]))
    try:
        _, module, name = resolve(reference)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"{pages} show {reference}, which does not import: {exc}")
    if module is not None and hasattr(module, "__path__"):  # a package: declared public
        assert name in getattr(module, "__all__", ()), (
            f"{pages} import {name} from {module.__name__}: add it to its __all__")


def packages() -> Iterator[ModuleType]:
    for init in sorted((ROOT / "disttrain").rglob("__init__.py")):
        yield importlib.import_module(".".join(init.parent.relative_to(ROOT).parts))


def test_every_package_the_docs_use_declares_what_is_public():
    used = {ref.split(":")[0] for ref in REFERENCES if ":" in ref}
    for package in packages():
        if package.__name__ in used or package.__name__ in (
                "disttrain", "disttrain.comm", "disttrain.parallel", "disttrain.train",
                "disttrain.launch"):
            assert isinstance(getattr(package, "__all__", None), list), package.__name__
        for name in getattr(package, "__all__", ()):  # nothing stale in any __all__
            assert hasattr(package, name), f"{package.__name__}.__all__ names {name!r}"


# ---------------------------------------------------------------- old spellings
def deprecations(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]


@pytest.fixture
def fresh_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """Every old spelling may warn again (once), and every warning is recorded."""
    deprecated._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def test_moved_modules_are_the_new_ones_under_their_old_names(fresh_warnings):
    for old in deprecated.MOVED_MODULES:
        sys.modules.pop(old, None)  # as in a fresh process
    import disttrain.parallel.model_parallel as old_model_parallel
    from disttrain.parallel.model_parallel import build_model_parallel  # the second import
    from disttrain.simulate.contention import collective_in_step

    new_model_parallel = importlib.import_module("disttrain.parallel.pipeline.model_parallel")
    assert old_model_parallel is new_model_parallel
    assert build_model_parallel is new_model_parallel.build_model_parallel
    assert collective_in_step is importlib.import_module(
        "disttrain.probe.contention").collective_in_step
    moved = [m for m in deprecations(fresh_warnings) if m.startswith("module ")]
    assert moved == [
        "module disttrain.parallel.model_parallel is deprecated; use "
        "disttrain.parallel.pipeline.model_parallel (same behaviour)",
        "module disttrain.simulate.contention is deprecated; use disttrain.probe.contention "
        "(same behaviour)"]
    assert {w.filename for w in fresh_warnings if str(w.message).startswith("module ")} == {
        __file__}  # the warning points at the user's import line


def test_a_module_that_exists_is_never_taken_for_a_moved_one():
    assert deprecated.MovedModules().find_spec("disttrain.parallel.pipeline", None) is None
    assert isinstance(sys.meta_path[-1], deprecated.MovedModules) or any(
        isinstance(f, deprecated.MovedModules) for f in sys.meta_path)
    assert not set(deprecated.MOVED_MODULES.values()) & set(deprecated.MOVED_MODULES)
    for new in deprecated.MOVED_MODULES.values():
        importlib.import_module(new)


def hierarchy_through_old_spellings(_pool: Any) -> dict[str, Any]:
    """On each rank: the topology functions that took the communicator, twice each."""
    from disttrain.comm import CommConfig, Communicator
    from disttrain.comm.topology import (
        HierarchyConfig,
        build_hierarchy,
        close_hierarchy,
        hierarchy_of,
    )

    deprecated._warned.clear()
    comm = Communicator.from_torch(config=CommConfig(timeout_s=COMM_TIMEOUT_S))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            first = build_hierarchy(comm, HierarchyConfig(node_id=f"sim{comm.rank}"))
            built = build_hierarchy(comm, HierarchyConfig(node_id=f"sim{comm.rank}"))
            same = hierarchy_of(comm) is built is comm.hierarchy and hierarchy_of(comm) is built
            summed = torch.full((5,), float(comm.rank + 1))
            comm.all_reduce(summed, algorithm="hierarchical")
            nodes = built.layout.num_nodes
            close_hierarchy(comm)
            close_hierarchy(comm)
            closed = comm.hierarchy is None and first is not built
        finally:
            comm.close()
    return {"same": same, "sum": summed.tolist(), "nodes": nodes, "closed": closed,
            "warnings": deprecations(caught)}


def test_the_topology_functions_that_took_the_communicator_still_work(pools):
    """``build_hierarchy(comm, config)`` as the docs showed it, simulating two machines on
    one host; ``hierarchy_of`` and ``close_hierarchy`` likewise; one warning each."""
    for seen in pools(2).run(hierarchy_through_old_spellings):
        assert seen["same"] and seen["closed"] and seen["nodes"] == 2
        assert seen["sum"] == [3.0] * 5
        assert seen["warnings"] == [
            "disttrain.comm.topology.build_hierarchy(comm, config) is deprecated; use "
            "comm.build_hierarchy(config) (same behaviour)",
            "disttrain.comm.topology.hierarchy_of(comm) is deprecated; use comm.hierarchy "
            "(same behaviour)",
            "disttrain.comm.topology.close_hierarchy(comm) is deprecated; use "
            "comm.close_hierarchy() (same behaviour)"]


def test_the_top_level_names():
    assert set(disttrain.__all__) >= {"init", "shutdown", "Communicator", "CommConfig"}
