"""Bytes each parameter-server worker moves per step, dense against sparse embedding rows.

The figures of docs/parameter_server.md, "Sparse embeddings": ClickModel on 2 servers and 2
workers, batch 32, sync, 20 steps. Run from the checkout: ``PYTHONPATH=. python
scripts/ps_bytes.py``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from disttrain.comm import Communicator
from disttrain.parallel.parameter_server import (
    SPARSE_PARAMS,
    ClickData,
    ClickModel,
    PSConfig,
    PSWorker,
    assign_roles,
    make_click_data,
    run_parameter_server,
)
from tests.dist import DistPool


def job(comm: Communicator, sparse: bool, steps: int = 20, b: int = 32) -> Any:
    roles = assign_roles(comm.world_size, 2)
    config = PSConfig(mode="sync", sparse_params=SPARSE_PARAMS if sparse else ())
    torch.manual_seed(0)
    model = ClickModel()
    if roles.role(comm.rank).kind == "server":
        return run_parameter_server(comm, roles, model, lambda p: torch.optim.SGD(p, lr=0.1),
                                    config)
    ps, w = PSWorker(comm, model, roles, config), roles.role(comm.rank).index
    x, y = make_click_data(ClickData())
    before = comm.stats.bytes_sent + comm.stats.bytes_recv
    for step in range(steps):
        rows = slice((2 * step + w) * b, (2 * step + w + 1) * b)
        ps.pull(sparse_ids=model.sparse_ids(x[rows]) if sparse else None)
        model.zero_grad()
        F.binary_cross_entropy_with_logits(model(x[rows]), y[rows]).backward()
        ps.push()
    used = comm.stats.bytes_sent + comm.stats.bytes_recv - before
    ps.close()
    return used // steps


if __name__ == "__main__":
    pool = DistPool(4)
    for sparse in (False, True):
        print("sparse" if sparse else "dense", pool.run(job, sparse)[:2], "bytes/step/worker")
    pool.close()
