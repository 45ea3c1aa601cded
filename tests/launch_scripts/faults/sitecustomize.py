"""Test hooks, imported at start-up by every Python process whose PYTHONPATH holds this
directory; each acts only when its variable is set (otherwise nothing is imported).

DISTTRAIN_TEST_PHASE=startup with DISTTRAIN_TEST_VICTIM=RANK: that rank SIGSTOPs itself on
entering the rendezvous (``disttrain.launch.rendezvous.join``), before it has published
itself, writing the time to $DISTTRAIN_TEST_DIR/stopped-at first.

DISTTRAIN_TEST_SHM_KILL=RANK:POINT: global rank RANK SIGKILLs itself at POINT of the
shared-memory transport's set-up, first writing the segment's name to
$DISTTRAIN_TEST_DIR/segment:

    opened    the name exists in /dev/shm, but the rank's resource tracker (which removes
              what a dead process registered) has not been told yet
    created   the segment is created and registered, nobody else knows its name
    attached  the rank has mapped it; its name still exists (the others may not have)
"""

import importlib.abc
import importlib.machinery
import os
import sys

SPEC = os.environ.get("DISTTRAIN_TEST_SHM_KILL")
STARTUP = os.environ.get("DISTTRAIN_TEST_PHASE") == "startup"


def _patch_join(module):
    import signal
    import time

    join = module.join
    victim = int(os.environ["DISTTRAIN_TEST_VICTIM"])

    def stopping_join(store, rank, *args, **kwargs):
        if rank == victim:
            with open(os.path.join(os.environ["DISTTRAIN_TEST_DIR"], "stopped-at"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)
        return join(store, rank, *args, **kwargs)

    module.join = stopping_join


def _patch_shm(module):
    import signal

    import torch.distributed as dist

    victim, point = SPEC.split(":")

    def die(name):
        if dist.get_rank() == int(victim):
            with open(os.path.join(os.environ["DISTTRAIN_TEST_DIR"], "segment"), "w") as f:
                f.write(name)
            os.kill(os.getpid(), signal.SIGKILL)

    if point == "opened":
        import _posixshmem
        from multiprocessing import shared_memory

        class _Opening:
            def __getattr__(self, attr):
                return getattr(_posixshmem, attr)

            def shm_open(self, path, flags, mode=0o777):
                fd = _posixshmem.shm_open(path, flags, mode)
                if path.lstrip("/").startswith("disttrain-shm-") and flags & os.O_CREAT:
                    die(path.lstrip("/"))
                return fd

        shared_memory._posixshmem = _Opening()
    elif point == "created":
        create = module.create_segment

        def create_segment(name, size):
            shm = create(name, size)
            die(name)
            return shm

        module.create_segment = create_segment
    else:
        attach = module.attach_segment

        def attach_segment(name):
            segment = attach(name)
            die(name)
            return segment

        module.attach_segment = attach_segment


PATCHES = {}
if SPEC:
    PATCHES["disttrain.comm.transports.shm.segment"] = _patch_shm
if STARTUP:
    PATCHES["disttrain.launch.rendezvous"] = _patch_join


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def patched(module):
            exec_module(module)
            PATCHES[name](module)

        spec.loader.exec_module = patched
        return spec


if PATCHES:
    sys.meta_path.insert(0, _Finder())
