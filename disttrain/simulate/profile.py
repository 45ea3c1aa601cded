"""A model's compute profile: per-layer forward and backward time, parameter, gradient and
activation bytes, and what a step pays besides its layers, on a reference device.

The record every simulation reads. It is filled either by measuring this machine
(:mod:`disttrain.probe.profiler`: each layer timed inside passes of the whole model, fitted
as ``t(b) = fixed + b · per_sample`` from two batch sizes, one thread as ``disttrain bench``
ranks run, with the step's :class:`~disttrain.simulate.overheads.Overheads`) or on paper
(:mod:`~disttrain.simulate.analytic`: ResNet-101, GPT). ``reference_flops`` is the speed of
the device the times are for: a cluster whose devices sustain F FLOP/s runs the profile
``reference_flops / F`` times as long (see
:meth:`disttrain.simulate.cluster.Cluster.compute_scale`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disttrain.parallel.tensor.theory import LMShape
from disttrain.simulate.overheads import Overheads


@dataclass(frozen=True)
class LayerProfile:
    """One layer on the reference device; times in seconds, sizes in elements or bytes."""

    name: str
    forward_fixed: float
    forward_per_sample: float
    backward_fixed: float
    backward_per_sample: float
    params: int  # trainable elements
    saved_bytes_per_sample: float  # what autograd keeps for backward
    output_bytes_per_sample: float  # what the next pipeline stage receives
    tensors: int = 0  # trainable parameter tensors (DDP runs one hook per tensor)

    def forward(self, batch: float) -> float:
        return self.forward_fixed + batch * self.forward_per_sample

    def backward(self, batch: float) -> float:
        return self.backward_fixed + batch * self.backward_per_sample


@dataclass(frozen=True)
class ModelProfile:
    """Every layer of a model, plus the optimizer's cost and the reference device speed."""

    name: str
    layers: tuple[LayerProfile, ...]
    reference_flops: float  # sustained FLOP/s of the device the times are for
    optimizer_s_per_param: float  # used when ``overheads`` were not measured
    source: str = "measured"
    overheads: Overheads = field(default_factory=Overheads)
    # the sizes tensor parallelism splits, when the model is a TransformerLM (None: not one)
    transformer: LMShape | None = None
    # mixture of experts (expert parallelism): (experts, top-k, indices of the MoE layers,
    # parameters held by experts); None: a dense model
    moe: tuple[int, int, tuple[int, ...], int] | None = None

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError(f"profile {self.name!r} has no layers")
        if not self.reference_flops > 0:
            raise ValueError(f"reference_flops must be > 0, got {self.reference_flops}")

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    def compute(self, batch: float) -> float:
        """Forward + backward of the whole model on ``batch`` samples (reference device)."""
        return sum(lay.forward(batch) + lay.backward(batch) for lay in self.layers)

    @property
    def tensors(self) -> int:
        return sum(layer.tensors for layer in self.layers)

    def optimizer(self, params: float, name: str = "sgd", tensors: int = 1) -> float:
        """One optimizer step over ``params`` fp32 parameters in ``tensors`` tensors
        (reference device): the measured fixed + per-byte (+ per-tensor) costs when there
        are, else ``optimizer_s_per_param`` per parameter."""
        if self.overheads.measured:
            return self.overheads.optimizer(name, params * 4, tensors)
        return params * self.optimizer_s_per_param
