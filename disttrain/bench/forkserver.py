"""Fresh rank processes without paying torch's import in every one of them.

A spawned process imports torch itself: about 3 s of one core on a 2-core machine, and
``disttrain bench`` starts new ranks for every run of its table. :func:`rank_context`
returns multiprocessing's fork-server context instead, with torch and disttrain's
communication layer preloaded: the server imports them once, the first time a rank is
started, and every rank after that is forked from it in a fraction of a second.

A forked rank is still a fresh process: the server does nothing but import, so no thread
of it runs when it forks, and the rank takes its target and arguments by pickle, as under
spawn. What differs is the environment: a fork server's children inherit the environment
the server started with, not their parent's of the moment. Hand :func:`environment` to the
rank and call :func:`adopt_environment` first thing in it. Where there is no fork server
(not Linux or macOS), or with ``DISTTRAIN_RANK_START=spawn`` in the environment, the
context is spawn and both calls are harmless.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Sequence
from typing import Any

PRELOAD = ("torch", "torch.distributed", "disttrain.comm")
START_VAR = "DISTTRAIN_RANK_START"  # "forkserver" (the default) or "spawn"


def rank_context(preload: Sequence[str] = PRELOAD) -> Any:
    """The multiprocessing context to start ranks from (see the module docstring).

    The fork server is one per process: ``preload`` counts only if it is not running yet,
    and a list set by someone else before is kept, with ``preload`` added to it."""
    method = os.environ.get(START_VAR, "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{START_VAR} must be 'forkserver' or 'spawn', got {method!r}")
    if method == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    from multiprocessing import forkserver

    current = list(getattr(forkserver._forkserver, "_preload_modules", []))
    ctx.set_forkserver_preload(current + [m for m in preload if m not in current])
    return ctx


def environment() -> dict[str, str]:
    """This process's environment now, to hand to a rank."""
    return dict(os.environ)


def adopt_environment(env: dict[str, str]) -> None:
    """In a rank: take the parent's environment as it was when the rank was started."""
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)
