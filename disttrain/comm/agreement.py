"""Agreement on the cost model: ``auto`` must pick the same algorithm on every rank.

A calibration file may differ between machines (or be missing on some), so when a
Communicator is built every rank adopts rank 0's :class:`LinkCosts`: rank 0 broadcasts their
JSON encoding (length first) down a binomial tree, on tags past every communicator
instance's range and counted apart from the communicator's own traffic.
"""

from __future__ import annotations

import torch

from disttrain.comm.algorithms import tree
from disttrain.comm.context import COLLECTIVE_TAG_BASE, INSTANCE_TAGS, CollectiveContext
from disttrain.comm.cost_model import LinkCosts, costs_from_bytes, costs_to_bytes
from disttrain.comm.errors import CommError
from disttrain.comm.stats import TrafficStats
from disttrain.comm.transport import Transport

MAX_COSTS_BYTES = 1 << 20
AGREE_TAG = COLLECTIVE_TAG_BASE + 64 * INSTANCE_TAGS  # past every instance's range


def agreed_costs(transport: Transport, local: LinkCosts, timeout_s: float) -> LinkCosts:
    """Rank 0's costs on every rank (collective: every rank of ``transport`` calls it)."""
    if transport.world_size == 1:
        return local
    ctx = CollectiveContext(transport, TrafficStats(), op="agree_costs", seq=0,
                            algorithm="tree", timeout_s=timeout_s, chunk_bytes=1 << 20,
                            tag_base=AGREE_TAG)
    device = transport.device_type  # NCCL moves CUDA tensors only
    payload = costs_to_bytes(local) if transport.rank == 0 else b""
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    tree.broadcast(ctx, length, 0)
    size = int(length.item())
    if not 0 < size <= MAX_COSTS_BYTES:
        raise CommError(f"rank 0 announced {size} bytes of cost-model data; expected "
                        f"1..{MAX_COSTS_BYTES} (are all ranks running the same disttrain?)")
    buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
           if transport.rank == 0 else torch.empty(size, dtype=torch.uint8, device=device))
    tree.broadcast(ctx, buf, 0)
    return local if transport.rank == 0 else costs_from_bytes(bytes(buf.tolist()))
