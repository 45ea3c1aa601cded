"""``disttrain info``: what to check first when a distributed run misbehaves.

Versions, which torch.distributed backends this build has (Gloo, NCCL, MPI) and the NCCL
version, CPU cores and NUMA nodes, GPUs and how they are connected (peer access and
``nvidia-smi topo -m``, bounded by a timeout), the
calibrated transport costs that ``algorithm="auto"`` uses, the peak matrix-multiply
throughput of this machine's CPU and of each GPU (the yardstick of model FLOPs utilization,
``disttrain run --peak-tflops``), and where this process would stand in a job (the launch
variables it sees). ``--json [FILE]`` writes the same as one JSON Lines row (to stdout
without FILE).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from disttrain.flags import add_json_argument, write_rows

_NODE_DIR = Path("/sys/devices/system/node")
_LAUNCH_VARS = re.compile(r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|MASTER_ADDR|"
                          r"MASTER_PORT|GROUP_RANK|DISTTRAIN_\w+|SLURM_(PROCID|LOCALID|NTASKS|"
                          r"JOB_ID|STEP_ID|NODELIST|JOB_NODELIST|STEP_NODELIST)|"
                          r"OMPI_COMM_WORLD_\w+|OMPI_MCA_ess_base_jobid|PMI_RANK|PMI_SIZE|"
                          r"MPI_LOCALRANKID|MPI_LOCALNRANKS|GLOO_SOCKET_IFNAME|"
                          r"NCCL_SOCKET_IFNAME|TORCH_DISTRIBUTED_DEBUG)$")


def configure(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("info", help="show versions, backends, CPUs/NUMA, GPUs and "
                              "calibrated transport costs",
                              description=__doc__.split("\n\n")[1] if __doc__ else None)
    add_json_argument(p, "report: all of the above", optional_file=True)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    facts = collect()
    if args.json is None:
        print(render(facts))
    else:  # one row: one line, to stdout unless a FILE is named
        write_rows(args.json, [facts])
    return 0


def collect() -> dict[str, Any]:
    """Everything ``disttrain info`` shows, as plain data."""
    import torch

    import disttrain

    return {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "disttrain": disttrain.__version__,
        "torch": torch.__version__,
        "backends": backends(),
        "nccl_version": nccl_version(),
        "cpu": cpu(),
        "gpus": gpus(),
        "gpu_topology": nvidia_topology(),
        "calibration": calibration(),
        "peak_tflops": peaks(),
        "launch": launch_environment(),
    }


def backends() -> dict[str, bool]:
    import torch.distributed as dist

    if not dist.is_available():
        return {"gloo": False, "nccl": False, "mpi": False}
    return {"gloo": bool(dist.is_gloo_available()), "nccl": bool(dist.is_nccl_available()),
            "mpi": bool(dist.is_mpi_available())}


def nccl_version() -> str | None:
    """The NCCL this torch was built with (``torch.cuda.nccl.version()``), e.g. ``2.21.5``;
    None in a build without CUDA/NCCL."""
    import torch

    try:
        version: Any = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError, ImportError):  # a CPU build has no NCCL binding
        return None
    if isinstance(version, tuple):
        return ".".join(str(part) for part in version)
    code = int(version)  # older torch: 2.21.5 as 22105 (major·10000 + minor·100 + patch)
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


def numa_nodes(root: Path = _NODE_DIR) -> list[dict[str, Any]]:
    """NUMA nodes with their CPU lists, from sysfs (empty where sysfs has none)."""
    nodes = []
    for path in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpulist = (path / "cpulist").read_text().strip()
        except OSError:
            cpulist = ""
        nodes.append({"node": int(path.name[4:]), "cpus": cpulist})
    return nodes


def cpu() -> dict[str, Any]:
    import torch

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"logical_cores": os.cpu_count(), "usable_cores": usable,
            "torch_threads": torch.get_num_threads(), "numa_nodes": numa_nodes()}


def gpus() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"cuda_available": False, "count": 0, "devices": [], "peer_access": [],
                "cuda_build": torch.version.cuda}
    count = torch.cuda.device_count()
    devices = []
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        devices.append({"index": i, "name": props.name, "memory_bytes": props.total_memory,
                        "capability": f"{props.major}.{props.minor}"})
    peer = [[i == j or bool(torch.cuda.can_device_access_peer(i, j)) for j in range(count)]
            for i in range(count)]
    return {"cuda_available": True, "cuda": torch.version.cuda, "count": count,
            "devices": devices, "peer_access": peer}


def nvidia_topology() -> str | None:
    """``nvidia-smi topo -m`` (links between GPUs, NICs and CPUs), when the tool exists."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return None
    try:
        done = subprocess.run([tool, "topo", "-m"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(nvidia-smi topo -m failed: {exc})"
    return done.stdout.rstrip() if done.returncode == 0 else f"(nvidia-smi: {done.stderr.strip()})"


def calibration() -> dict[str, Any]:
    """The stored α-β costs per transport (see ``disttrain bench comm --calibrate``)."""
    from disttrain.comm.cost_model import calibration_path, load_costs

    path = calibration_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"path": str(path), "stored": False, "transports": {}}
    if not isinstance(data, dict):
        data = {}
    names = sorted(k for k, v in data.items() if isinstance(v, dict))
    return {"path": str(path), "stored": bool(names),
            "transports": {name: asdict(load_costs(name, path)) for name in names}}


PEAK_DTYPES = {"cpu": ("float32",), "cuda": ("float32", "bfloat16")}
_MATMUL_SIZE = {"cpu": 1024, "cuda": 8192}  # n of the n×n matrices: 2n³ FLOPs a product


def measure_peak_tflops(device: str = "cpu", dtype: str = "float32",
                        budget_s: float = 0.4) -> float:
    """The best rate of dense n×n matrix products on ``device`` in ``dtype`` over about
    ``budget_s`` seconds, in TFLOP/s: the peak model FLOPs utilization is measured against
    (docs/training.md). On the CPU it uses torch's threads (all cores, unless told
    otherwise); on a GPU, plain float32 (TF32 as torch's setting has it, off by default)."""
    import torch

    dev = torch.device(device)
    n = _MATMUL_SIZE[dev.type] if dev.type in _MATMUL_SIZE else 1024
    kind = getattr(torch, dtype)
    a = torch.randn(n, n, device=dev).to(kind)
    b = torch.randn(n, n, device=dev).to(kind)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    torch.mm(a, b)  # warm-up: library load, kernel choice
    sync()
    best, deadline, reps = 0.0, time.perf_counter() + budget_s, 1
    while True:
        start = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        sync()
        seconds = time.perf_counter() - start
        best = max(best, 2 * n**3 * reps / max(seconds, 1e-9) / 1e12)
        if time.perf_counter() >= deadline:
            return best
        if seconds < 0.02:  # too short to time well: more products per timing
            reps *= 2


def peaks(budget_s: float = 0.4) -> dict[str, dict[str, float]]:
    """This machine's peak matmul TFLOP/s: the CPU's (all torch threads) in float32, and
    in float32 and bfloat16 the first GPU of each model (``cuda:0`` standing for the GPUs
    like it); about ``budget_s`` seconds each, a quarter of it on a GPU."""
    import torch

    out = {"cpu": {d: round(measure_peak_tflops("cpu", d, budget_s), 4)
                   for d in PEAK_DTYPES["cpu"]}}
    if torch.cuda.is_available():
        seen: set[str] = set()
        for i in range(torch.cuda.device_count()):
            name = torch.cuda.get_device_name(i)
            if name not in seen:
                seen.add(name)
                out[f"cuda:{i}"] = {d: round(measure_peak_tflops(f"cuda:{i}", d,
                                                                 budget_s / 4), 2)
                                    for d in PEAK_DTYPES["cuda"]}
    return out


def launch_environment() -> dict[str, Any]:
    """The launch variables this process sees, and the placement init() would derive."""
    from disttrain.launch.env import PlacementError, resolve_placement

    variables = {k: v for k, v in sorted(os.environ.items()) if _LAUNCH_VARS.match(k)}
    try:
        placement: Any = asdict(resolve_placement(os.environ))
    except (PlacementError, ValueError) as exc:
        placement = f"error: {exc}"
    return {"variables": variables, "placement": placement}


def render(facts: dict[str, Any]) -> str:
    """The human-readable form."""
    b, c, g, cal = facts["backends"], facts["cpu"], facts["gpus"], facts["calibration"]
    lines = [
        f"disttrain {facts['disttrain']}  torch {facts['torch']}  python {facts['python']}",
        f"host       {facts['host']} ({facts['platform']})",
        "backends   " + "  ".join(f"{k}: {'yes' if v else 'no'}" for k, v in b.items())
        + (f"  (NCCL {facts['nccl_version']})" if facts.get("nccl_version") else ""),
        f"cpu        {c['logical_cores']} logical cores, {c['usable_cores']} usable, torch "
        f"threads {c['torch_threads']}",
        f"numa       {len(c['numa_nodes'])} node(s)" + "".join(
            f"\n             node {n['node']}: cpus {n['cpus']}" for n in c["numa_nodes"]),
    ]
    if g["count"]:
        lines.append(f"gpus       {g['count']} (CUDA {g.get('cuda')})")
        lines += [f"             {d['index']}: {d['name']}, {d['memory_bytes'] / 2**30:.1f} GiB, "
                  f"sm {d['capability']}" for d in g["devices"]]
        lines.append("peer access " + "; ".join(
            f"{i}→{[j for j, ok in enumerate(row) if ok and j != i]}"
            for i, row in enumerate(g["peer_access"])))
    else:
        lines.append(f"gpus       none (CUDA not available; torch built with CUDA "
                     f"{g.get('cuda_build') or 'none'})")
    if facts["gpu_topology"]:
        lines += ["topology (nvidia-smi topo -m):", facts["gpu_topology"]]
    lines.append(f"costs      {cal['path']}" + ("" if cal["stored"] else " (none stored: "
                 "defaults; run `disttrain bench comm --calibrate`)"))
    for name, costs in cal["transports"].items():
        lines.append(f"             {name}: alpha {costs['alpha'] * 1e6:.1f} µs, beta "
                     f"{1 / costs['beta'] / 1e9 if costs['beta'] else float('inf'):.2f} GB/s, "
                     f"native alpha {costs['native_alpha'] * 1e6:.1f} µs")
    lines.append("peak       " + "; ".join(
        f"{where} " + ", ".join(f"{dtype} {tflops:g}" for dtype, tflops in rates.items())
        for where, rates in facts["peak_tflops"].items())
        + " TFLOP/s (matmul; --peak-tflops)")
    launch = facts["launch"]
    place = launch["placement"]
    if isinstance(place, dict):
        place = (f"rank {place['rank']} of {place['world_size']} (local {place['local_rank']} "
                 f"of {place['local_world_size']}), master {place['master_addr']}:"
                 f"{place['master_port'] or '-'}, from {place['source']}")
    lines.append(f"placement  {place}")
    lines += [f"             {k}={v}" for k, v in launch["variables"].items()]
    return "\n".join(lines)
