"""Public Python names that moved keep working, each saying once where it went.

What the docs show is public (every package's ``__all__``); when such a name moves, its old
spelling stays, does what the new one does and raises one ``DeprecationWarning`` per
process naming the replacement, as the command line's old flag spellings do
(:mod:`disttrain.flags`). Two kinds:

* a function whose job moved stays a function at its old place that calls
  :func:`warn_once` and then the new spelling
  (``disttrain.comm.topology.build_hierarchy(comm, config)`` →
  ``comm.build_hierarchy(config)``);
* a module that moved is found under its old name by :class:`MovedModules`, an import
  finder that ``import disttrain`` puts at the end of ``sys.meta_path``: ``import
  disttrain.parallel.model_parallel`` gives the very module
  ``disttrain.parallel.pipeline.model_parallel``. No file stays at the old place, so the
  package the module left keeps its import rules (the simulator's model imports nothing
  that measures).

:data:`MOVED_MODULES` is the record of moved modules; ``tests/test_public_api.py`` holds every
name the docs show importable and every old spelling working, with one warning.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

# old module → where it lives now (each was named in the docs before it moved)
MOVED_MODULES: dict[str, str] = {
    "disttrain.parallel.model_parallel": "disttrain.parallel.pipeline.model_parallel",
    "disttrain.simulate.contention": "disttrain.probe.contention",
}

_warned: set[str] = set()  # old spellings that have warned in this process


def warn_once(old: str, new: str, stacklevel: int = 3) -> None:
    """One ``DeprecationWarning`` per process for ``old``, naming ``new``; the default
    ``stacklevel`` points at the caller of the function that calls this (the user's line;
    the import machinery's own frames are skipped)."""
    if old in _warned:
        return
    _warned.add(old)
    warnings.warn(f"{old} is deprecated; use {new} (same behaviour)", DeprecationWarning,
                  stacklevel=stacklevel)


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds each module of :data:`MOVED_MODULES` under its old name: the new module
    itself (one object under both names), after one warning."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED_MODULES[spec.name]
        warn_once(f"module {spec.name}", new, stacklevel=3)
        return importlib.import_module(new)  # its own name and spec stay as they are

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the new module was imported in full by create_module."""


def install() -> None:
    """Put :class:`MovedModules` at the end of ``sys.meta_path`` (once): a module that
    exists is always found first."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())


__all__ = ["MOVED_MODULES", "MovedModules", "install", "warn_once"]
