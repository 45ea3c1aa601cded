"""Simulate training strategies at any scale: ``disttrain simulate`` (docs/simulate.md).

A compute profile of the model (measured here, or analytic), a cluster description and the
α-β-γ cost model feed a discrete-event simulation of one training step per strategy.
"""

from __future__ import annotations

from disttrain.simulate.base import Case, StepResult
from disttrain.simulate.cluster import PRESETS, Cluster, Link, get_cluster
from disttrain.simulate.profile import LayerProfile, ModelProfile
from disttrain.simulate.strategies import STRATEGIES, simulate, sweep
from disttrain.simulate.workload import Speeds, Workload

__all__ = ["PRESETS", "STRATEGIES", "Case", "Cluster", "LayerProfile", "Link",
           "ModelProfile", "Speeds", "StepResult", "Workload", "get_cluster", "simulate",
           "sweep"]
