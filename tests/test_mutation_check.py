"""scripts/mutation_check.py stays runnable: every planted fault still applies to the code
exactly once and names tests that exist, and a fault whose text moved is named (the script
then exits 2) instead of being skipped. No fault is run here: the script does that."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("mutation_check",
                                                  ROOT / "scripts" / "mutation_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutation_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_fault_applies_once_and_names_existing_tests():
    script = _script()
    assert script.stale(list(script.FAULTS), ROOT) == []
    names = [f.name for f in script.FAULTS]
    assert len(names) == len(set(names))
    for fault in script.FAULTS:
        assert fault.old != fault.new, fault.name
        for test in fault.tests:
            path, _, node = test.partition("::")
            assert (ROOT / path).is_file(), (fault.name, path)
            function = node.split("[")[0]
            if function:
                source = (ROOT / path).read_text()
                assert re.search(rf"^def {function}\(", source, re.M), (fault.name, test)


def test_a_fault_whose_code_moved_is_named_and_stops_the_script(capsys):
    script = _script()
    moved = dataclasses.replace(script.FAULTS[0], old="this text is nowhere in the file")
    problems = script.stale([moved, *script.FAULTS[1:]], ROOT)
    assert len(problems) == 1 and problems[0].startswith(f"{moved.name}: {moved.path}: ")
    assert "occurs 0 times" in problems[0]
    script.FAULTS = (moved,)
    assert script.main([]) == 2
    assert f"{moved.name}: " in capsys.readouterr().err
