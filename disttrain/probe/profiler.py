"""Profile a model on this machine: fill a :class:`~disttrain.simulate.profile.ModelProfile`
with per-layer forward and backward times, parameter, gradient and activation bytes, and
the step's :class:`~disttrain.simulate.overheads.Overheads`.

Each layer of the model (:func:`~disttrain.parallel.pipeline.partition.layers_of`: the
children of an ``nn.Sequential``, split once here and handed to every probe) is timed
inside passes of the whole model, as training runs it (:mod:`~disttrain.probe.layer_timing`).
Times are measured at two batch sizes and fitted as ``t(b) = fixed + b · per_sample`` per
layer: on a CPU the fixed part (Python, kernel launch) matters at small batches, on an
accelerator the per-sample part dominates. Each batch size is measured in three rounds
spread over the profile's tens of seconds (:class:`LayerRounds`), and the median round is
kept: this machine's speed drifts (LeNet's pass at 2.5-3.1 ms within a minute, and spells
at 1.7 ms or 3.0 ms lasting tens of seconds), and a profile is to describe the machine as
the runs it predicts find it, which is its usual state, not its fastest (with the least of
two rounds instead, two validations predicted the single process 10-26 % below each of its
runs). The bytes autograd saves per layer and its output bytes come with the times.

Ranks of ``disttrain bench`` run one thread each, so the profile is measured with one
thread too. ``reference_flops`` is this machine's sustained matmul FLOP/s at that thread
count.

What the step pays besides its layers (the optimizer, the loop, the wrappers' Python work,
the ranks' interference) is measured by :func:`~disttrain.probe.wrappers.measure_overheads`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from disttrain.parallel.pipeline.partition import layers_of
from disttrain.parallel.tensor.theory import LMShape
from disttrain.parallel.tensor.transformer import lm_shape
from disttrain.probe.layer_timing import REPEATS, Rows, run_layers
from disttrain.probe.wrappers import measure_overheads
from disttrain.simulate.cluster import usable_cores
from disttrain.simulate.overheads import Overheads
from disttrain.simulate.profile import LayerProfile, ModelProfile
from disttrain.train.config import TrainConfig
from disttrain.train.data import build_dataset
from disttrain.train.loop import single_steps
from disttrain.train.models import build_model

PROFILE_BATCHES = (4, 32)


def host_flops(size: int = 256, repeats: int = 10) -> float:
    """Sustained fp32 matmul FLOP/s of this process at its current thread count."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times)


def _optimizer_rate(params: list[nn.Parameter]) -> float:
    """Seconds per parameter of an SGD-with-momentum step (what the training loop runs)."""
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.SGD(params, lr=0.0, momentum=0.9)
    opt.step()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    numel = sum(p.numel() for p in params) or 1
    return statistics.median(times) / numel


class LayerRounds:
    """Rounds of :func:`~disttrain.probe.layer_timing.run_layers` at the profile's two
    batch sizes, taken at different moments; the profile's layer times are those of the
    median round (by the layers' sum), per batch size. The median and not the least: this
    machine's speed drifts by 10-20 % within seconds and has spells of ×1.8 lasting tens of
    seconds, so the least of many rounds is a state the machine is rarely in; the median
    is its usual speed over the time the rounds span. ``disttrain simulate --validate``
    adds a round before each run it measures, so the profile spans the same minutes as
    the runs.

    With ``overheads`` (a function measuring :class:`Overheads` anew, tens of seconds),
    :meth:`sample_overheads` takes another measurement of them too, and :meth:`profile`
    keeps each quantity's median over all of them: a profile taken in a slow spell read
    the loop's work at 0.61 ms where others read 0.38 ms and the pipeline wake-up at 0.77
    ms against 0.43-0.46 ms, and put five rows of one validation at 1.18-1.24.
    :meth:`close` ends what ``overheads`` needs (the loop's steps)."""

    def __init__(self, model: nn.Module, inputs: tuple[torch.Tensor, torch.Tensor],
                 threads: int = 1, overheads: Callable[[], Overheads] | None = None) -> None:
        self.model, self.inputs, self.threads = model, inputs, threads
        self.layers = layers_of(model)
        self.small: list[Rows] = []
        self.large: list[Rows] = []
        self.measure_overheads = overheads
        self.overheads: list[Overheads] = []
        self.closing: list[Callable[[], object]] = []

    def close(self) -> None:
        while self.closing:
            self.closing.pop()()

    def _quietly(self, run: Callable[[], object]) -> None:
        """``run`` with the profile's thread count, the model's parameters and buffers (a
        batch norm's running statistics) left as they were."""
        old_threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        state = {k: v.clone() for k, v in self.model.state_dict().items()}
        try:
            run()
        finally:
            self.model.load_state_dict(state)
            self.model.zero_grad(set_to_none=True)
            torch.set_num_threads(old_threads)

    def sample_overheads(self) -> None:
        """One more measurement of the overheads (see the class docstring)."""
        measure = self.measure_overheads
        if measure is None:
            raise ValueError("these rounds were made without a way to measure overheads")
        self._quietly(lambda: self.overheads.append(measure()))

    def sample(self) -> None:
        """One more round at both batch sizes, with the profile's thread count; the model's
        parameters and buffers (a batch norm's running statistics) are left as they were."""
        def both() -> None:
            self.small.append(run_layers(self.layers, self.inputs[0]))
            self.large.append(run_layers(self.layers, self.inputs[1]))
        self._quietly(both)

    def totals(self, batch_index: int = 1) -> list[float]:
        """Each round's forward+backward (the layers' sum) at the small (0) or large (1)
        batch, in the order taken."""
        return [sum(f + b for f, b, _, _ in rows)
                for rows in (self.small, self.large)[batch_index]]

    def median(self) -> tuple[Rows, Rows]:
        """The median round at each batch size (the lower of the middle two for an even
        count)."""
        if not self.small:
            raise ValueError("no rounds taken: call sample() first")
        picked = []
        for i, rounds in enumerate((self.small, self.large)):
            order = sorted(range(len(rounds)), key=self.totals(i).__getitem__)
            picked.append(rounds[order[(len(rounds) - 1) // 2]])
        return picked[0], picked[1]

    def layer_profiles(self) -> tuple[LayerProfile, ...]:
        """Each layer fitted as ``fixed + batch · per_sample`` from the median rounds."""
        (b1, b2), (small, large) = (len(x) for x in self.inputs), self.median()
        profiles = []
        for i, (layer, s, g) in enumerate(zip(self.layers, small, large, strict=True)):
            fwd_slope = max(0.0, (g[0] - s[0]) / (b2 - b1))
            bwd_slope = max(0.0, (g[1] - s[1]) / (b2 - b1))
            params = [p for p in layer.parameters() if p.requires_grad]
            profiles.append(LayerProfile(
                f"{i}:{type(layer).__name__}", max(0.0, s[0] - b1 * fwd_slope), fwd_slope,
                max(0.0, s[1] - b1 * bwd_slope), bwd_slope, sum(p.numel() for p in params),
                g[2] / b2, g[3] / b2, len(params)))
        return tuple(profiles)

    def profile(self, base: ModelProfile) -> ModelProfile:
        """``base`` with its layer times from every round taken so far, and each overhead
        the median of its measurements so far (``base``'s and :meth:`sample_overheads`')."""
        overheads = (Overheads.median([base.overheads, *self.overheads]) if self.overheads
                     else base.overheads)
        return dataclasses.replace(base, layers=self.layer_profiles(), overheads=overheads)


def measure(name: str, model: nn.Module, make_input: Callable[[int], torch.Tensor],
            batches: tuple[int, int] = PROFILE_BATCHES, threads: int = 1,
            loop: Callable[[], object] | None = None, transport: str = "torch"
            ) -> ModelProfile:
    """Profile ``model`` (its ``layers_of`` split) on inputs ``make_input(batch)``;
    ``loop`` runs one whole step of the training loop on a batch of ``batches[0]`` (for
    ``Overheads.step_s``: that step minus the model's forward+backward and SGD step);
    ``transport`` carries the collectives whose wake-up is measured."""
    return measure_rounds(name, model, make_input, batches, threads, loop, transport)[0]


def measure_rounds(name: str, model: nn.Module, make_input: Callable[[int], torch.Tensor],
                   batches: tuple[int, int] = PROFILE_BATCHES, threads: int = 1,
                   loop: Callable[[], object] | None = None, transport: str = "torch",
                   bind_cores: bool = False) -> tuple[ModelProfile, LayerRounds]:
    """:func:`measure`, and its :class:`LayerRounds` (to take more rounds later and
    :meth:`LayerRounds.profile` them; ``loop`` must keep working until then).
    ``bind_cores``: the overheads are for runs bound to cores
    (:func:`~disttrain.probe.wrappers.measure_overheads`). The model is split into its
    layers once, here: the layer rounds and every overhead probe time the same split."""
    b1, b2 = batches
    if not 0 < b1 < b2:
        raise ValueError(f"batches must be two increasing sizes, got {batches}")
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with torch.random.fork_rng(devices=[]):
            inputs = make_input(b1), make_input(b2)

            rounds = LayerRounds(model, inputs, threads)

            def overheads_now() -> Overheads:
                return measure_overheads(model, inputs[0], loop, usable_cores(), transport,
                                         bind_cores, layers=rounds.layers)
            rounds.measure_overheads = overheads_now
            rounds.sample()
            opt = _optimizer_rate([p for p in model.parameters() if p.requires_grad])
            flops = host_flops()
            # rounds seconds apart, around the overheads' tens of seconds (see LayerRounds)
            rounds.sample()
            overheads = overheads_now()
            rounds.sample()
    finally:
        model.load_state_dict(state)
        torch.set_num_threads(old_threads)
    return ModelProfile(name, rounds.layer_profiles(), flops, opt,
                        f"measured here ({threads} thread)", overheads), rounds


def measure_registered(model: str, dataset: str = "digits", seed: int = 0,
                       transport: str = "torch") -> ModelProfile:
    """Profile a model of the registry (or ``"pkg.mod:factory"``) on ``dataset``'s inputs,
    with this machine's collectives on ``transport``."""
    profile, rounds = registered_rounds(model, dataset, seed, transport)
    rounds.close()
    return profile


def registered_rounds(model: str, dataset: str = "digits", seed: int = 0,
                      transport: str = "torch", bind_cores: bool = False
                      ) -> tuple[ModelProfile, LayerRounds]:
    """:func:`measure_registered`, and its :class:`LayerRounds`, open until their
    :meth:`~LayerRounds.close`; ``bind_cores`` as :func:`measure_rounds`."""
    info = build_dataset(dataset).info
    torch.manual_seed(seed)
    net = build_model(model, info)
    net.train()

    def make_input(batch: int) -> torch.Tensor:
        if info.task == "lm":
            return torch.randint(0, info.num_classes, (batch, *info.input_shape))
        return torch.randn(batch, *info.input_shape)

    # the loop's own work is timed on whole steps of the real loop at the small batch
    config = TrainConfig(model=model, dataset=dataset, seed=seed, strategy="single",
                         global_batch=PROFILE_BATCHES[0])
    with contextlib.ExitStack() as stack:
        step = stack.enter_context(single_steps(config))
        profile, rounds = measure_rounds(model, net, make_input, loop=step,
                                         transport=transport, bind_cores=bind_cores)
        rounds.closing.append(stack.pop_all().close)
    return dataclasses.replace(profile, transformer=transformer_shape(net)), rounds


def transformer_shape(model: nn.Module) -> LMShape | None:
    """The sizes of a TransformerLM-shaped model (None for any other model)."""
    try:
        return LMShape(**lm_shape(model))
    except ValueError:
        return None
