"""What a training step pays besides its layers' forward and backward: the record the host
probes fill (:func:`disttrain.probe.wrappers.measure_overheads`) and the strategies charge.

Per-layer timing (:mod:`~disttrain.probe.layer_timing`) sees the arithmetic; a real step also
runs the optimizer, the loop around the model, and the Python work of the strategy's
wrapper. Each piece below is a named, measured quantity of :class:`Overheads`, shown by
``disttrain simulate`` and used as tasks by the strategies' event simulations:

==========================  ==========================================================
``step_s``                  the loop's own work per step: a whole step of the real loop
                            less the layers' times of a profile pass and the SGD step
                            (fetch the batch, ``zero_grad``, the loss and the start of
                            backward, ``float(loss)``, the optimizer's extra after
                            backward; ``probe.wrappers.loop_cost``)
``sgd_fixed_s``,            SGD with momentum: ``fixed + bytes · per_byte`` per call on
``sgd_s_per_byte``          one flat tensor (fp32 parameter bytes)
``adam_fixed_s``,           the same for Adam
``adam_s_per_byte``
``optimizer_tensor_s``      extra per parameter tensor when the optimizer runs on the
                            model's own tensors instead of one flat shard
``collective_call_s``       one collective call through a Communicator with nothing to
                            send (a one-rank group): queueing it to the progress thread,
                            the hand-off, the flight recorder, the wait
``hook_s_per_tensor``       DDP's reducer per parameter tensor: its post-accumulate-grad
                            hook and the copy into the bucket (measured on the real
                            ``DataParallel``, one rank, minus ``collective_call_s`` per
                            bucket)
``backward_call_s``         one ``torch.autograd.backward`` call on a graph of one tiny op:
                            what a pipeline stage pays per micro-batch besides its
                            layers' backward (the profile's layer times come from one
                            whole-model pass, which pays it once, in ``step_s``)
``zero_s`` (stage → s)      the real ZeRO wrapper's own per-step work (flatten, shard and
                            copy back; stage 3: gather and free per unit) on one rank,
                            minus its collective calls and its optimizer
``collective_wakeup_s``     a 2-rank ring all-reduce of the gradients issued right after
                            both ranks ran forward+backward, minus what the simulation
                            charges for it (``collective_call_s`` and the calibrated ring)
                            (:mod:`~disttrain.probe.contention`)
``collective_wakeup_{p}ranks_s`` the same with p ranks (``wakeup_by_ranks``), on this
                            machine with twice as many ranks as cores: a step of more ranks
                            than cores pays it instead of the 2-rank one
``scatter_wakeup_{p}ranks_s`` the same for a ring reduce-scatter of the gradients issued
                            asynchronously and waited for, as ZeRO-2/3 issue it
                            (``scatter_wakeup_by_ranks``): on this host it mostly costs
                            less than the all-reduce's wake-up; ZeRO-2/3's reduce-
                            scatters pay it (ZeRO-1's, a synchronous call like the
                            all-reduce probe's, pays the all-reduce's)
``zero3_op_{p}ranks_s``      ZeRO-3's pattern probed with p ranks (``unit_op_by_ranks``):
                            per unit an all-gather issued asynchronously before its
                            computation and waited for after it, forward and backward,
                            and a reduce-scatter after its backward; what they add to a
                            step, less their calibrated ring times, per collective.
                            ZeRO-3's collectives pay it instead of the call overhead and
                            the wake-up
``collective_wakeup_after_s`` the compute both ranks ran before that all-reduce (the
                            model's forward+backward at the profile's small batch): a
                            collective pays the wake-up in proportion to how long its link
                            sat idle before it, in full after this long (and a pipeline
                            stage ``stage_wakeup_s`` by its own idle time, likewise)
``ps_pull_s``, ``ps_push_s`` one parameter-server pull and push of the model's parameters,
                            one worker and one server in two processes, the worker
                            computing between them (:mod:`~disttrain.probe.ps_probe`):
                            messages, both sides' Python and the server's work
``ps_served_s``             what a second worker adds to that probe's clock (the same
                            probe with two workers): the share of an exchange the server
                            serves one worker at a time (the rest overlaps the others')
``stage_message_s``         one message between two pipeline stages that compute nothing
                            in between (:mod:`~disttrain.probe.stage_probe`): both
                            stages' Python, the header, the posted receive
``stage_wakeup_s``          what such a message costs more when its receiver sat idle
                            while the sender ran the model's forward+backward: waking the
                            receiver, its next computation on cold caches
``stage_work_s``            what a pipeline stage spends on its own thread per message it
                            sends or receives (packing, posting, taking it in, the
                            schedule's Python per micro-batch): the real runtime's GPipe
                            on two stages, its steps less layers and waits
                            (:func:`~disttrain.probe.stage_probe.stage_work`)
``stage_work_{p}ranks_s``   the same on p > 2 stages (``stage_work_by_ranks``): a pipeline of
                            more stages than 2 pays the probe with the most stages not above
                            its own
``stage_crossing_{p}ranks_s`` what a 1F1B stage spends on its own thread per message beyond
                            GPipe's, the two schedules run alternately on p stages of the
                            same runtime (``crossing_by_ranks``): in 1F1B's steady state
                            messages cross each connection both ways at once. 1F1B's
                            stages pay it on top of their stage work
``concurrent_slowdown``     how much slower the model's forward+backward runs in each of
                            this machine's cores at once than alone (a ratio ≥ 1;
                            :mod:`~disttrain.probe.contention`)
==========================  ==========================================================

Everything is measured with one thread, as ``disttrain bench`` ranks run. The collectives
measured on one rank move no bytes: their cost on p ranks is the α-β-γ model's, and only
the software overhead of issuing them is here. How each piece carries to other clusters is
in docs/simulate.md ("Overheads", the table's last column).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

# the quantities kept by rank count (keys ≥ 2)
RANK_KEYED = ("wakeup_by_ranks", "scatter_wakeup_by_ranks", "unit_op_by_ranks",
              "stage_work_by_ranks", "crossing_by_ranks")


def probed_at(by_ranks: dict[int, float], ranks: int) -> float | None:
    """Of a quantity probed at several rank counts, the value probed with the most ranks
    not above ``ranks``; None when none was."""
    fitting = [k for k in by_ranks if k <= ranks]
    return by_ranks[max(fitting)] if fitting else None


@dataclass(frozen=True)
class Overheads:
    """Measured per-step costs besides the layers (seconds; see the module docstring).
    All zero (the default) means "not measured": analytic profiles have none."""

    step_s: float = 0.0
    sgd_fixed_s: float = 0.0
    sgd_s_per_byte: float = 0.0
    adam_fixed_s: float = 0.0
    adam_s_per_byte: float = 0.0
    optimizer_tensor_s: float = 0.0
    collective_call_s: float = 0.0
    hook_s_per_tensor: float = 0.0
    backward_call_s: float = 0.0
    zero_s: dict[int, float] = field(default_factory=dict)
    collective_wakeup_s: float = 0.0  # this machine only (see Case.wakeup)
    collective_wakeup_after_s: float = 0.0
    # ranks → the wake-up measured with that many ranks (more than the cores: they also
    # wait for each other to be scheduled); collective_wakeup_s is the 2-rank one
    wakeup_by_ranks: dict[int, float] = field(default_factory=dict)
    # ranks → the same for a reduce-scatter issued asynchronously (ZeRO's gradients)
    scatter_wakeup_by_ranks: dict[int, float] = field(default_factory=dict)
    # ranks → per collective of ZeRO-3's pattern, beyond its calibrated time
    unit_op_by_ranks: dict[int, float] = field(default_factory=dict)
    ps_pull_s: float = 0.0  # this machine only (simulate.parameter_server)
    ps_push_s: float = 0.0
    ps_served_s: float = 0.0  # of that pull and push, served one worker at a time
    stage_message_s: float = 0.0  # this machine only (simulate.pipeline)
    stage_wakeup_s: float = 0.0
    stage_work_s: float = 0.0
    # ranks → stage_work_s probed on that many stages (> 2)
    stage_work_by_ranks: dict[int, float] = field(default_factory=dict)
    # ranks → a 1F1B stage's own work per message beyond GPipe's, both probed on p stages
    crossing_by_ranks: dict[int, float] = field(default_factory=dict)
    concurrent_slowdown: float = 1.0  # a ratio, not seconds: not in named()

    def __post_init__(self) -> None:
        for name in RANK_KEYED:
            keys = list(getattr(self, name))
            if any(isinstance(k, bool) or not isinstance(k, int) or k < 2
                   for k in keys):  # first: named() sorts them
                raise ValueError(f"Overheads.{name} keys must be rank counts ≥ 2, got "
                                 f"{keys!r}")
        for name, value in self.named():
            if not value >= 0:
                raise ValueError(f"Overheads.{name} must be ≥ 0 seconds, got {value!r}")
        if not self.concurrent_slowdown >= 1:
            raise ValueError(f"Overheads.concurrent_slowdown must be ≥ 1 (1: none), got "
                             f"{self.concurrent_slowdown!r}")

    def named(self) -> list[tuple[str, float]]:
        """Every quantity by name (for the profile printout and validation)."""
        plain = [(k, float(getattr(self, k))) for k in (
            "step_s", "sgd_fixed_s", "sgd_s_per_byte", "adam_fixed_s", "adam_s_per_byte",
            "optimizer_tensor_s", "collective_call_s", "hook_s_per_tensor",
            "backward_call_s", "collective_wakeup_s", "collective_wakeup_after_s",
            "ps_pull_s", "ps_push_s", "ps_served_s", "stage_message_s", "stage_wakeup_s",
            "stage_work_s")]
        return plain + [(f"zero{k}_s", v) for k, v in sorted(self.zero_s.items())] + [
            (f"collective_wakeup_{k}ranks_s", v) for k, v in sorted(self.wakeup_by_ranks.items())
        ] + [(f"scatter_wakeup_{k}ranks_s", v)
             for k, v in sorted(self.scatter_wakeup_by_ranks.items())] + [
            (f"zero3_op_{k}ranks_s", v) for k, v in sorted(self.unit_op_by_ranks.items())] + [
            (f"stage_work_{k}ranks_s", v) for k, v in sorted(self.stage_work_by_ranks.items())
        ] + [(f"stage_crossing_{k}ranks_s", v)
             for k, v in sorted(self.crossing_by_ranks.items())]

    @staticmethod
    def median(measured: Sequence[Overheads]) -> Overheads:
        """Each quantity's median over ``measured`` (several measurements at different
        moments; a keyed one, such as a rank count's wake-up, over those that have it)."""
        if not measured:
            raise ValueError("Overheads.median needs at least one measurement")
        keyed = ("zero_s", *RANK_KEYED)
        values: dict[str, Any] = {
            f.name: statistics.median(getattr(o, f.name) for o in measured)
            for f in fields(Overheads) if f.name not in keyed}
        for name in keyed:
            keys = sorted({k for o in measured for k in getattr(o, name)})
            values[name] = {k: statistics.median(getattr(o, name)[k] for o in measured
                                                 if k in getattr(o, name)) for k in keys}
        return Overheads(**values)

    def wakeup(self, ranks: int, op: str = "all_reduce") -> float:
        """The wake-up measured with the most ranks not above ``ranks`` (2: the plain one);
        for a ``reduce_scatter`` its own when it was probed at such a rank count."""
        scatter = probed_at(self.scatter_wakeup_by_ranks, ranks)
        if op == "reduce_scatter" and scatter is not None:
            return scatter
        found = probed_at(self.wakeup_by_ranks, ranks)
        return self.collective_wakeup_s if found is None else found

    def unit_op(self, ranks: int) -> float | None:
        """Per collective of ZeRO-3's pattern with ``ranks`` ranks, beyond its calibrated
        time: the probe's with the most ranks not above ``ranks``; None when not probed."""
        return probed_at(self.unit_op_by_ranks, ranks)

    def stage_work(self, ranks: int) -> float:
        """A pipeline stage's own work per message with ``ranks`` stages: the probe's with
        the most stages not above ``ranks`` (``stage_work_s``: 2)."""
        found = probed_at(self.stage_work_by_ranks, ranks)
        return self.stage_work_s if found is None else found

    def crossing(self, ranks: int) -> float:
        """A 1F1B stage's own work per message beyond GPipe's with ``ranks`` stages: the
        probe's with the most stages not above ``ranks``; 0 when not probed."""
        found = probed_at(self.crossing_by_ranks, ranks)
        return 0.0 if found is None else found

    @property
    def measured(self) -> bool:
        return any(v > 0 for _, v in self.named())

    def optimizer(self, name: str, nbytes: float, tensors: int = 1) -> float:
        """One optimizer step over ``nbytes`` of fp32 parameters in ``tensors`` tensors."""
        fixed, per_byte = ((self.sgd_fixed_s, self.sgd_s_per_byte) if name == "sgd"
                           else (self.adam_fixed_s, self.adam_s_per_byte))
        return fixed + nbytes * per_byte + max(0, tensors - 1) * self.optimizer_tensor_s

    def text(self) -> str:
        """One line per quantity, µs (per byte: ns per KB)."""
        lines = []
        for name, value in self.named():
            shown = f"{value * 1e9 * 1e3:.2f} ns/KB" if name.endswith("per_byte") else \
                f"{value * 1e6:.1f} µs"
            lines.append(f"  {name:22s} {shown}")
        lines.append(f"  {'concurrent_slowdown':22s} ×{self.concurrent_slowdown:.2f}")
        return "\n".join(lines)
