"""Simulate training strategies at any scale: ``disttrain simulate`` (docs/simulate.md).

A compute profile of the model (measured on this host by :mod:`disttrain.probe`, or
analytic), a cluster description and the α-β-γ cost model feed a discrete-event simulation
of one training step per strategy. This package is the model alone: pure arithmetic on
those records, it forks and times nothing (the command line, :mod:`.cli`, drives the
probes and the model).
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
