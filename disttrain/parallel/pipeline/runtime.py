"""The pipeline runtime: this rank's stage, executing its schedule's actions one by one
(what it is asked to do and what it measures: :mod:`.config`; one step's interpreter:
:mod:`.step`).

``train_step`` on every rank::

    split the batch into m micro-batches        (inputs on stage 0, targets on the last)
    for action in schedule.actions(stage):      RecvAct / Forward / SendAct /
        run it (on the chunk it names)          RecvGrad / Backward / SendGrad
    return the loss                             (it came back with the gradients)
    average gradients over the dp group         (pp × dp grid; nothing when dp = 1; a
                                                 failed stage still takes part, with a
                                                 flag, so its copies raise too)

then the caller runs an ordinary ``optimizer.step()`` on the stage's own parameters.

The last stage computes ``loss_fn(output, target)`` per micro-batch, scaled by the
micro-batch's share of the batch (1/m for equal pieces), and backward accumulates into
``.grad``: the summed gradients equal the full-batch gradient of the mean loss, so a
pipeline step is the same update as one step on the whole batch (the equivalence tests
check this for every schedule). ``loss_fn`` must return the mean over its micro-batch.
Layers whose output depends on the rest of the batch (BatchNorm) or on random numbers
(dropout) differ from the unsplit model, as in every micro-batching pipeline.

**Virtual stages** (``virtual_stages=v``, interleaved 1F1B): the model is cut into p·v
pieces and rank r holds pieces r, r + p, r + 2p, … as its v chunks::

    p = 2, v = 2:   rank 0: piece 0, piece 2      activations 0 → 1 → 0 → 1 (the wrap:
                    rank 1: piece 1, piece 3      rank 1 back to rank 0), gradients back

so each micro-batch goes round the ranks v times, and the bubble shrinks to
(p − 1)/(v·m + p − 1) for v times as many messages (Narayanan et al. 2021).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel.mesh import DeviceMesh, MeshShape, build_mesh
from disttrain.parallel.pipeline import bundle
from disttrain.parallel.pipeline import partition as part
from disttrain.parallel.pipeline.collectives import agreed_balance, all_reduce_gradients
from disttrain.parallel.pipeline.config import (
    PipelineConfig,
    PipelineTotals,
    StepStats,
    split_batch,
)
from disttrain.parallel.pipeline.link import (
    EVAL,
    Direction,
    PipelineError,
    StageFailedError,
    StageLink,
)
from disttrain.parallel.pipeline.schedules import SCHEDULES, get_schedule
from disttrain.parallel.pipeline.stage import Stage, device_of
from disttrain.parallel.pipeline.step import StepRun, begin_step, received, send_value

log = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PipelineParallel:
    """One stage of a pipeline (and, in a pp × dp grid, one replica of that stage).

    Build it with :func:`build_pipeline`. On every rank call
    ``loss = pipe.train_step(inputs, targets, loss_fn)`` (stage 0 needs ``inputs``, the last
    stage ``targets``; others may pass None), then ``optimizer.step()`` over
    ``pipe.parameters()``. Gradients accumulate like ordinary backward: zero them between
    steps.
    """

    def __init__(self, module: nn.Sequential | Sequence[nn.Sequential], mesh: DeviceMesh,
                 config: PipelineConfig, balance: Sequence[int] | None = None,
                 device: torch.device | None = None, names: Sequence[str] | None = None
                 ) -> None:
        self.mesh = mesh
        # each layer's name in the whole model, by its index (the stage module's child names)
        self.names = list(names) if names is not None else None
        self.config = config
        self.balance = tuple(balance) if balance is not None else None  # layers per piece
        self.stage = Stage(module, mesh.pp_rank, mesh.pp_size)  # module: one, or v chunks
        v = len(self.stage.chunks)
        self.link = (StageLink(mesh.pp, mesh.pp_rank, device, ring=v > 1)
                     if mesh.pp is not None else None)
        self.schedule = get_schedule(config.schedule, mesh.pp_size, config.microbatches, v)
        self.last_step: StepStats | None = None
        self.totals = PipelineTotals()
        self._call = 0
        self._failure: BaseException | None = None

    # ------------------------------------------------------------------ identity
    @property
    def module(self) -> nn.Sequential:
        """This stage's layers (all its chunks'), named by their index in the whole model."""
        return self.stage.module

    @property
    def chunks(self) -> list[nn.Sequential]:
        """The stage's model chunks: chunk c is virtual stage c·p + stage (one without
        virtual stages)."""
        return self.stage.chunks

    @property
    def stage_index(self) -> int:
        return self.mesh.pp_rank

    @property
    def num_stages(self) -> int:
        return self.mesh.pp_size

    @property
    def is_first(self) -> bool:
        return self.mesh.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.mesh.pp_rank == self.mesh.pp_size - 1

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Names as in the unsplit ``nn.Sequential`` (``"3.weight"``)."""
        return self.module.named_parameters()

    def _original(self, key: str) -> str:
        index, _, rest = key.partition(".")
        if self.names is None:
            return key
        return f"{self.names[int(index)]}.{rest}" if rest else self.names[int(index)]

    def named_module(self) -> nn.Module:
        """This stage's layers under their names in the whole model (``blocks.2`` is
        ``module.blocks[2]``-like): a module whose ``state_dict`` is :meth:`state_dict`."""
        if self.names is None:
            return self.module
        root = nn.Module()
        for key, layer in self.module.named_children():
            owner, *path = self._original(key).split(".")
            node = root
            for part_name in [owner, *path][:-1]:
                if not hasattr(node, part_name):
                    node.add_module(part_name, nn.Module())
                node = getattr(node, part_name)
            node.add_module(([owner, *path])[-1], layer)
        return root

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's parameters and buffers under their names in the whole model
        (``"blocks.2.fc.weight"``): the stages' dicts together are the model's."""
        return {self._original(k): v for k, v in self.module.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load this stage's part of ``state`` (the whole model's dict, or the stages'
        together, by the model's own names); other entries are for other stages. ``strict``:
        every key of this stage must be there."""
        mine = {}
        for key in self.module.state_dict():
            original = self._original(key)
            if original in state:
                mine[key] = state[original]
            elif strict:
                raise KeyError(f"stage {self.stage_index}: {original!r} is missing from the "
                               f"state dict")
        self.module.load_state_dict(mine, strict=strict)

    def __repr__(self) -> str:
        return (f"PipelineParallel(stage={self.stage_index}/{self.num_stages}, "
                f"dp_rank={self.mesh.dp_rank}/{self.mesh.dp_size}, "
                f"schedule={self.config.schedule!r}, microbatches={self.config.microbatches}, "
                f"virtual_stages={len(self.chunks)})")

    # ------------------------------------------------------------------ steps
    def _check_usable(self) -> None:
        if self._failure is not None:
            raise PipelineError(f"this pipeline failed in an earlier step and its stages are "
                                f"out of step: {self._failure}; build a new one") from None

    def _abort(self, exc: BaseException) -> None:
        self._failure = exc
        self.stage.clear()
        if self.link is not None:
            self.link.report_failure(exc)

    def train_step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None,
                   loss_fn: LossFn) -> float:
        """One step over the batch; returns the batch's mean loss on every rank (averaged
        over the dp replicas). Gradients are left in ``.grad`` for the optimizer."""
        self._check_usable()
        self._call += 1
        start = time.perf_counter()
        self.stage.reset_counters()
        try:
            loss = self._run_schedule(inputs, targets, loss_fn)
        except BaseException as exc:
            self._abort(exc)
            if isinstance(exc, Exception):  # not while being interrupted or terminated
                self._tell_replicas()
            raise
        reduce_start = time.perf_counter()
        if self.mesh.dp is not None:
            try:
                loss = self._reduce_over_replicas(loss)
            except BaseException as exc:
                self._abort(exc)
                raise
        end = time.perf_counter()
        self.last_step = StepStats(end - start, self.stage.busy_s, end - reduce_start,
                                   self.stage.peak_stashed, self.stage.peak_bytes,
                                   self.link.wait_s if self.link is not None else 0.0)
        self.totals.add(self.last_step)
        return loss

    def _run_schedule(self, inputs: torch.Tensor | None, targets: torch.Tensor | None,
                      loss_fn: LossFn) -> float:
        m = self.config.microbatches
        actions = self.schedule.actions(self.stage_index)
        if self.link is not None:  # first: a failure from here on can reach the neighbours
            begin_step(self.link, actions)
        xs = split_batch(inputs, m, "inputs") if self.is_first else None
        ys = split_batch(targets, m, "targets") if self.is_last else None
        run = StepRun(self.stage, self.link, self._call, xs, ys, loss_fn)
        run.execute(actions)
        loss = run.loss()
        if self.link is not None:
            self.link.flush()
        return loss

    def _reduce_over_replicas(self, loss: float) -> float:
        """Average gradients and loss over the copies of this stage; raise if a replica
        reported that its step failed (its gradients are missing: nothing is averaged)."""
        assert self.mesh.dp is not None
        failed = all_reduce_gradients(self.parameters(), self.mesh.dp)
        if failed:
            ranks = [self.mesh.dp.global_ranks[r] for r in failed]
            raise StageFailedError(
                f"stage {self.stage_index} of replica {self.mesh.dp_rank} stopped: the step "
                f"failed in replica(s) {failed} (stage {self.stage_index} there is rank(s) "
                f"{ranks}; the error is in the output of the rank that failed first), so the "
                f"gradients were not averaged", self.stage_index)
        return self._average_over_replicas(loss)

    def _tell_replicas(self) -> None:
        """Take part in this step's gradient all-reduce with a failure flag, so the copies
        of this stage in the other replicas raise instead of waiting for us."""
        if self.mesh.dp is None:
            return
        try:
            all_reduce_gradients(self.parameters(), self.mesh.dp, failed=True)
        except Exception as err:  # the original error matters more
            log.warning("stage %d of replica %d could not tell the other replicas that it "
                        "failed: %s", self.stage_index, self.mesh.dp_rank, err)

    def share_from_last(self, value: float) -> float:
        """The last stage's ``value`` (e.g. an accuracy computed from ``eval_forward``) on
        every rank, averaged over the dp replicas. A collective: every rank calls it."""
        t = torch.tensor([value if self.is_last else 0.0], dtype=torch.float64)
        if self.mesh.pp is not None:
            self.mesh.pp.broadcast(t, root=self.num_stages - 1)
        return self._average_over_replicas(float(t[0])) if self.mesh.dp else float(t[0])

    def _average_over_replicas(self, loss: float) -> float:
        assert self.mesh.dp is not None
        value = torch.tensor([loss], dtype=torch.float64)
        self.mesh.dp.all_reduce(value, "avg")
        return float(value[0])

    def eval_forward(self, inputs: torch.Tensor | None) -> torch.Tensor | None:
        """Forward only, micro-batch by micro-batch (chunk by chunk round the ring when the
        stages hold several); the last stage returns the whole batch's output, the other
        stages None."""
        self._check_usable()
        self._call += 1
        m, v, last = self.config.microbatches, len(self.chunks), self.stage.num_virtual - 1
        sends = sum(m for c in range(v) if self.stage.virtual(c) < last)
        recvs = sum(m for c in range(v) if self.stage.virtual(c) > 0)
        try:
            if self.link is not None:
                self.link.begin(EVAL, sends={Direction.ACTIVATION: sends},
                                recvs={Direction.ACTIVATION: recvs})
            xs = split_batch(inputs, m, "inputs") if self.is_first else None
            outputs = []
            for c in range(v):
                for mb in range(m):
                    out = self._eval_chunk(c, mb, xs)
                    if self.stage.virtual(c) == last:
                        outputs.append(out)
            if self.link is not None:
                self.link.flush()
        except BaseException as exc:
            self._abort(exc)
            raise
        return bundle.concat(outputs) if self.is_last else None

    def _eval_chunk(self, c: int, mb: int, xs: list[Any] | None) -> Any:
        """Micro-batch ``mb`` through chunk ``c``: received (or cut from the inputs),
        computed, and sent on unless it is the last virtual stage's output."""
        virtual, last = self.stage.virtual(c), self.stage.num_virtual - 1
        if virtual == 0:
            assert xs is not None
            x, source = xs[mb], None
        else:
            assert self.link is not None
            message = self.link.recv(Direction.ACTIVATION, call=self._call, mode=EVAL,
                                     microbatch=mb, chunk=c)
            x = received(message, "an activation")
            source = self.link.describe(self.link.neighbour(-1))
        out = self.stage.forward_only(x, source, c)
        if virtual < last:
            assert self.link is not None
            to = c + 1 if self.is_last else c  # round the ring: the next chunk on stage 0
            send_value(self.link, Direction.ACTIVATION, out, call=self._call, mode=EVAL,
                       microbatch=mb, rows=bundle.rows_of(x), chunk=to)
        return out


def build_pipeline(model: Any, comm: Communicator, *, schedule: str = "1f1b",
                   microbatches: int = 8, partition: str | Sequence[int] | Sequence[str] = "params",
                   pp_size: int | None = None, sample: torch.Tensor | None = None,
                   mesh: DeviceMesh | None = None, warn_bubble: bool = True,
                   virtual_stages: int = 1) -> PipelineParallel:
    """Split ``model`` (an ``nn.Sequential``, or a model with a ``layers()`` method) over
    the ranks of ``comm`` and return this rank's stage, ready for ``train_step``.

    ``partition``: ``"params"`` (balance parameter counts), ``"time"`` (balance measured
    forward + backward time on ``sample``), the number of layers of each stage, or the
    names of the layers where stages 1, 2, … start (``["blocks.2", "head"]``). A layer
    takes the previous one's output as its one argument and may return a tensor or a
    tuple, list or dict of tensors: a model whose forward is not a plain chain gives its
    chain as a ``layers()`` method (a stage function per piece), and names in
    ``state_dict()`` are the model's own.
    ``pp_size``: stages per pipeline; the world is then ``world_size / pp_size`` data
    parallel replicas of the pipeline. ``mesh``: a mesh built over ``comm`` instead (its
    ``pp`` groups run the stages, its ``dp`` groups average their gradients; with tp > 1
    ``model`` is this rank's tensor-parallel shard). Every rank must build the same model
    (same seed): each keeps only its own stage's layers. ``warn_bubble``: warn when fewer
    micro-batches than stages leave stages idle (not for model parallelism: m = 1 on
    purpose). ``virtual_stages``: v > 1 cuts the model into p·v pieces (``partition``
    then gives p·v layer counts, or p·v − 1 split points) and gives stage r pieces r,
    r + p, … as its chunks, under interleaved 1F1B (``schedule="1f1b"``, micro-batches a
    multiple of p).
    """
    layers = part.layers_of(model)
    names = part.layer_names(model, layers)
    stages = mesh.pp_size if mesh is not None else _pipeline_shape(comm.world_size,
                                                                    pp_size).pp
    config = PipelineConfig(schedule, microbatches, "params",
                            mesh.pp_size if mesh is not None else pp_size, virtual_stages)
    config.check_stages(stages, len(layers))
    pieces = stages * virtual_stages
    if not isinstance(partition, str) and any(isinstance(p, str) for p in partition):
        partition = part.balance_at(names, [str(p) for p in partition], pieces)
    config = replace(config, partition=partition if isinstance(partition, str) else tuple(
        int(p) for p in partition))
    if mesh is None:
        mesh = build_mesh(comm, _pipeline_shape(comm.world_size, config.pp_size))
    pp = mesh.pp_size
    settings = [pp, config.microbatches, sorted(SCHEDULES).index(config.schedule),
                virtual_stages]
    balance = agreed_balance(comm, layers, pieces, config.partition, sample, settings,
                             "the pipeline")
    if warn_bubble and config.microbatches < pp and comm.rank == 0:
        log.warning("pipeline with %d micro-batches on %d stages: stages idle %.0f%% of each "
                    "step; use at least as many micro-batches as stages",
                    config.microbatches, pp, 100 * (pp - 1) / (config.microbatches + pp - 1))
    if comm.rank == 0:
        log.info("pipeline: %d stages × %d virtual × %d replicas (tp %d), balance %s, "
                 "schedule %s, %d micro-batches", pp, virtual_stages, mesh.dp_size,
                 mesh.tp_size, list(balance), config.schedule, config.microbatches)
    chunks = [part.stage_module(layers, balance, c * pp + mesh.pp_rank)
              for c in range(virtual_stages)]
    return PipelineParallel(chunks[0] if virtual_stages == 1 else chunks, mesh, config,
                            balance, device_of(layers), names)


def _pipeline_shape(world_size: int, pp_size: int | None) -> MeshShape:
    """pp × dp with the pipeline's defaults: one pipeline over every rank."""
    pp = world_size if pp_size is None else pp_size
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1 or world_size % pp:
        raise ValueError(f"pp_size={pp_size!r} must be a positive divisor of the world size "
                         f"{world_size} (pipelines of pp_size stages, world_size/pp_size "
                         f"replicas)")
    return MeshShape(dp=world_size // pp, pp=pp)
