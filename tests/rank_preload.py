"""First module the test ranks' fork server imports (``tests.dist.rank_context``), before
torch: one intra-op thread, as every test rank runs, set before torch loads its OpenMP
runtime, which reads the variable once. The server then preloads torch itself
(:mod:`disttrain.bench.forkserver`)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
