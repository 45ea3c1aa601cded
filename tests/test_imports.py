"""The import graph of disttrain: no circles, and the simulator's model stays pure.

Read from the source with ``ast``, so every import counts, the ones inside functions too: a
function-level import that closes a circle only hides it (the circle is still there when
the function runs). Imports under ``if TYPE_CHECKING:`` count as well: they never run, but a
circle the type checker follows is still two modules that need each other.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "disttrain"

# Imports that close a circle today, each an edge (importer, imported) to remove once the
# two modules stop needing each other; the test fails when one no longer closes a circle,
# so the list only shrinks. Each is a function-level import hiding its circle.
KNOWN_CIRCLES: set[tuple[str, str]] = set()  # none left

# What the simulator's model (disttrain/simulate/ but its command line, cli.py) may import
# from the rest of disttrain: the calibrated cost model, the presets (names as degrees and
# options), and the engines' own pure plans (buckets, stage cuts, schedules as data, ZeRO's
# memory formula, tensor parallelism's sizes), so that it simulates exactly what the engines
# run. Nothing that starts processes or measures: no bench/, train/, launch/ or probe/, no
# other part of parallel/ or comm/.
MODEL_MAY_IMPORT = {
    "disttrain.comm.cost_model",
    "disttrain.parallel.ddp.buckets",
    "disttrain.parallel.pipeline.partition",
    "disttrain.parallel.pipeline.schedules",
    "disttrain.parallel.presets",
    "disttrain.parallel.tensor.theory",
    "disttrain.parallel.zero.memory",
}
MODEL_NEVER_IMPORTS = ("torch", "multiprocessing", "subprocess", "threading")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imported_names(module: str) -> set[str]:
    """Every module name ``module`` imports, anywhere in the file (relative imports
    resolved; ``from package import name`` is ``package.name`` when that is a module)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                full = f"{source}.{alias.name}"
                names.add(full if full in MODULES else source)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    names.discard(module)
    return names


def import_graph() -> dict[str, set[str]]:
    """disttrain's modules and, for each, the disttrain modules it imports."""
    return {m: {n for n in imported_names(m) if n in MODULES} for m in MODULES}


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules in order, the first repeated at the
    end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := walk(start)):
            return found
    return None


def test_the_import_graph_has_no_circle_but_the_known_ones() -> None:
    graph = import_graph()
    for importer, imported in KNOWN_CIRCLES:
        graph[importer].discard(imported)
    circle = find_circle(graph)
    assert circle is None, "import circle: " + " → ".join(circle or []) + (
        ": break it (move what both need into a third module), or, if it must stay for "
        "now, add its closing edge to KNOWN_CIRCLES with the reason")


@pytest.mark.parametrize(("importer", "imported"), sorted(KNOWN_CIRCLES))
def test_every_known_circle_is_still_one(importer: str, imported: str) -> None:
    """A known exception that no longer closes a circle is taken off the list."""
    graph = import_graph()
    assert importer in graph and imported in graph[importer], (
        f"{importer} no longer imports {imported}: remove it from KNOWN_CIRCLES")
    others = {m: set(n) for m, n in graph.items()}
    for a, b in KNOWN_CIRCLES - {(importer, imported)}:
        others[a].discard(b)
    assert find_circle(others) is not None, (
        f"{importer} → {imported} closes no circle any more: remove it from KNOWN_CIRCLES")


def test_the_circle_finder_finds_a_function_level_circle(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks above can fail: an import inside a function closing a circle is found."""
    graph = {"a": {"b"}, "b": {"c"}, "c": set()}
    assert find_circle(graph) is None
    graph["c"].add("a")
    assert find_circle(graph) == ["a", "b", "c", "a"]
    hidden = tmp_path / "hidden.py"
    hidden.write_text("from typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n    from disttrain.comm import stats\n"
                      "def f():\n    from disttrain.comm import communicator\n")
    monkeypatch.setitem(MODULES, "disttrain.hidden", hidden)
    assert imported_names("disttrain.hidden") == {  # both counted, TYPE_CHECKING's too
        "typing", "disttrain.comm.stats", "disttrain.comm.communicator"}


def _model_modules() -> list[str]:
    return [m for m in MODULES if m.startswith("disttrain.simulate")
            and m != "disttrain.simulate.cli"]


@pytest.mark.parametrize("module", _model_modules())
def test_the_simulators_model_imports_no_probe_bench_train_or_runtime(module: str) -> None:
    """disttrain/simulate/ is a pure cost model: what measures a host lives in
    disttrain/probe/, which fills the model's records (probe → record → model)."""
    for name in sorted(imported_names(module)):
        root = name.split(".")[0]
        assert root not in MODEL_NEVER_IMPORTS, f"{module} imports {name}"
        if root != "disttrain" or name == "disttrain":
            continue
        own = name.startswith("disttrain.simulate") and name != "disttrain.simulate.cli"
        assert own or name in MODEL_MAY_IMPORT, (
            f"{module} imports {name}: the model may import only the simulator's own "
            f"modules and {sorted(MODEL_MAY_IMPORT)}")


def test_the_model_loads_nothing_of_bench_train_or_the_probes() -> None:
    """In a fresh interpreter, importing every module of the model adds no module of
    bench/, train/ or probe/ to what ``import disttrain`` itself loads."""
    code = (
        "import importlib, sys\n"
        "import disttrain\n"
        "before = set(sys.modules)\n"
        f"for name in {_model_modules()!r}:\n"
        "    importlib.import_module(name)\n"
        "print('\\n'.join(sorted(set(sys.modules) - before)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    assert "disttrain.simulate.events" in out  # it did import the model
    leaked = [m for m in out if m.startswith(("disttrain.bench", "disttrain.train",
                                              "disttrain.probe", "disttrain.launch"))]
    assert leaked == []


def test_the_probes_import_the_model_and_never_the_reverse() -> None:
    """The probes fill the model's records: every probe module that imports disttrain
    imports the model's records or costs, and the graph has no path back."""
    graph = import_graph()
    probes = [m for m in MODULES if m.startswith("disttrain.probe")]
    assert probes and all(not any(n.startswith("disttrain.probe") for n in graph[m])
                          for m in _model_modules())
    assert any(n.startswith("disttrain.simulate") for m in probes for n in graph[m])


def test_disttrains_own_code_never_imports_the_baselines() -> None:
    """PyTorch's and DeepSpeed's implementations live in disttrain/baselines/ for comparison;
    the registry finds them by name (train.strategies.PLUGINS), nothing imports them."""
    importers = sorted(m for m in MODULES if not m.startswith("disttrain.baselines")
                       and any(n.startswith("disttrain.baselines") for n in imported_names(m)))
    assert importers == [], importers
