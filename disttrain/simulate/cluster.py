"""Cluster descriptions: nodes, devices, FLOP/s, memory and the two levels of network.

A cluster is ``nodes`` × ``devices_per_node`` devices. Devices of one node talk over the
intra-node link (NVLink, or shared memory and sockets on one host); nodes talk over one
inter-node link per node (its NIC), shared by the node's devices::

    node 0: [d0 d1 … d7] ──NIC──┐
    node 1: [d0 d1 … d7] ──NIC──┼── switch (full bisection assumed)
    …                           │

Each link is an α-β pair (latency, bandwidth) that becomes a
:class:`~disttrain.comm.cost_model.LinkCosts`, so the simulator predicts collectives with the
very formulas ``algorithm="auto"`` uses. The ``local`` preset is this machine as
``disttrain bench comm --calibrate`` measured it (the calibration file, with its α_x, β_x and
per-world-size constants). Presets live in :data:`PRESETS`; users describe their own
cluster in a TOML file (see docs/simulate.md)::

    name = "my-cluster"
    nodes = 16
    devices_per_node = 8
    device_tflops = 150          # sustained, not peak
    device_memory_gb = 80
    [intra]                      # inside a node
    bandwidth_gbps = 2400        # Gb/s per device, per direction
    latency_us = 5
    [inter]                      # per node, per direction
    bandwidth_gbps = 400
    latency_us = 10
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI (a dependency there)
    import tomli as tomllib  # type: ignore[no-redef]

from disttrain.comm.cost_model import LinkCosts, load_costs

GB = 1e9
DEFAULT_GAMMA = 1 / 100e9  # s per byte reduced on an accelerator (HBM-bound add)


def _positive(owner: str, name: str, value: object, integer: bool = False) -> None:
    kind = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not (
            math.isfinite(value) and value > 0):
        what = "an integer" if integer else "a number"
        raise ValueError(f"{owner}.{name} must be {what} > 0, got {value!r}")


@dataclass(frozen=True)
class Link:
    """One network level: latency (s) and bandwidth (bytes/s, per direction)."""

    latency_s: float
    bandwidth: float

    def __post_init__(self) -> None:
        _positive("Link", "latency_s", self.latency_s)
        _positive("Link", "bandwidth", self.bandwidth)

    def costs(self, gamma: float, flows: int = 1) -> LinkCosts:
        """As cost-model constants; ``flows`` concurrent streams share the bandwidth."""
        return LinkCosts(alpha=self.latency_s, beta=flows / self.bandwidth, gamma=gamma,
                         native_alpha=self.latency_s, native_beta=flows / self.bandwidth,
                         source="link")


@dataclass(frozen=True)
class Cluster:
    """A set of identical devices on ``nodes`` nodes (see the module docstring).

    ``device_flops`` is the *sustained* FLOP/s of one device (peak × utilization); compute
    profiles measured here are scaled by it. None means "this machine": measured times are
    used as they are. ``shared_cores`` > 0 says devices are processes sharing that many
    cores (this machine, and only it): the simulation shares them between the compute
    tasks that run at once (:class:`~disttrain.simulate.events.Simulation`); in closed
    forms (:meth:`compute_scale` with ``devices``), p busy devices slow by
    max(1, p/shared_cores).
    ``intra_costs`` overrides the intra link with measured constants (the local preset).
    """

    name: str
    nodes: int
    devices_per_node: int
    device_memory: float  # bytes
    intra: Link
    inter: Link
    device_flops: float | None = None
    gamma: float = DEFAULT_GAMMA
    shared_cores: int = 0
    intra_costs: LinkCosts | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Cluster.name must be a non-empty string, got {self.name!r}")
        _positive("Cluster", "nodes", self.nodes, integer=True)
        _positive("Cluster", "devices_per_node", self.devices_per_node, integer=True)
        _positive("Cluster", "device_memory", self.device_memory)
        _positive("Cluster", "gamma", self.gamma)
        if self.device_flops is not None:
            _positive("Cluster", "device_flops", self.device_flops)
        if isinstance(self.shared_cores, bool) or not isinstance(self.shared_cores, int) \
                or self.shared_cores < 0:
            raise ValueError(f"Cluster.shared_cores must be an integer ≥ 0, got "
                             f"{self.shared_cores!r}")
        for name in ("intra", "inter"):
            if not isinstance(getattr(self, name), Link):
                raise ValueError(f"Cluster.{name} must be a Link(latency_s, bandwidth)")

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    def fitted(self, workers: int) -> Cluster:
        """This cluster with enough nodes for ``workers`` devices (more nodes of the same
        kind when it is too small; the caller notes it)."""
        need = -(-workers // self.devices_per_node)
        return self if need <= self.nodes else replace(self, nodes=need)

    def compute_scale(self, host_flops: float, devices: int) -> float:
        """Factor from a time measured on this machine to a time on one of these devices."""
        scale = 1.0 if self.device_flops is None else host_flops / self.device_flops
        if self.shared_cores:
            scale *= max(1.0, devices / self.shared_cores)
        return scale

    def intra_link(self, flows: int = 1) -> LinkCosts:
        if self.intra_costs is not None:
            return self.intra_costs
        return self.intra.costs(self.gamma, flows)

    def inter_link(self, flows: int = 1) -> LinkCosts:
        """A link between nodes; ``flows`` streams share each node's NIC."""
        if self.nodes == 1 and self.intra_costs is not None:
            return self.intra_costs
        return self.inter.costs(self.gamma, flows)


def _link(table: Any, where: str) -> Link:
    if not isinstance(table, dict):
        raise ValueError(f"cluster file: [{where}] must be a table with bandwidth_gbps and "
                         f"latency_us")
    for key in ("bandwidth_gbps", "latency_us"):
        if key not in table:
            raise ValueError(f"cluster file: [{where}] needs {key} (e.g. {key} = 100)")
        _positive(f"[{where}]", key, table[key])
    unknown = set(table) - {"bandwidth_gbps", "latency_us"}
    if unknown:
        raise ValueError(f"cluster file: [{where}] has unknown key(s) {sorted(unknown)}; "
                         f"known: bandwidth_gbps, latency_us")
    return Link(table["latency_us"] * 1e-6, table["bandwidth_gbps"] * 1e9 / 8)


_TOP = {"name", "nodes", "devices_per_node", "device_tflops", "device_memory_gb",
        "reduce_gbytes_per_s", "intra", "inter", "description"}


def from_dict(data: dict[str, Any], source: str = "cluster file") -> Cluster:
    """A cluster from parsed TOML; every error names the field and the fix."""
    unknown = set(data) - _TOP
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {sorted(unknown)}; known: {sorted(_TOP)}")
    for key in ("nodes", "devices_per_node", "device_tflops", "device_memory_gb"):
        if key not in data:
            raise ValueError(f"{source}: missing {key} (see docs/simulate.md for an example)")
    _positive(source, "nodes", data["nodes"], integer=True)
    _positive(source, "devices_per_node", data["devices_per_node"], integer=True)
    _positive(source, "device_tflops", data["device_tflops"])
    _positive(source, "device_memory_gb", data["device_memory_gb"])
    reduce_rate = data.get("reduce_gbytes_per_s", 1 / DEFAULT_GAMMA / GB)
    _positive(source, "reduce_gbytes_per_s", reduce_rate)
    for level in ("intra", "inter"):
        if level not in data:
            raise ValueError(f"{source}: missing [{level}] table with bandwidth_gbps and "
                             f"latency_us")
    return Cluster(name=str(data.get("name", Path(source).stem)), nodes=data["nodes"],
                   devices_per_node=data["devices_per_node"],
                   device_flops=data["device_tflops"] * 1e12,
                   device_memory=data["device_memory_gb"] * GB,
                   intra=_link(data["intra"], "intra"), inter=_link(data["inter"], "inter"),
                   gamma=1 / (reduce_rate * GB), description=str(data.get("description", "")))


def load_toml(path: Path) -> Cluster:
    """Read a cluster TOML file (format in the module docstring)."""
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML ({exc})") from None
    return from_dict(data, str(path))


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask; ``os.cpu_count`` where the
    platform has none): what the benchmark's ranks share."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def local(transport: str = "torch") -> Cluster:
    """This machine: one node whose devices are processes sharing its cores, with the
    costs ``disttrain bench comm --calibrate --transport TRANSPORT`` stored for
    ``transport`` (defaults when never calibrated)."""
    cores = usable_cores()
    costs = load_costs(transport)
    return Cluster(name="local", nodes=1, devices_per_node=max(4, cores), device_memory=8 * GB,
                   intra=Link(costs.alpha, 1 / costs.beta), inter=Link(costs.alpha,
                                                                      1 / costs.beta),
                   device_flops=None, gamma=costs.gamma, shared_cores=cores,
                   intra_costs=costs, description=f"this machine ({cores} cores), "
                   f"{transport} transport, costs from {costs.source}")


def _gpu(name: str, nodes: int, inter_gbps: float, inter_us: float, description: str,
         per_node: int = 8) -> Cluster:
    # A100-SXM-80GB class: 312 TFLOP/s dense bf16 peak, assumed 50% sustained; NVLink 3
    # 300 GB/s per direction per GPU, ~5 µs per NCCL step; HBM-bound reduction ~1 TB/s
    return Cluster(name=name, nodes=nodes, devices_per_node=per_node, device_memory=80 * GB,
                   intra=Link(5e-6, 300e9), inter=Link(inter_us * 1e-6, inter_gbps * 1e9 / 8),
                   device_flops=156e12, gamma=1 / 1e12, description=description)


PRESETS = {
    "local": local,
    "nvlink-node": lambda: _gpu("nvlink-node", 1, 400, 10, "one 8-GPU NVLink node "
                                "(A100-class)"),
    "cluster-400g": lambda: _gpu("cluster-400g", 128, 400, 10, "128 nodes × 8 GPUs, NVLink "
                                 "inside a node, 400 Gb/s per node between nodes"),
    "roce-25g": lambda: Cluster(
        name="roce-25g", nodes=128, devices_per_node=4, device_memory=16 * GB,
        intra=Link(10e-6, 10e9), inter=Link(25e-6, 25e9 / 8), device_flops=9.3e12 * 0.45,
        gamma=1 / 300e9, description="Horovod's 2017 testbed: 4 P100 per server (PCIe), "
        "25 Gb/s RoCE between servers"),
}


def get_cluster(spec: str, transport: str = "torch") -> Cluster:
    """A preset name or a path to a ``.toml`` file; ``transport`` picks the calibration of
    ``local`` (this machine), and only that preset has one."""
    if spec == "local":
        return local(transport)
    if transport != "torch":
        raise ValueError(f"--transport {transport} describes this machine's calibration, so "
                         f"it goes with --cluster local only (got --cluster {spec})")
    if spec in PRESETS:
        return PRESETS[spec]()
    path = Path(spec)
    if spec.endswith(".toml") or path.exists():
        if not path.exists():
            raise ValueError(f"cluster file {spec} does not exist")
        return load_toml(path)
    raise ValueError(f"unknown cluster {spec!r}; use a preset ({', '.join(PRESETS)}) or a "
                     f".toml file")
