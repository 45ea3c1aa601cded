"""Imported once by the fork server that test ranks come from (``tests.dist.rank_context``).

A spawned rank imports torch itself: about 3 s of one core on the 2-core CI machine, for every
rank of every test that starts processes. Forked from a server that has already imported it,
a rank starts in a fraction of a second. The server does nothing else, so no thread of it is
running when it forks. One intra-op thread, as every test rank runs: set before torch loads
its OpenMP runtime, which reads the variable once.
"""

import importlib
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
for module in ("torch", "torch.distributed", "disttrain.comm"):
    importlib.import_module(module)
