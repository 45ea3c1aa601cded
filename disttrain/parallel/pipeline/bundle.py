"""Values that are not one tensor at a stage boundary: tuples, lists and dicts of tensors.

A stage's output travels as one message (:mod:`.wire`), so a nested value is packed into
one byte tensor, a *bundle*, and unpacked on the other side::

    bundle = manifest length (8 bytes) | manifest (JSON, padded) | leaf 0 | leaf 1 | ...

The manifest is JSON (nothing read from the network is unpickled): the value's structure
(``torch.utils._pytree``'s spec of tuples, lists, dicts and their keys) and, per tensor
leaf, its dtype, shape and offset; each leaf starts on a 16-byte boundary, so it is viewed
in place. Gradients travel back the same way, with the same structure: a floating leaf's
gradient (zeros when it had none), an empty tensor for a leaf that takes none (integer
masks, positions). Every leaf must be a tensor: anything else (a Python number, a string)
is refused in one line naming it, since it cannot move between ranks as bytes.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.utils._pytree as pytree

from disttrain.parallel.pipeline.wire import DTYPES, MAX_NDIM, PipelineError

_ALIGN = 16
_NAMES = {dtype: str(dtype).removeprefix("torch.") for dtype in DTYPES}
_BY_NAME = {name: dtype for dtype, name in _NAMES.items()}


def is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def leaves(value: Any, what: str) -> tuple[list[torch.Tensor], Any]:
    """``value``'s tensor leaves and its structure; a one-line error for a leaf that is no
    tensor, or a tensor that cannot travel (too many dimensions, an unknown dtype)."""
    flat, spec = pytree.tree_flatten(value)
    for i, leaf in enumerate(flat):
        if not isinstance(leaf, torch.Tensor):
            raise PipelineError(f"{what} holds a {type(leaf).__name__} at leaf {i} of "
                                f"{pytree.treespec_dumps(spec)[:120]}: values between "
                                f"pipeline stages must be tensors, or tuples, lists or dicts "
                                f"of tensors")
        if leaf.dim() > MAX_NDIM or leaf.dtype not in DTYPES:
            raise PipelineError(f"{what}: leaf {i} of shape {tuple(leaf.shape)} and dtype "
                                f"{leaf.dtype} cannot travel (at most {MAX_NDIM} dimensions, "
                                f"dtypes {DTYPES})")
    return flat, spec


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def pack(flat: list[torch.Tensor], spec: Any, device: torch.device | str = "cpu"
         ) -> torch.Tensor:
    """One uint8 tensor on ``device`` holding ``flat`` (the leaves of a ``spec`` value)."""
    entries: list[list[Any]] = []
    offset = 0
    for leaf in flat:
        nbytes = leaf.numel() * leaf.element_size()
        entries.append([_NAMES[leaf.dtype], list(leaf.shape), offset, nbytes])
        offset = _up(offset + nbytes)
    manifest = json.dumps({"spec": pytree.treespec_dumps(spec), "leaves": entries}).encode()
    start = _up(8 + len(manifest))
    bundle = torch.zeros(start + offset, dtype=torch.uint8, device=device)
    head = torch.frombuffer(bytearray(len(manifest).to_bytes(8, "little") + manifest),
                            dtype=torch.uint8)
    bundle[:head.numel()].copy_(head)
    for leaf, (_, _, at, nbytes) in zip(flat, entries):
        if nbytes:
            bundle[start + at:start + at + nbytes].view(leaf.dtype).copy_(
                leaf.detach().reshape(-1))
    return bundle


def unpack(bundle: torch.Tensor, what: str) -> tuple[list[torch.Tensor], Any]:
    """The leaves (views into ``bundle``, detached) and the structure of a packed value;
    a malformed bundle is an error naming ``what``."""
    try:
        host = bundle[:8].cpu()
        length = int.from_bytes(bytes(host.tolist()), "little")
        manifest = json.loads(bytes(bundle[8:8 + length].cpu().tolist()).decode())
        spec = pytree.treespec_loads(manifest["spec"])
        start = _up(8 + length)
        flat = []
        for name, shape, at, nbytes in manifest["leaves"]:
            dtype = _BY_NAME[name]
            piece = bundle[start + at:start + at + nbytes]
            flat.append(piece.view(dtype).view(shape).detach())
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise PipelineError(f"received a malformed bundle as {what} ({exc}): the ranks run "
                            f"different versions") from exc
    return flat, spec


def build(flat: list[torch.Tensor], spec: Any) -> Any:
    """The value of structure ``spec`` with leaves ``flat``."""
    return pytree.tree_unflatten(flat, spec)


def gradients_of(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """What goes back for each input leaf: a floating leaf's gradient (zeros when it got
    none), an empty tensor for a leaf that takes no gradient (integers, booleans)."""
    return [(x.grad if x.grad is not None else torch.zeros_like(x)) if x.is_floating_point()
            else x.new_empty(0) for x in inputs]


def rows_of(value: Any) -> int:
    """The rows (dim 0) of a value's first tensor leaf: the micro-batch's size."""
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            return leaf.shape[0] if leaf.dim() else 0
    return 0


def split(batch: Any, microbatches: int) -> list[Any]:
    """``batch`` (a tensor or a tree of tensors with the same rows) cut into
    ``microbatches`` pieces along dim 0, each a value of the same structure."""
    flat, spec = pytree.tree_flatten(batch)
    pieces = [torch.tensor_split(leaf, microbatches) for leaf in flat]
    return [pytree.tree_unflatten([p[i] for p in pieces], spec) for i in range(microbatches)]


def concat(outputs: list[Any]) -> Any:
    """Micro-batch outputs of one structure joined along dim 0 (the batch's output)."""
    if all(isinstance(o, torch.Tensor) for o in outputs):
        return torch.cat(outputs)
    flats = [pytree.tree_flatten(o) for o in outputs]
    spec = flats[0][1]
    joined = [torch.cat([f[i] for f, _ in flats]) for i in range(len(flats[0][0]))]
    return pytree.tree_unflatten(joined, spec)
