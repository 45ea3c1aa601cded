"""Gradient buckets: which parameters share one flat buffer, and the buffer itself.

Gradients become ready in roughly the reverse of the order the parameters were registered
(the last layer's gradient is computed first). So, like torch's DistributedDataParallel,
parameters are packed in REVERSE registration order: a small first bucket (1 MiB by default)
whose all-reduce can start as early as possible, then buckets of ``bucket_cap`` (25 MiB)::

    registration:  conv1.w conv1.b conv2.w conv2.b fc1.w fc1.b fc2.w fc2.b
    reversed:      fc2.b fc2.w fc1.b fc1.w │ conv2.b conv2.w conv1.b conv1.w
                   └──── bucket 0 ───────┘ └──────── bucket 1 ──────────┘
    backward:      ready first ──────────────────────────────▶ ready last

One bucket holds one dtype on one device (a flat buffer has a single dtype). A bucket is
closed as soon as it reaches its cap, so one large parameter may overflow it. The plan is
pure data (:func:`plan_buckets`), tested without processes; :class:`Bucket` owns the buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

MIB = 1 << 20

# zeros(numel, dtype, device) → a flat zero-filled buffer (shared memory, for example)
Zeros = Callable[[int, torch.dtype, torch.device], torch.Tensor]


def plain_zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype, device=device)


def plan_buckets(sizes: Sequence[int], kinds: Sequence[Hashable], first_cap: int,
                 cap: int) -> list[list[int]]:
    """Group parameter indices into buckets.

    ``sizes[i]`` is parameter i's gradient size in bytes and ``kinds[i]`` its (dtype, device)
    key, in registration order. Returns buckets as lists of parameter indices in the order
    their gradients are expected to be ready (reverse registration order); bucket 0 is the
    first to fill. Each kind fills its own open bucket; the first bucket closed for a kind
    is capped at ``first_cap`` bytes, later ones at ``cap``.
    """
    if len(sizes) != len(kinds):
        raise ValueError(f"sizes and kinds differ in length ({len(sizes)} vs {len(kinds)})")
    if first_cap <= 0 or cap <= 0:
        raise ValueError(f"bucket caps must be positive bytes, got first_cap={first_cap}, "
                         f"cap={cap}")
    open_buckets: dict[Hashable, list[int]] = {}
    open_bytes: dict[Hashable, int] = {}
    closed_count: dict[Hashable, int] = {}
    done: list[list[int]] = []
    for index in reversed(range(len(sizes))):
        kind = kinds[index]
        open_buckets.setdefault(kind, []).append(index)
        open_bytes[kind] = open_bytes.get(kind, 0) + sizes[index]
        limit = first_cap if closed_count.get(kind, 0) == 0 else cap
        if open_bytes[kind] >= limit:
            done.append(open_buckets.pop(kind))
            open_bytes[kind] = 0
            closed_count[kind] = closed_count.get(kind, 0) + 1
    done.extend(b for b in open_buckets.values() if b)
    # Bucket order = the order in which their first gradient is expected (reverse index).
    done.sort(key=lambda bucket: -bucket[0])
    return done


@dataclass
class Bucket:
    """One flat gradient buffer and the parameter views inside it.

    ``views[j]`` has the shape of parameter ``param_indices[j]`` and aliases
    ``flat[offsets[j] : offsets[j] + numel]``, so a parameter's ``.grad`` can *be* its view
    (no copy after the all-reduce), as with torch's ``gradient_as_bucket_view=True``.
    """

    index: int
    param_indices: list[int]
    flat: torch.Tensor
    offsets: list[int]
    shapes: list[torch.Size]
    views: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def allocate(cls, index: int, param_indices: list[int], params: Sequence[torch.Tensor],
                 zeros: Zeros = plain_zeros) -> Bucket:
        members = [params[i] for i in param_indices]
        total = sum(p.numel() for p in members)
        flat = zeros(total, members[0].dtype, members[0].device)
        offsets, views, offset = [], [], 0
        for p in members:
            offsets.append(offset)
            views.append(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        return cls(index, list(param_indices), flat, offsets, [p.shape for p in members], views)

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def __repr__(self) -> str:
        return (f"Bucket(index={self.index}, params={self.param_indices}, "
                f"numel={self.flat.numel()}, dtype={self.flat.dtype})")


def build_buckets(params: Sequence[torch.Tensor], first_cap_bytes: int,
                  cap_bytes: int, zeros: Zeros = plain_zeros) -> list[Bucket]:
    """Plan and allocate the buckets for ``params`` (registration order); ``zeros``
    allocates each flat buffer (in bucket order, so a collective allocator works)."""
    sizes = [p.numel() * p.element_size() for p in params]
    kinds = [(p.dtype, p.device) for p in params]
    plan = plan_buckets(sizes, kinds, first_cap_bytes, cap_bytes)
    return [Bucket.allocate(i, members, params, zeros) for i, members in enumerate(plan)]
