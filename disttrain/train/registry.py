"""Name → factory registries that also accept a user's factory as ``"package.module:function"``.

Models, datasets and strategies are each a plain dict of factories (like ``ALGORITHMS`` in
:mod:`disttrain.comm`). :func:`resolve` looks a name up, or imports ``module:attribute``
when the name contains a colon, so users plug in their own code without registering it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def is_import_path(name: str) -> bool:
    """``"pkg.mod:factory"`` names user code; plain names are registry keys."""
    return ":" in name


def import_object(path: str, what: str) -> Any:
    """Import ``"package.module:attribute"`` (the attribute may be dotted: ``mod:Class.make``)."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"{what} {path!r} is not a valid import path; write it as "
                         f"'package.module:factory'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {path!r}: cannot import module {module_name!r} ({exc}); "
                         f"check the name and that it is on PYTHONPATH") from exc
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{what} {path!r}: module {module_name!r} has no attribute "
                             f"{attribute!r}") from None
    if not callable(obj):
        raise ValueError(f"{what} {path!r} names {type(obj).__name__}, not a callable factory")
    return obj


def resolve(registry: Mapping[str, T], name: str, what: str) -> T | Any:
    """The factory registered as ``name``, or the callable at import path ``name``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what} must be a non-empty string, got {name!r}")
    if is_import_path(name):
        return import_object(name, what)
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; choose one of: {', '.join(sorted(registry))}, "
                         f"or give your own as 'package.module:factory'") from None


def call_factory(factory: Any, argument: Any, what: str) -> Any:
    """Call ``factory(argument)``, or ``factory()`` when it takes no parameters (user code
    often needs no options)."""
    import inspect

    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: pass the argument
        return factory(argument)
    takes_one = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
                    for p in params)
    try:
        return factory(argument) if takes_one else factory()
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{what} factory {getattr(factory, '__name__', factory)!r} "
                         f"failed: {exc}") from exc
