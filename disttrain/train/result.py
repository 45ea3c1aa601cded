"""TrainResult: what one rank's run of the training loop returns (the benchmark's raw row)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass(frozen=True)
class EvalPoint:
    """One evaluation on the held-out split, gathered over all data-parallel ranks."""

    step: int
    epoch: int
    accuracy: float  # correct / count (for a language model: next-token accuracy)
    loss: float  # mean cross-entropy per target


@dataclass(frozen=True)
class TrainResult:
    """One rank's view of a finished run. Fields ending in ``_max`` or ``final_loss`` and the
    last evaluation are the same on every rank that finished the run (gathered), and so are
    the evaluations before it but for the parameter servers' (ps-async and ps-ssp workers
    score alone; a server's rank takes no step and makes only the last evaluation:
    docs/parameter_server.md); the rest are this rank's."""

    strategy: str
    rank: int
    world_size: int
    dp_size: int  # data-parallel ranks the global batch was split over
    global_batch: int
    start_step: int  # > 0 when resumed from a checkpoint
    steps: int  # optimizer steps done in total (including those before a resume)
    steps_per_epoch: int
    final_loss: float  # last step's training loss, averaged over data-parallel ranks
    accuracy: float | None  # last evaluation (None if the run did no step and no evaluation)
    eval_loss: float | None
    samples_per_s: float  # global samples / step time, after the warm-up steps
    step_times: list[float]  # seconds per step on this rank (steps run in this call)
    losses: list[float]  # this rank's training loss per step
    bytes_sent_per_step: list[int] | None  # this rank, via disttrain.comm; None: not observable
    bytes_unobserved: int  # payload of 'native' collectives during the steps (not in the above)
    peak_mem_bytes: int  # this rank (see disttrain.train.metrics)
    peak_mem_bytes_max: int  # the maximum over all ranks
    # what one step should send from this rank, by the strategy's formula (None: unknown)
    theory_bytes_per_step: float | None = None
    bytes_sent_per_step_max: float | None = None  # max over ranks of their mean per step
    theory_bytes_per_step_max: float | None = None  # max over ranks of the formula
    extras: dict[str, Any] = field(default_factory=dict)  # strategy-specific, JSON-friendly
    evaluations: list[EvalPoint] = field(default_factory=list)
    # memory the strategy holds (disttrain.train.memory): this rank's model states by
    # category, the ZeRO paper's figure for them (None: no formula), and the most bytes
    # autograd held saved for backward during a (warm-up) step; then the maxima over ranks
    model_state_bytes: dict[str, int] | None = None
    model_state_formula_bytes: dict[str, int] | None = None
    activation_peak_bytes: int | None = None
    model_state_bytes_max: int | None = None
    activation_peak_bytes_max: int | None = None
    learning_rates: list[float] = field(default_factory=list)  # the rate of each step run
    # throughput in tokens and FLOPs (disttrain.train.flops): for language models only
    tokens_per_sample: int | None = None  # the sequence length
    model_flops_per_token: float | None = None  # 6·N + 12·L·H·T
    devices: int = 1  # the GPUs the ranks compute on, or the machines of CPU ranks
    peak_tflops: float | None = None  # one device's peak, as given (None: no MFU)
    model: nn.Module | None = field(default=None, repr=False, compare=False)  # trained, bare

    @property
    def mean_bytes_sent_per_step(self) -> float | None:
        sent = self.bytes_sent_per_step
        return None if sent is None or not sent else sum(sent) / len(sent)

    @property
    def run_samples_per_s(self) -> float:
        """The run's samples/s: a strategy whose workers step at their own pace (ps-async)
        reports the sum of their rates in ``extras``; the others, this rank's figure."""
        return float(self.extras.get("samples_per_s", self.samples_per_s))

    @property
    def tokens_per_s(self) -> float | None:
        """The run's tokens/s (None: its samples are not token sequences)."""
        if self.tokens_per_sample is None:
            return None
        return self.run_samples_per_s * self.tokens_per_sample

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilization, a fraction (None: not a transformer, or no peak)."""
        from disttrain.train.flops import mfu

        return mfu(self.model_flops_per_token, self.tokens_per_s, self.peak_tflops,
                   self.devices)

    def without_model(self) -> TrainResult:
        """A copy without the model, small enough to send between processes."""
        return dataclasses.replace(self, model=None)

    def summary(self) -> dict[str, Any]:
        """The scalar fields, for JSON output."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("model", "step_times", "losses", "bytes_sent_per_step",
                                 "evaluations")}
        out["mean_bytes_sent_per_step"] = self.mean_bytes_sent_per_step
        out["tokens_per_s"], out["mfu"] = self.tokens_per_s, self.mfu
        return out
