"""Expert parallelism in the shared loop: ``ep`` (``--ep``; the rest of the ranks are
data-parallel replicas), the composer's step after tensor and context parallelism.

Each mixture-of-experts layer's experts are cut to this rank's E/ep
(:func:`~disttrain.parallel.experts.apply_expert_parallel`); the ranks of an ep group read
different data (ep is carved out of data parallelism), so the sampler shards by the
coordinate along (dp, ep). After backward the replicated gradients are averaged over ep
and the expert gradients divided by ep (:func:`~disttrain.parallel.experts.
finish_gradients`), DDP over dp completing both; every forward is a collective over ep
(evaluation too). The load-balancing loss joins the loss in the loop (as for one process).

Bytes per rank per step: the all-to-alls of the rows each layer moved in this step's
forwards and backwards, and the replicated gradients' all-reduce over ep
(:func:`~disttrain.parallel.experts.step_bytes`), plus DDP's ring over dp; routing decides
the rows, so the theory is the mean over the steps that ran, as the measurement is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from disttrain.comm import Communicator
from disttrain.parallel import DataParallel
from disttrain.parallel.experts import (
    apply_expert_parallel,
    drain_traffic,
    finish_gradients,
    step_bytes,
)
from disttrain.parallel.mesh import DeviceMesh
from disttrain.parallel.universal import Layout
from disttrain.train.strategies.base import (
    Autocast,
    Batch,
    BuildContext,
    LossFn,
    Strategy,
    param_bytes,
    ring_all_reduce_bytes,
)
from disttrain.train.strategies.mesh import MeshSettings


class ExpertParallelStrategy(Strategy):
    """This rank's experts (and a replica of everything else), DDP over the mesh's dp."""

    collective_eval = True  # every forward is an all-to-all over the ep group

    def __init__(self, ctx: BuildContext, mesh: DeviceMesh, settings: MeshSettings) -> None:
        self.mesh, self.algorithm = mesh, settings.algorithm
        self._skeleton = _empty_copy(ctx.module)  # the one-process model, filled at the end
        # the all-to-alls pairwise (exact bytes, safe under NCCL's rules), unless native
        a2a = "native" if settings.algorithm == "native" else "naive"
        module = apply_expert_parallel(ctx.module, mesh.ep, algorithm=a2a)
        model = DataParallel(module, mesh.dp, algorithm=settings.algorithm) \
            if mesh.dp is not None else module
        super().__init__(module, ctx.make_optimizer(module.parameters()), ctx.comm, model)
        self._dp_bytes = ring_all_reduce_bytes(mesh.dp_size, param_bytes(module))
        self._theory: list[float] = []
        self.theory_bytes_per_step = None  # known after the first step (routing)
        # the replicated gradients' all-reduce over ep: unseen when it runs natively; and
        # no figure under activation checkpointing, whose recomputed forwards send some of
        # their all-to-alls again (which ones depends on where torch stops recomputing)
        self._observed = mesh.ep.theory_bytes_sent("all_reduce", 1 << 20,
                                                   settings.algorithm) is not None and (
            ctx.config.activation_checkpointing == "none")

    @property
    def dp_rank(self) -> int:
        return self.mesh.coord(("dp", "ep"))  # ep ranks read different shards

    @property
    def dp_size(self) -> int:
        return self.mesh.size(("dp", "ep"))

    def no_sync(self) -> Any:
        sync: Any = getattr(self.model, "no_sync", None)
        return sync() if self.mesh.dp is not None and sync is not None else super().no_sync()

    def train_step(self, micro_batches: Sequence[Batch], loss_fn: LossFn,
                   autocast: Autocast) -> torch.Tensor:
        drain_traffic(self.module)  # an evaluation's rows are no step's
        loss = super().train_step(micro_batches, loss_fn, autocast)
        moved = drain_traffic(self.module)
        if not self._observed:
            return loss
        self._theory.append(step_bytes(self.module, moved, self.mesh.ep_rank,
                                       algorithm=self.algorithm or "ring") + self._dp_bytes)
        self.theory_bytes_per_step = sum(self._theory) / len(self._theory)
        return loss

    def before_update(self) -> None:
        finish_gradients(self.module, self.mesh.ep, algorithm=self.algorithm)

    def communicators(self) -> list[Communicator]:
        return self.mesh.communicators()

    def checkpoint_layout(self) -> Layout:
        """This rank's experts, written by the first dp replica of each ep rank, and what
        every ep rank holds whole, written by ep rank 0 of it: the one-process model's
        names, so any strategy reads it."""
        from disttrain.parallel import universal
        from disttrain.parallel.experts import ExpertParallelExperts

        experts = {f"{prefix}.{name}" for prefix, sub in self.module.named_modules()
                   if isinstance(sub, ExpertParallelExperts)
                   for name, _ in sub.named_parameters()}
        lead, first = self.mesh.dp_rank == 0, self.mesh.ep_rank == 0
        return universal.module_layout(
            self.module.named_parameters(), self.update_optimizer(),
            buffers=universal.persistent_buffers(self.module),
            writes=lambda name, split: lead and (first or name in experts))

    def trained_module(self) -> torch.nn.Module:
        """The one-process model: every expert gathered under its own name (a collective;
        it needs the whole model's memory)."""
        from disttrain.parallel.experts import full_state_dict

        state = full_state_dict(self.module, self.mesh.ep)
        for name, tensor in [*self._skeleton.named_parameters(),
                             *self._skeleton.named_buffers()]:
            tensor.data = state[name].detach().clone()
        return self._skeleton

    def extras(self, warmup_steps: int) -> dict[str, Any]:
        return {"dp_size": self.mesh.dp_size, "ep_size": self.mesh.size("ep")}


def _empty_copy(module: torch.nn.Module) -> torch.nn.Module:
    """``module``'s structure with empty tensors (it costs no memory until filled)."""
    import copy

    skeleton = copy.deepcopy(module)
    for tensor in [*skeleton.parameters(), *skeleton.buffers()]:
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return skeleton
