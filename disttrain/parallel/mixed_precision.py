"""Mixed precision: autocast for the forward pass, and dynamic loss scaling agreed by all ranks.

Autocast runs matmuls and convolutions in a 16-bit dtype while parameters, gradients and the
optimizer stay in fp32 (Micikevicius et al., "Mixed Precision Training", ICLR 2018). bf16 has
fp32's exponent range and needs no loss scaling; fp16 does: small gradients underflow to
zero, so the loss is multiplied by a large scale S before backward and the gradients are
divided by S before the step. A step whose gradients overflowed (inf/nan) is skipped and S
halved; after ``growth_interval`` clean steps S doubles::

    loss ─×S─▶ backward ─▶ grads·S ─×1/S─▶ finite on EVERY rank? ─ yes ─▶ optimizer.step()
                                                              └─ no ──▶ skip, S ← S·backoff

The found-inf flag is all-reduced (max) through the communicator, so every rank skips the
same steps and the replicas stay identical even if only one rank's gradients overflowed.
:meth:`LossScaler.attach` routes an optimizer's own ``step()`` through the scaler (the
training loop's ``--precision fp16`` does this for every strategy's update, a ZeRO shard's
included); a rank with nothing to update still takes part in the decision
(:meth:`LossScaler.no_step`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import torch

from disttrain.comm import Communicator

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def at_least_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float32 when it is a narrower float (an fp16/bf16 output of autocast),
    as it is otherwise: a float64 model's losses and logits stay float64."""
    if tensor.is_floating_point() and torch.finfo(tensor.dtype).bits < 32:
        return tensor.float()
    return tensor


def accumulate(total: torch.Tensor | None, loss: torch.Tensor) -> torch.Tensor:
    """``total + loss`` (``loss`` detached, at least float32), on ``loss``'s device: a
    step's loss summed over micro-batches without a tensor made elsewhere."""
    part = at_least_fp32(loss.detach())
    return part if total is None else total + part


def autocast(device_type: str = "cpu", dtype: str | None = "bf16") -> AbstractContextManager[Any]:
    """A ``torch.autocast`` context for the forward pass: ``"bf16"`` or ``"fp16"`` on CUDA or
    CPU (fp16 on CPU is slow: it is there to test fp16 training where there is no GPU);
    ``None`` (or ``"fp32"``) disables it."""
    if dtype in (None, "fp32"):
        return nullcontext()
    if dtype not in _DTYPES:
        raise ValueError(f"mixed-precision dtype must be 'bf16', 'fp16' or None, got {dtype!r}")
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"autocast device_type must be 'cpu' or 'cuda', got {device_type!r}")
    return torch.autocast(device_type=device_type, dtype=_DTYPES[dtype])


@dataclass(frozen=True)
class LossScalerConfig:
    """Dynamic loss scaling (defaults are torch.amp.GradScaler's)."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000  # clean steps before the scale grows
    enabled: bool = True  # False: scale() and unscale are no-ops (bf16 or fp32 training)

    def __post_init__(self) -> None:
        if not self.init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {self.init_scale}")
        if not self.growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor}")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor}")
        interval = self.growth_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"growth_interval must be a positive int, got {interval!r}")


class LossScaler:
    """``scale(loss)`` → ``backward`` → ``step(optimizer)`` → ``update()``, like GradScaler,
    with the overflow decision shared by every rank of ``comm`` (``None``: one process)."""

    def __init__(self, comm: Communicator | None = None,
                 config: LossScalerConfig | None = None) -> None:
        self.comm = comm
        self.config = config or LossScalerConfig()
        self.scale_value = float(self.config.init_scale) if self.config.enabled else 1.0
        self.growth_tracker = 0  # clean steps since the scale last changed
        self.skipped_steps = 0
        self._found_inf: dict[int, bool] = {}  # per optimizer, for the current step

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss × scale`` (``loss`` itself when disabled)."""
        return loss * self.scale_value if self.enabled else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide ``optimizer``'s gradients by the scale (once per step; call it yourself
        before gradient clipping) and return whether ANY rank found an inf/nan gradient."""
        key = id(optimizer)
        if key in self._found_inf:
            return self._found_inf[key]
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        if self.enabled and grads:
            torch._foreach_mul_(grads, 1.0 / self.scale_value)
        # one host sync for all the gradients (on a GPU, each check would be one)
        local = self.enabled and bool(grads) and not bool(
            torch.stack([torch.isfinite(g).all() for g in grads]).all())
        found = self._agree(local)
        self._found_inf[key] = found
        return found

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Route ``optimizer.step()`` through this scaler: before it, the gradients are
        unscaled and, when any rank found an inf/nan, dropped (``None``: the step changes
        nothing, not even Adam's step count); after it, the scale is updated."""
        optimizer.register_step_pre_hook(self._before_step)
        optimizer.register_step_post_hook(lambda *_: self.update())

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.unscale_(optimizer):
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.grad = None

    def no_step(self) -> None:
        """This step's decision and scale update on a rank that updates nothing (a pipeline
        stage without parameters): it must take part, or the others wait for it."""
        if self.enabled:
            self._found_inf[-1] = self._agree(False)
            self.update()

    def _agree(self, local: bool) -> bool:
        """Max over ranks of the local flag: one rank's overflow makes every rank skip."""
        if self.comm is None or self.comm.world_size == 1:
            return local
        flag = torch.tensor([1.0 if local else 0.0])
        self.comm.all_reduce(flag, "max")
        return bool(flag.item() > 0)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless done), then ``optimizer.step()`` if every rank's gradients are
        finite; otherwise skip it. Returns the step's result, or None when skipped."""
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        if self.unscale_(optimizer):
            return None
        return optimizer.step(*args, **kwargs)

    def update(self) -> None:
        """Back off after a skipped step, grow after ``growth_interval`` clean ones."""
        if not self.enabled:
            return
        if not self._found_inf:
            raise RuntimeError("LossScaler.update() needs a step(optimizer) (or unscale_) first "
                               "in this iteration")
        if any(self._found_inf.values()):
            self.scale_value *= self.config.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps += 1
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.config.growth_interval:
                self.scale_value *= self.config.growth_factor
                self.growth_tracker = 0
        self._found_inf = {}

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale_value, "growth_tracker": self.growth_tracker,
                "skipped_steps": self.skipped_steps, "config": asdict(self.config)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"scale", "growth_tracker"} - set(state)
        if missing:
            raise ValueError(f"LossScaler state is missing {sorted(missing)}; pass the dict "
                             f"returned by LossScaler.state_dict()")
        self.scale_value = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._found_inf = {}
