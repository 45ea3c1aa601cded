"""What a strategy is: the object the shared loop drives, and what a builder receives.

The loop is the same for every strategy; a :class:`Strategy` owns what differs:

* **one step**: ``train_step`` (forward, backward, gradient sync, update). The default runs
  ``model`` on each micro-batch and calls ``optimizer.zero_grad()`` / ``step()``: anything
  with those two methods is an optimizer here (ZeRO's wrappers stand in for one);
* **which data this rank reads**: ``dp_rank`` / ``dp_size`` pick the sampler's shard (all
  stages of one pipeline read the same shard);
* **evaluation**: ``predict`` (the ranks holding the output return it, others None) and
  ``combine_scores`` (sum the scores of the data-parallel shards on every rank);
* **checkpoints**: ``save_state`` / ``load_state`` write and read this strategy's files;
* **measurements**: the communicators whose traffic counts, the theoretical bytes of a
  step, and strategy-specific ``extras`` for the benchmark table.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel.checkpoint_files import atomic_save
from disttrain.parallel.checkpoint_files import load as safe_load
from disttrain.parallel.mixed_precision import accumulate
from disttrain.parallel.universal import Layout, Split
from disttrain.train.clipping import squares
from disttrain.train.config import TrainConfig

Batch = tuple[Any, Any]  # (inputs, targets)
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Autocast = Callable[[], AbstractContextManager[Any]]
OptimizerFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]


class Stepper(Protocol):
    """What the loop needs of an optimizer: a torch optimizer, or a ZeRO wrapper."""

    def zero_grad(self, set_to_none: bool = ...) -> None: ...

    def step(self) -> Any: ...


def optimizer_class(config: TrainConfig) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The configured optimizer class and its keyword arguments (torch-zero1 wraps the class;
    the parameter servers and DeepSpeed build theirs from it, so they take no parameter
    groups: ``--no-decay-norms-biases`` is refused there)."""
    if config.no_decay_norms_biases:
        raise ValueError(f"--no-decay-norms-biases: strategy {config.strategy!r} builds its "
                         f"optimizer from the class alone, without parameter groups; drop the "
                         f"flag or use one of disttrain's data, pipeline or mesh strategies")
    return _class_and_options(config)


def _class_and_options(config: TrainConfig
                       ) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    if config.optimizer == "sgd":
        return torch.optim.SGD, {"lr": config.lr, "momentum": config.momentum,
                                 "weight_decay": config.weight_decay}
    cls = torch.optim.Adam if config.optimizer == "adam" else torch.optim.AdamW
    return cls, {"lr": config.lr, "weight_decay": config.weight_decay}


def norms_biases_groups(params: Iterable[torch.Tensor]) -> list[dict[str, Any]]:
    """The usual recipe's two parameter groups (GPT-2 as nanoGPT trains it, Megatron-LM):
    the matrices (linear and embedding weights) at the optimizer's weight decay, and the
    parameters of fewer than two dimensions (biases, LayerNorm and other norm weights) at
    none. The rule reads each tensor's shape alone, so it splits a tensor-parallel slice, a
    pipeline stage's parameters or torch FSDP's sharded tensors as it splits the whole model,
    and every strategy trains the same groups."""
    listed = list(params)
    return [{"params": [p for p in listed if p.dim() >= 2]},
            {"params": [p for p in listed if p.dim() < 2], "weight_decay": 0.0}]


def optimizer_factory(config: TrainConfig) -> OptimizerFactory:
    """Build the configured optimizer over some tensors (a strategy decides which); with
    ``no_decay_norms_biases`` over :func:`norms_biases_groups` of them. Given parameter
    groups already (dicts: ZeRO passes its slices by group), it takes them as they are."""
    cls, kwargs = _class_and_options(config)

    def make(params: Iterable[Any]) -> torch.optim.Optimizer:
        listed = list(params)
        if config.no_decay_norms_biases and not any(isinstance(p, dict) for p in listed):
            listed = norms_biases_groups(listed)
        return cls(listed, **kwargs)

    return make


@dataclass(frozen=True)
class BuildContext:
    """Everything a builder gets: the freshly built model (identical on every rank), the
    communicator, the optimizer factory, the config, and the first training samples (the
    local batch of step one, the same on every rank: for ``partition="time"`` and for
    measuring activation sizes)."""

    module: nn.Module
    comm: Communicator | None
    make_optimizer: OptimizerFactory
    config: TrainConfig
    sample: Batch

    def param_groups(self, module: nn.Module) -> list[dict[str, Any]] | None:
        """The parameter groups a ZeRO wrapper of ``module`` takes (its optimizer sees flat
        shards, not the parameters ``make_optimizer`` would group): the recipe's groups
        with ``no_decay_norms_biases``, else None (one group)."""
        if not self.config.no_decay_norms_biases:
            return None
        return norms_biases_groups(p for p in module.parameters() if p.requires_grad)

    def require_comm(self, name: str) -> Communicator:
        if self.comm is None:
            raise ValueError(f"strategy {name!r} needs a communicator (run it under "
                             f"'disttrain run -n N' or pass comm=...)")
        return self.comm


def placed_like(module: nn.Module, like: nn.Module) -> nn.Module:
    """``module`` moved to the device and dtype of ``like``'s parameters: a model rebuilt
    from a shard's state keeps the shard's placement (a float64 run stays float64)."""
    param = next(like.parameters(), None)
    return module if param is None else module.to(param.device, param.dtype)


def writes_once(lead: bool, tp_rank: int) -> Callable[[str, Split | None], bool]:
    """Who writes a parameter into the universal checkpoint: ``lead`` (the first replica
    of this rank's part, over dp and cp), and of a tensor-parallel group every rank its
    split parameters but only tp rank 0 the ones each holds whole (LayerNorms, biases)."""
    return lambda name, split: lead and (split is not None or tp_rank == 0)


def missing_state(path: str, what: str) -> ValueError:
    return ValueError(f"checkpoint {path} has no {what}: it was written by another strategy "
                      f"or rank layout; resume with the strategy and settings that wrote it")


class PhaseRecorder:
    """Wall-clock spans ``(name, start, end)`` of a step's compute phases (``forward``,
    ``backward``, ``optimizer``; ``train_step`` for strategies whose step is one call), for
    timelines. The loop hands one to the strategy (``strategy.phases``); without one,
    :meth:`Strategy.phase` is a ``nullcontext`` and costs nothing. ``communicators`` is filled
    by the loop with the strategy's communicators, whose flight recorders hold the
    collectives."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, float, float]] = []
        self.communicators: list[Communicator] = []

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        start = time.time()  # the wall clock, like the flight recorder's times
        try:
            yield
        finally:
            self.spans.append((name, start, time.time()))

    def drain(self) -> list[tuple[str, float, float]]:
        """The spans recorded since the last drain."""
        spans, self.spans = self.spans, []
        return spans


class Strategy:
    """Plain training on this rank; parallel strategies swap in a wrapped ``model`` and
    override what differs.

    ``module`` is the bare model (or this rank's part of it); ``model`` is what forward calls.
    """

    counts_bytes = True  # comm.stats sees this strategy's traffic
    theory_bytes_per_step: float | None = None  # what one step should send from this rank
    phases: PhaseRecorder | None = None  # set by the loop when a timeline is recorded
    scaler: Any = None  # fp16: the loop's LossScaler (use_loss_scaler), else None

    def __init__(self, module: nn.Module, optimizer: Stepper | None,
                 comm: Communicator | None, model: nn.Module | None = None) -> None:
        self.module = module
        self.model: nn.Module = model if model is not None else module
        self.optimizer = optimizer
        self.comm = comm

    # ------------------------------------------------------------------ data
    @property
    def dp_rank(self) -> int:
        """This rank's index among the ranks that read different data."""
        return self.comm.rank if self.comm is not None else 0

    @property
    def dp_size(self) -> int:
        """How many ranks read different shards of each global batch."""
        return self.comm.world_size if self.comm is not None else 1

    # ------------------------------------------------------------------ training
    def phase(self, name: str) -> AbstractContextManager[Any]:
        """A span named ``name`` in the timeline when one is recorded, else nothing."""
        return self.phases.span(name) if self.phases is not None else nullcontext()

    def no_sync(self) -> AbstractContextManager[Any]:
        """Skip gradient synchronization (all micro-batches but the last of a step)."""
        return nullcontext()

    def train_step(self, micro_batches: Sequence[Batch], loss_fn: LossFn,
                   autocast: Autocast) -> torch.Tensor:
        """One optimizer step over this rank's micro-batches; returns the mean loss (detached).

        Each micro-batch loss is divided by their count, so accumulated gradients equal the
        gradient of the mean loss over this rank's share of the global batch.
        """
        self.model.train()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        total: torch.Tensor | None = None
        last = len(micro_batches) - 1
        for i, (inputs, targets) in enumerate(micro_batches):
            with self.no_sync() if i < last else nullcontext():
                with self.phase("forward"), autocast():
                    loss = loss_fn(self.model(inputs), targets) / len(micro_batches)
                with self.phase("backward"):  # with DDP, includes the gradient sync
                    (loss if self.scaler is None else self.scaler.scale(loss)).backward()
            total = accumulate(total, loss)
        self.before_update()
        if self.optimizer is not None:
            with self.phase("optimizer"):
                self.optimizer.step()  # fp16: through the scaler (use_loss_scaler)
        elif self.scaler is not None:
            self.scaler.no_step()
        return total if total is not None else torch.zeros(())

    def block_module(self) -> nn.Module:
        """The module whose blocks each forward runs (what --activation-checkpointing and
        --compile wrap): the trained module, unless the strategy runs it through another
        (context parallelism runs its own blocks around the model's layers)."""
        return self.module

    def before_update(self) -> None:
        """After the last micro-batch's backward, before the update: what a strategy still
        does to the gradients (expert parallelism averages them over its group)."""

    def use_loss_scaler(self, scaler: Any) -> None:
        """fp16 training: every loss is multiplied by ``scaler``'s scale before backward, and
        the update goes through it (a :class:`~disttrain.parallel.mixed_precision.LossScaler`
        attached to :meth:`update_optimizer`: gradients unscaled, the step skipped on every
        rank when any rank's overflowed)."""
        self.scaler = scaler
        optimizer = self.update_optimizer()
        if optimizer is not None:
            scaler.attach(optimizer)

    clipper: Any = None  # --clip-grad-norm: a GradClipper (train/clipping.py), else None

    def use_grad_clipping(self, clipper: Any) -> None:
        """Clip the gradients to a global norm before every update: ``clipper`` (a
        :class:`~disttrain.train.clipping.GradClipper`) runs as a pre-hook of
        :meth:`update_optimizer`, after the loss scaler's (attach it after fp16's)."""
        self.clipper = clipper
        optimizer = self.update_optimizer()
        if optimizer is not None:
            clipper.attach(optimizer)

    def grad_norm_share(self) -> tuple[torch.Tensor, Communicator | None]:
        """What this rank alone holds of the squared norm of the whole model's gradient,
        and the group over which the ranks' shares add up (None: this rank holds all of
        it). By default the module's gradients, whole on every rank (one process, DDP's
        identical replicas); train/clipping.py lists the others."""
        return squares(self.module.parameters()), None

    def update_optimizer(self) -> torch.optim.Optimizer | None:
        """The torch optimizer whose ``step()`` applies this rank's update (None: there is
        none here); a strategy whose optimizer is a wrapper (ZeRO) returns the inner one."""
        return self.optimizer if isinstance(self.optimizer, torch.optim.Optimizer) else None

    def after_step(self) -> None:
        """Called after every step, outside its timing (collect per-step measurements)."""

    # ------------------------------------------------------------------ evaluation
    eval_min_rows = 1  # fewest samples one predict() call accepts (pipelines: micro-batches)
    collective_eval = False  # predict() runs collectives: every rank needs as many batches

    @property
    def eval_shards(self) -> int:
        """How many shards the held-out split is scored in (``combine_scores`` sums them)."""
        return self.dp_size

    @property
    def eval_shard(self) -> int:
        """The shard this rank scores."""
        return self.dp_rank

    def before_eval(self) -> None:
        """Called on every rank before an evaluation (e.g. gather what predict needs)."""

    def eval_modules(self) -> list[nn.Module]:
        """Modules to switch to eval mode while evaluating."""
        return [self.module]

    def predict(self, inputs: Any) -> torch.Tensor | None:
        """The model's output for ``inputs`` on the ranks that hold it, else None."""
        output: torch.Tensor = self.module(inputs)
        return output

    def combine_scores(self, totals: torch.Tensor) -> torch.Tensor:
        """Sum per-shard ``(correct, count, loss_sum)`` over the data-parallel ranks."""
        if self.comm is not None and self.dp_size > 1:
            self.comm.all_reduce(totals)
        return totals

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"{type(self).__name__} must override state_dict: its optimizer "
                            f"is not a torch optimizer")
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        if isinstance(self.optimizer, torch.optim.Optimizer):
            self.optimizer.load_state_dict(state["optimizer"])

    def checkpoint_layout(self) -> Layout | None:
        """What this rank holds of the model's state, for the universal checkpoint
        (:mod:`disttrain.parallel.universal`): by default the module's parameters whole,
        written by data-parallel rank 0 (the replicas hold the same). None: the strategy
        writes ``state.pt`` instead (a baseline whose tensors or optimizer are torch's or
        DeepSpeed's own: DTensors, an engine)."""
        from disttrain.parallel import universal

        optimizer = self.optimizer if isinstance(self.optimizer, torch.optim.Optimizer) else None
        if (optimizer is None and self.optimizer is not None) or any(
                type(p.data) is not torch.Tensor for p in self.module.parameters()):
            return None
        lead = self.dp_rank == 0
        return universal.module_layout(self.module.named_parameters(), optimizer,
                                       buffers=universal.persistent_buffers(self.module),
                                       writes=lambda name, split: lead,
                                       model_config=universal.model_config(self.module))

    def save_state(self, path: str, rank: int) -> None:
        """Write this strategy's state into the checkpoint directory ``path``: every rank
        its share of the universal checkpoint (``path/universal``, which any strategy on
        any number of ranks loads), or rank 0 ``state.pt`` where there is no layout."""
        from disttrain.parallel import universal

        layout = self.checkpoint_layout()
        if layout is not None:
            universal.save(os.path.join(path, universal.DIRECTORY), layout, rank)
        elif rank == 0:
            atomic_save(self.state_dict(), os.path.join(path, "state.pt"))

    def load_state(self, path: str, rank: int) -> None:
        """Read this rank's share of the state from ``path``: the universal checkpoint, or
        ``state.pt`` (what this strategy wrote before the universal format, or where it has
        no layout)."""
        from disttrain.parallel import universal

        directory = os.path.join(path, universal.DIRECTORY)
        layout = self.checkpoint_layout()
        if layout is not None and universal.is_universal(directory):
            universal.load(directory, layout)
            return
        file = os.path.join(path, "state.pt")
        if not os.path.exists(file):
            raise missing_state(path, "state.pt")
        self.load_state_dict(safe_load(file))

    # ------------------------------------------------------------------ measurements
    def result_comm(self) -> Communicator | None:
        """The communicator the loop gathers the result over and writes the final checkpoint
        with when not the loop's own (None): one over the ranks that finish the run, for a
        strategy that went on without some (a parameter server that outlived a worker)."""
        return None

    def communicators(self) -> list[Communicator]:
        """Every communicator this strategy sends through (their stats are summed)."""
        return [self.comm] if self.comm is not None else []

    def extras(self, warmup_steps: int) -> dict[str, Any]:
        """Strategy-specific measurements for the benchmark (JSON-friendly values)."""
        return {}

    # the ZeRO paper's model-state formula that applies: 0 (replicated, DDP) or stage 1-3;
    # None: none does (pipelines, servers, tensor parallelism)
    zero_stage: int | None = None

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor this rank keeps for the model's state, by category (``params``,
        ``grads``, ``optimizer``); :mod:`disttrain.train.memory` counts each storage once.
        By default the module's parameters and gradients and a torch optimizer's tensors;
        strategies that shard or keep copies elsewhere override it."""
        from disttrain.train.memory import optimizer_tensors

        params: list[torch.Tensor] = list(self.module.parameters())
        return {"params": params, "grads": [p.grad for p in params if p.grad is not None],
                "optimizer": optimizer_tensors(self.optimizer)}

    def trained_module(self) -> nn.Module:
        """The trained bare module for the result (called once, after the last step)."""
        return self.module

    def close(self) -> None:
        """Release wrappers and communication state (called once, at the end of training)."""


def ring_all_reduce_bytes(world_size: int, nbytes: float) -> float:
    """Bytes each rank sends in a bandwidth-optimal all-reduce (ring, or halving-doubling on
    a power of two): 2(p−1)/p of the buffer (reduce-scatter, then all-gather)."""
    return 2 * (world_size - 1) / world_size * nbytes if world_size > 1 else 0.0


def param_bytes(module: nn.Module) -> int:
    """Bytes of the trainable parameters (what a gradient all-reduce moves)."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
