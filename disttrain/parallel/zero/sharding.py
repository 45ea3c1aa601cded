"""What every ZeRO stage shares: its config (:class:`ZeroConfig`), its interface
(:class:`ZeroWrapper`), the shard map of the flattened parameters and the flat buffers
whose views are the parameters.

ZeRO (Rajbhandari et al. 2020) concatenates parameters into one flat vector of Ψ elements
and cuts it into ``world_size`` contiguous shards of equal length S = ⌈Ψ / N⌉. The last
shard is padded with zeros up to S so that every ``all_gather`` / ``reduce_scatter`` moves
equal blocks; the padding is never copied back into a parameter::

    params      [ w0 (6)      | b0 (2) | w1 (3)  ]         Ψ = 11, N = 3, S = 4
    flat        0 1 2 3 4 5 6 7 8 9 10 .                   (. = padding)
    rank 0      [0 1 2 3]              w0[0:4]
    rank 1      [4 5 6 7]              w0[4:6] b0[0:2]
    rank 2      [8 9 10 .]             w1[0:3] + 1 padding element

Each rank's shard is described by *pieces* (param index, offset in the param, offset in the
shard, length), which engines turn into tensor views. :func:`read_plan` maps the shards of
one layout onto those of another (a checkpoint saved on N ranks, loaded on M), and
:func:`partition` groups parameters into buckets: all pure data, tested without processes.

Each stage keeps parameters as *views* into one padded flat buffer per group (that layout),
so a collective moves a whole group in one call and a rank's shard is a plain slice. A
:class:`ShardGroup` is what checkpoints and memory accounting see of a group: parameter
names and shapes, the layout, and this rank's flat "master" shard (the tensor the torch
optimizer updates). :class:`ZeroWrapper` is what every stage offers to checkpoints, memory
accounting and the training loop; each stage implements it in its own module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.comm.algorithms import ALGORITHMS

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
"""Builds the optimizer from the flat shard tensors, e.g. ``lambda p: torch.optim.Adam(p, lr=1e-3)``
or ``functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)``; with ``param_groups`` it is
given a list of dicts instead, as torch optimizers take (:mod:`.groups`)."""

GradShardHook = Callable[[list[torch.Tensor | None]], None]
"""Runs in ``step()`` with every flat group's reduced gradient shard (this rank's, in
``shard_groups()`` order; None: no gradient), before the optimizer; it may change them in
place or fill a None (a tensor mesh finishes its sums over tp there)."""


@dataclass(frozen=True)
class MasterSlice:
    """One tensor the optimizer updates: ``tensor`` is ``master[start:start + n]`` (a view),
    or the master itself when there are no groups; ``group`` indexes ``param_groups``."""

    group: int
    start: int
    tensor: torch.Tensor


_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# every step moves data with these two; a name must exist for both
_STEP_OPS = ("all_gather", "reduce_scatter")


@dataclass(frozen=True)
class ZeroConfig:
    """How a ZeRO wrapper keeps and moves its shards.

    * ``master_dtype``: the least precision of the optimizer's flat shard ("master
      weights"); the shard is never narrower than the parameters (a float64 model keeps
      float64 masters). When the two agree the shard *is* the parameters' memory (no
      copy); when the model trains in bf16/fp16 and this is float32, each rank keeps an
      fp32 copy of its shard only, and casts after each step.
    * ``reduce_dtype``: dtype in which gradients are reduced (and the gradient shard kept,
      stages 2 and 3). ``None``: the parameters' dtype (2 bytes/param in bf16, the paper's
      accounting); ``torch.float32`` reduces bf16 gradients in fp32 (more exact, 2× bytes).
    * ``bucket_bytes``: stage 2 reduces gradients in buckets of about this size during
      backward (a bucket is launched when all its gradients are ready).
    * ``inflight_buckets``: stages 2 and 3 wait for the oldest gradient reduction once this
      many are in flight, so staging buffers never add up to a full gradient (the peak of
      DeepSpeed#1302, where stage 2 used more memory than stage 1).
    * ``prefetch``: stage 3 starts gathering the next layer's parameters while the current
      layer computes.
    * ``broadcast_from_rank0``: copy rank 0's initial parameters to every rank on wrap, so
      replicas start equal even if each rank seeded differently.
    * ``algorithm``: collective algorithm of every all-gather and reduce-scatter (``None``:
      the communicator's default; ``"auto"``: chosen by the cost model). The one broadcast
      on wrap uses it too when broadcast has an algorithm of that name (``"ring"`` has
      none: the communicator's default broadcasts then).
    """

    master_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype | None = None
    bucket_bytes: int = 4 << 20
    inflight_buckets: int = 2
    prefetch: bool = True
    broadcast_from_rank0: bool = True
    algorithm: str | None = None

    def __post_init__(self) -> None:
        if self.master_dtype not in _FLOATS:
            raise ValueError(f"master_dtype must be a floating dtype (usually torch.float32), "
                             f"got {self.master_dtype!r}")
        if self.reduce_dtype is not None and self.reduce_dtype not in _FLOATS:
            raise ValueError(f"reduce_dtype must be None or a floating dtype, got "
                             f"{self.reduce_dtype!r}")
        if isinstance(self.bucket_bytes, bool) or not isinstance(self.bucket_bytes, int) or (
                self.bucket_bytes < 1):
            raise ValueError(f"bucket_bytes must be a positive int (bytes per gradient bucket), "
                             f"got {self.bucket_bytes!r}")
        if isinstance(self.inflight_buckets, bool) or not isinstance(self.inflight_buckets, int) \
                or self.inflight_buckets < 1:
            raise ValueError(f"inflight_buckets must be an int ≥ 1, got {self.inflight_buckets!r}")
        for name in ("prefetch", "broadcast_from_rank0"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        choices = [a for a in ALGORITHMS[_STEP_OPS[0]] if all(a in ALGORITHMS[op]
                                                              for op in _STEP_OPS)]
        if self.algorithm is not None and self.algorithm not in ("auto", *choices):
            raise ValueError(f"algorithm={self.algorithm!r} is not an all-gather and "
                             f"reduce-scatter algorithm; choose None (the communicator's "
                             f"default), 'auto' or one of: {', '.join(choices)}")

    def algorithm_for(self, op: str) -> str | None:
        """``algorithm`` if collective ``op`` has an algorithm of that name, else ``None``
        (the communicator's default)."""
        if self.algorithm is None or self.algorithm == "auto":
            return self.algorithm
        return self.algorithm if self.algorithm in ALGORITHMS[op] else None


# ----------------------------------------------------------------------
# Which rank owns which slice of the flattened parameters: pure shard maps, no tensors.

@dataclass(frozen=True)
class Piece:
    """``length`` elements of parameter ``param`` starting at ``param_offset`` (in the
    parameter's flattened order) live at ``shard_offset`` in the rank's shard."""

    param: int
    param_offset: int
    shard_offset: int
    length: int


@dataclass(frozen=True)
class ShardLayout:
    """The flat vector of ``numels`` cut into ``world_size`` shards of ``shard_size``."""

    numels: tuple[int, ...]
    world_size: int
    shard_size: int
    pieces: tuple[tuple[Piece, ...], ...]  # pieces[rank]

    @property
    def total(self) -> int:
        """Ψ: the number of real (unpadded) elements."""
        return sum(self.numels)

    @property
    def padded_total(self) -> int:
        """N × S: the length of the buffer that all_gather fills."""
        return self.shard_size * self.world_size

    @property
    def padding(self) -> int:
        return self.padded_total - self.total

    def offsets(self) -> tuple[int, ...]:
        """Where each parameter starts in the flat vector."""
        starts, acc = [], 0
        for n in self.numels:
            starts.append(acc)
            acc += n
        return tuple(starts)

    def shard_range(self, rank: int) -> tuple[int, int]:
        """The flat range ``[start, end)`` that ``rank`` owns, padding included."""
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def real_length(self, rank: int) -> int:
        """How many of the rank's S elements are real (the rest is padding)."""
        start, _ = self.shard_range(rank)
        return max(0, min(self.shard_size, self.total - start))


def shard_layout(numels: Sequence[int], world_size: int) -> ShardLayout:
    """Cut the concatenation of parameters with ``numels`` elements into ``world_size``
    equal contiguous shards (the last one padded)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    numels = tuple(numels)
    for i, n in enumerate(numels):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"numels[{i}] must be a non-negative int, got {n!r}")
    total = sum(numels)
    if total == 0:
        raise ValueError("there is nothing to shard: every parameter has 0 elements (does the "
                         "model have trainable parameters?)")
    size = -(-total // world_size)
    pieces: list[list[Piece]] = [[] for _ in range(world_size)]
    start = 0
    for index, n in enumerate(numels):
        done = 0
        while done < n:  # a parameter may span several shards
            flat = start + done
            rank, offset = divmod(flat, size)
            length = min(n - done, size - offset)
            pieces[rank].append(Piece(index, done, offset, length))
            done += length
        start += n
    return ShardLayout(numels, world_size, size, tuple(tuple(p) for p in pieces))


@dataclass(frozen=True)
class Read:
    """Copy ``length`` elements from ``src_offset`` of group ``src_group``'s shard on old
    rank ``src_rank`` to ``dst_offset`` of the new rank's shard."""

    src_group: int
    src_rank: int
    src_offset: int
    dst_offset: int
    length: int


def read_plan(
    sources: Sequence[ShardLayout],
    where: Sequence[tuple[int, int]],
    target: ShardLayout,
    rank: int,
) -> list[Read]:
    """How new ``rank`` of ``target`` fills its shard from the shards of an old layout.

    ``sources`` are the old layouts (one per flat group); ``where[i]`` = (old group, index
    in that group) of the target's parameter ``i``. Only the old ranks whose shards overlap
    the new shard are read, and adjacent reads are merged.
    """
    if len(where) != len(target.numels):
        raise ValueError(f"where has {len(where)} entries for {len(target.numels)} parameters")
    offsets = [layout.offsets() for layout in sources]
    reads: list[Read] = []
    for piece in target.pieces[rank]:
        group, index = where[piece.param]
        src = sources[group]
        if src.numels[index] != target.numels[piece.param]:
            raise ValueError(f"parameter {piece.param} has {target.numels[piece.param]} "
                             f"elements here but {src.numels[index]} in the source layout")
        flat = offsets[group][index] + piece.param_offset
        done = 0
        while done < piece.length:
            old_rank, old_offset = divmod(flat + done, src.shard_size)
            length = min(piece.length - done, src.shard_size - old_offset)
            _append(reads, Read(group, old_rank, old_offset, piece.shard_offset + done, length))
            done += length
    return reads


def _append(reads: list[Read], read: Read) -> None:
    """Append, merging with the previous read when both ends are contiguous."""
    if reads:
        last = reads[-1]
        if (last.src_group, last.src_rank) == (read.src_group, read.src_rank) and (
                last.src_offset + last.length == read.src_offset
                and last.dst_offset + last.length == read.dst_offset):
            reads[-1] = Read(last.src_group, last.src_rank, last.src_offset, last.dst_offset,
                             last.length + read.length)
            return
    reads.append(read)


def partition(nbytes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Group consecutive items (sizes in bytes) into buckets of about ``bucket_bytes``: a
    bucket closes once it reaches the limit, so one large item makes a bucket of its own."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be ≥ 1, got {bucket_bytes}")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, n in enumerate(nbytes):
        current.append(i)
        size += n
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


# ----------------------------------------------------------------------
# Tensor plumbing shared by the stages: flat buffers whose views are the parameters.

@dataclass(frozen=True)
class ShardGroup:
    """One flat group: ``names[i]`` has ``shapes[i]``; ``master`` is this rank's shard
    (``layout.shard_size`` elements, padding included); ``slices``: the tensors of it the
    optimizer updates (the master whole, or, with parameter groups, a slice per group run:
    :mod:`.groups`; empty: the master)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    layout: ShardLayout
    master: torch.Tensor
    slices: tuple[MasterSlice, ...] = ()


def trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The module's parameters that require grad, each once (tied weights: first name)."""
    seen: set[int] = set()
    named = []
    for name, param in module.named_parameters():
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            named.append((name, param))
    if not named:
        raise ValueError("the model has no parameter with requires_grad=True: there is "
                         "nothing for ZeRO to shard or train")
    return named


def common_dtype(named: Sequence[tuple[str, torch.Tensor]]) -> torch.dtype:
    """The single dtype of all parameters (a flat buffer has one dtype)."""
    dtypes = {p.dtype for _, p in named}
    if len(dtypes) != 1:
        listing = ", ".join(sorted({f"{n}: {p.dtype}" for n, p in named})[:6])
        raise ValueError(f"ZeRO flattens parameters into one buffer, so they need one dtype; "
                         f"found {sorted(map(str, dtypes))} ({listing}); cast the model with "
                         f".to(dtype) first")
    return dtypes.pop()


def param_views(flat: torch.Tensor, params: Sequence[torch.Tensor],
                layout: ShardLayout) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``params`` (in layout order)."""
    return [flat[start:start + n].view(p.shape)
            for p, start, n in zip(params, layout.offsets(), layout.numels)]


def flatten_into_views(params: Sequence[torch.Tensor], layout: ShardLayout,
                       dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A zero-padded flat buffer holding the parameters' values, and its views; each
    parameter's ``.data`` becomes its view, so the module now reads the flat buffer."""
    device = params[0].device
    flat = torch.zeros(layout.padded_total, dtype=dtype, device=device)
    views = param_views(flat, params, layout)
    with torch.no_grad():
        for p, view in zip(params, views):
            view.copy_(p.detach())
            p.data = view
    return flat, views


def shard_of(flat: torch.Tensor, layout: ShardLayout, rank: int) -> torch.Tensor:
    """This rank's slice of a padded flat buffer (a view)."""
    start, end = layout.shard_range(rank)
    return flat[start:end]


def master_dtype(param_dtype: torch.dtype, least: torch.dtype) -> torch.dtype:
    """The master weights' dtype: ``least`` (the config's), or the parameters' when wider."""
    return torch.promote_types(param_dtype, least)


def master_copy(shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The optimizer's parameter: the shard itself when its dtype is at least ``dtype`` (no
    extra memory), else a copy in ``dtype`` (fp32 master weights for a bf16 model)."""
    target = master_dtype(shard.dtype, dtype)
    if shard.dtype == target:
        return shard
    return shard.detach().to(dtype=target, copy=True)


def to_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` itself when it already has ``dtype``, else a cast copy."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


# ----------------------------------------------------------------------
# What every ZeRO stage offers: the interface checkpoints, memory accounting and the
# training loop rely on (each stage implements it in its own module).

class ZeroWrapper(Protocol):
    stage: int
    module: nn.Module  # the user's model (its parameters are views or placeholders)
    comm: Communicator  # the ranks that shard (the shard group, when hybrid)
    replicate: Communicator | None  # hybrid sharding's replicas of the same shard (.hybrid)
    config: ZeroConfig
    optimizer: torch.optim.Optimizer  # over this rank's flat master shards
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype

    @property
    def numel(self) -> int:
        """Ψ: trainable parameters in the model."""
        ...

    def step(self) -> None: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def no_sync(self) -> AbstractContextManager[None]: ...

    def shard_groups(self) -> list[ShardGroup]:
        """Each flat group's parameter names, shapes, layout and this rank's master shard."""
        ...

    def reload_from_masters(self) -> None:
        """Propagate overwritten master shards (a checkpoint load) into the parameters."""
        ...

    def register_grad_shard_hook(self, hook: GradShardHook) -> None:
        """Run ``hook`` in every ``step()`` on the reduced gradient shards, before the
        optimizer (and its step pre-hooks: fp16's unscaling, clipping)."""
        ...

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor the rank holds for the model's state: params, grads, optimizer."""
        ...
