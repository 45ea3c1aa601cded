"""ZeRO stages 1-3 (:mod:`disttrain.parallel.zero`) in the shared loop: ``zero1``, ``zero2``,
``zero3``.

The wrapper stands in for the optimizer (the loop only calls ``zero_grad(set_to_none=True)``
and ``step()``). Forward runs on the plain module in stages 1 and 2 (its parameters are views
of the wrapper's flat buffer) and on the wrapper in stage 3, whose module holds empty
placeholders outside forward: evaluation calls the wrapper too. Checkpoints are
universal (each rank writes its shard's pieces by parameter name and offsets:
:mod:`disttrain.parallel.zero.checkpoint`), so a run saved on N ranks resumes on M, under
another stage or under any other strategy.

Bytes per rank per step, with P the padded flat size (every group's shards are equal), for
a ring: stage 1 reduce-scatters and all-gathers once per step, (p−1)/p·P·(b_reduce +
b_param), what a ring all-reduce moves; stage 2 reduce-scatters during each micro-batch's
backward; stage 3 also gathers every unit twice per micro-batch (forward and backward),
1.5× DDP. Other algorithms send their own figure (:meth:`ZeroStrategy._theory`).
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel.universal import Layout
from disttrain.train.strategies.base import BuildContext, Strategy, missing_state

ZERO_DIR = "zero"  # what a loop checkpoint held before the universal format


def _element(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


class ZeroStrategy(Strategy):
    """One ZeRO stage; ``zero`` is the wrapper (also the loop's optimizer)."""

    def __init__(self, ctx: BuildContext, stage: int, comm: Communicator | None = None, *,
                 replicate: Communicator | None = None) -> None:
        """ZeRO stage ``stage`` over ``comm`` (default: every rank); ``replicate``: hybrid
        sharding, ``comm`` the shard group and ``replicate`` the ranks holding the same
        shard (:func:`~disttrain.parallel.zero.zero_groups`)."""
        from disttrain.parallel.zero import MetaInit, ZeRO1, ZeRO2, ZeRO3, ZeroConfig

        comm = comm if comm is not None else ctx.require_comm(ctx.config.strategy)
        self.replicate = replicate
        algorithm = ctx.config.parallel.algorithm
        on_meta = any(p.is_meta for p in ctx.module.parameters())  # --meta-init
        if algorithm is not None and not on_meta:
            # ZeroConfig.algorithm applies to every call, including the initial broadcast,
            # which has no ring algorithm: broadcast here with the default, then skip theirs
            with torch.no_grad():
                for param in ctx.module.parameters():
                    for group in (comm, replicate):
                        if group is not None and group.world_size > 1:
                            group.broadcast(param.data, 0)
        config = ZeroConfig(algorithm=algorithm,
                            broadcast_from_rank0=algorithm is None and not on_meta)
        wrapper: ZeRO1 | ZeRO2 | ZeRO3
        kind = ZeRO1 if stage == 1 else ZeRO2 if stage == 2 else ZeRO3
        # on the meta device: each module's own initialiser, from the seed every rank shares
        init = MetaInit(device=ctx.sample[0].device) if on_meta else None
        wrapper = kind(ctx.module, comm, ctx.make_optimizer, config, replicate=replicate,
                       meta_init=init, param_groups=ctx.param_groups(ctx.module))
        model = wrapper if isinstance(wrapper, nn.Module) else ctx.module
        super().__init__(ctx.module, wrapper, comm, model)
        self.zero, self.meta_init = wrapper, on_meta
        self.stage = stage
        self.collective_eval = stage == 3  # forward gathers parameters: a collective
        self.zero_stage = stage
        self.theory_bytes_per_step = self._theory(ctx.config.accumulate)

    @property
    def dp_rank(self) -> int:
        """Hybrid: rank = replica · S + shard, the mesh's order (:mod:`~disttrain.parallel.
        zero.hybrid`); plain: the rank in the group."""
        shard = self.zero.comm
        if self.replicate is None:
            return shard.rank
        return self.replicate.rank * shard.world_size + shard.rank

    @property
    def dp_size(self) -> int:
        replicas = self.replicate.world_size if self.replicate is not None else 1
        return self.zero.comm.world_size * replicas

    def combine_scores(self, totals: torch.Tensor) -> torch.Tensor:
        """Summed over every data-parallel rank: the shard group, then the replicas."""
        for group in (self.zero.comm, self.replicate):
            if group is not None and group.world_size > 1:
                group.all_reduce(totals)
        return totals

    def communicators(self) -> list[Communicator]:
        groups = [self.zero.comm, self.replicate, self.comm]
        unique = {id(c): c for c in groups if c is not None}
        return list(unique.values())

    def _theory(self, accumulate: int) -> float:
        """Per step: one reduce-scatter of the padded gradients (stage 2 and 3: one per
        micro-batch) and one all-gather of the parameters (stage 3: two per micro-batch),
        each at the bytes of the algorithm the communicator runs for it (a ring: (p−1)/p
        of the buffer; ``shm``: what the rank writes, the whole buffer to reduce-scatter
        and its shard to gather)."""
        if self.replicate is not None:  # both communicators' figures
            from disttrain.parallel.zero import step_bytes

            sent_by = step_bytes(self.zero, accumulate)
            return sent_by.intra + sent_by.inter
        comm, algorithm = self.zero.comm, self.zero.config.algorithm
        padded = sum(g.layout.padded_total for g in self.zero.shard_groups())
        red, par = _element(self.zero.reduce_dtype), _element(self.zero.param_dtype)

        def sent(op: str, nbytes: int) -> float:
            theory = comm.theory_bytes_sent(op, nbytes, algorithm)  # None: native
            return (comm.world_size - 1) / comm.world_size * nbytes if theory is None else (
                theory)

        scatter, gather = sent("reduce_scatter", padded * red), sent("all_gather", padded * par)
        if self.stage == 1:
            return scatter + gather
        if self.stage == 2:
            return scatter * accumulate + gather
        return (scatter + 2 * gather) * accumulate

    def no_sync(self) -> AbstractContextManager[Any]:
        return self.zero.no_sync()

    def grad_norm_share(self) -> tuple[torch.Tensor, Communicator | None]:
        """This rank's shard of the reduced gradient (disjoint shards, summed over dp)."""
        from disttrain.train.clipping import squares

        params = [p for g in self.zero.optimizer.param_groups for p in g["params"]]
        return squares(params), self.zero.comm

    def update_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer of this rank's shard: fp16's scaler checks the reduced shard
        gradient there, between the reduce-scatter and the update."""
        return self.zero.optimizer

    def predict(self, inputs: Any) -> torch.Tensor | None:
        output: torch.Tensor = self.model(inputs)  # stage 3: the wrapper gathers each layer
        return output

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_layout(self) -> Layout:
        """Each rank its master shard's pieces (a hybrid run: the first replica's)."""
        from disttrain.parallel.zero import checkpoint

        return checkpoint.layout(self.zero)

    def load_state(self, path: str, rank: int) -> None:
        """The universal checkpoint, written under any strategy; or ``zero/`` (ZeRO's own
        format before it, resharded as well)."""
        from disttrain.parallel import universal, zero
        from disttrain.parallel.zero import checkpoint

        directory = os.path.join(path, universal.DIRECTORY)
        if universal.is_universal(directory):
            checkpoint.read_into(self.zero, directory)
            return
        directory = os.path.join(path, ZERO_DIR)
        if not os.path.exists(os.path.join(directory, "zero.json")):
            raise missing_state(path, f"{universal.DIRECTORY}/ (a universal checkpoint)")
        zero.load(self.zero, directory)

    # ------------------------------------------------------------------ measurements
    def extras(self, warmup_steps: int) -> dict[str, Any]:
        """Model-state bytes this rank holds, measured from its tensors and by the ZeRO
        paper's formula for this stage, world size and precision."""
        from disttrain.parallel.zero import zero_formula, zero_measured

        out: dict[str, Any] = {"zero_stage": self.stage,
                               "model_state_bytes": zero_measured(self.zero).as_dict(),
                               "wrap_peak_bytes": self.zero.wrap_memory.peak_bytes,
                               "meta_init": self.meta_init}
        if self.replicate is not None:
            out.update(dp_shard=self.zero.comm.world_size,
                       dp_replicate=self.replicate.world_size)
        try:
            out["model_state_bytes_formula"] = zero_formula(self.zero).as_dict()
        except ValueError:  # an optimizer whose state size the formula does not know
            out["model_state_bytes_formula"] = None
        return out

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return self.zero.model_state_tensors()

    def trained_module(self) -> nn.Module:
        """Stage 3: gather every parameter once more, detach the wrapper and give the module
        its full parameters back (the result's model; needs the whole model's memory)."""
        from disttrain.parallel.zero import ZeRO3

        if isinstance(self.zero, ZeRO3):
            with self.zero.gathered():
                full = {n: p.detach().clone() for n, p in self.module.named_parameters()}
            self.zero.remove_hooks()
            for name, param in self.module.named_parameters():
                param.data = full[name]
        return self.module

    def close(self) -> None:
        remove = getattr(self.zero, "remove_hooks", None)
        if remove is not None:
            remove()
