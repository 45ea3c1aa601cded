"""What a run does to a model's blocks: activation checkpointing and ``torch.compile``.

A *block* is the repeated unit of a model: a transformer layer (disttrain's ``Block``, its
tensor-parallel ``ParallelBlock``, Hugging Face's GPT-2 and Llama layers, the
mixture-of-experts block) or, for other models, each child of the top-level chain that has
parameters. Both features act per block, on the module a strategy trains (the whole model,
a tensor-parallel shard, a pipeline stage), after the strategy built it:

* **Activation checkpointing** (``--activation-checkpointing``): a checkpointed block keeps
  only its input during forward and runs its forward again in backward to get what
  autograd needs (torch's non-reentrant ``checkpoint``, which works under every strategy's
  hooks). ``full`` checkpoints every block, ``selective`` every second one (torchtitan's
  layer-level selective checkpointing with frequency 2): about half the saved activations
  for about half the extra forward. Gradients are the same, bit for bit in float64, with
  or without it. A tensor-parallel block's forward runs its collectives again in backward
  (Megatron's full recomputation does too), so their bytes grow by the forward's share.
* **Compile** (``--compile``): each block is compiled in place (``nn.Module.compile``,
  TorchInductor by default), so the strategies' hooks, buffers and collectives around the
  blocks stay as they are; a collective inside a block (tensor parallelism) is a graph
  break. Refused in one line where it cannot work: ZeRO-3 swaps the parameters' storage
  in and out around each unit.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

MODES = ("none", "full", "selective")
_BLOCK_NAMES = ("Block", "ParallelBlock", "GPT2Block", "LlamaDecoderLayer", "MoEBlock",
                "ContextParallelBlock")


def blocks_of(module: nn.Module) -> list[nn.Module]:
    """The model's blocks (see the module doc), in order."""
    found = [m for m in module.modules() if type(m).__name__ in _BLOCK_NAMES]
    if found:
        return found
    layers: Any = getattr(module, "layers", None)
    chain = list(module.children()) if isinstance(module, (nn.Sequential, nn.ModuleList)) \
        else list(layers()) if callable(layers) else list(module.children())
    return [m for m in chain if any(True for _ in m.parameters())]


def apply_activation_checkpointing(module: nn.Module, mode: str = "full") -> int:
    """Checkpoint ``module``'s blocks in place: every one (``full``) or every second one
    (``selective``); returns how many. A block already checkpointed is left as it is."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing must be one of {', '.join(MODES)}, got "
                         f"{mode!r}")
    if mode == "none":
        return 0
    blocks = blocks_of(module)
    chosen = [blocks[i] for i in checkpointed(mode, len(blocks))]
    for block in chosen:
        if getattr(block, "_disttrain_checkpointed", False):
            continue
        forward = block.forward
        block.forward = functools.partial(_checkpointed, forward)  # type: ignore[method-assign]
        block._disttrain_checkpointed = True  # type: ignore[assignment]
    return len(chosen)


def checkpointed(mode: str, n_blocks: int) -> list[int]:
    """Which of ``n_blocks`` blocks ``mode`` checkpoints (0-based): all (``full``), every
    second one from the first (``selective``), none. Their forwards run twice, and so do
    the collectives inside them (the theory of tensor parallelism counts them)."""
    if mode == "none":
        return []
    return list(range(0, n_blocks, 2 if mode == "selective" else 1))


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def compile_blocks(module: nn.Module, backend: str = "inductor") -> int:
    """Compile ``module``'s blocks in place with ``torch.compile`` (``backend``: TorchInductor
    by default; ``aot_eager`` needs no C++ compiler); returns how many. disttrain's
    collectives inside a block (tensor, context and expert parallelism) run between the
    compiled graphs (:func:`communication_breaks_graphs`)."""
    communication_breaks_graphs()
    chosen = blocks_of(module)
    for block in chosen:
        block.compile(backend=backend)
    return len(chosen)


ENTRY_POINTS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "gather",
                "scatter", "all_to_all", "barrier", "isend", "irecv", "send", "recv",
                "connect")


def communication_breaks_graphs() -> None:
    """Make every :class:`~disttrain.comm.Communicator` entry point and ``Work.wait`` a
    graph break for ``torch.compile`` (once per process). Dynamo traces Python; disttrain's
    algorithms are Python over torch.distributed's process groups and sockets, which it
    cannot trace (it stops with an error inside them, or records a collective once and
    replays a different order of them). Marked here, they run eagerly between the compiled
    pieces, as torch's own c10d calls do. Done only when something is compiled: importing
    the compiler costs seconds, which a run without --compile should not pay."""
    from disttrain.comm import Communicator
    from disttrain.comm import work as work_module

    if getattr(Communicator, "_disttrain_graph_breaks", False):
        return
    for name in ENTRY_POINTS:
        setattr(Communicator, name, torch.compiler.disable(getattr(Communicator, name)))
    for cls in vars(work_module).values():
        if isinstance(cls, type) and issubclass(cls, work_module.Work) and "wait" in vars(cls):
            cls.wait = torch.compiler.disable(cls.wait)  # type: ignore[method-assign]
    Communicator._disttrain_graph_breaks = True  # type: ignore[attr-defined]
