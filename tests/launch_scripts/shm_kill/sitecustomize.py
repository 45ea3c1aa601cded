"""Test hook, imported at start-up by every Python process whose PYTHONPATH holds this
directory. With DISTTRAIN_TEST_SHM_KILL=RANK:POINT, global rank RANK SIGKILLs itself at
POINT of the shared-memory transport's set-up, first writing the segment's name to
$DISTTRAIN_TEST_DIR/segment:

    opened    the name exists in /dev/shm, but the rank's resource tracker (which removes
              what a dead process registered) has not been told yet
    created   the segment is created and registered, nobody else knows its name
    attached  the rank has mapped it; its name still exists (the others may not have)

Without the variable it does nothing (and imports nothing)."""

import importlib.abc
import importlib.machinery
import os
import sys

SPEC = os.environ.get("DISTTRAIN_TEST_SHM_KILL")
TARGET = "disttrain.comm.transports.shm_rendezvous"


def _patch(module):
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


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def patched(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = patched
        return spec


if SPEC:
    sys.meta_path.insert(0, _Finder())
