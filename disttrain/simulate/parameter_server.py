"""Parameter servers (sync, async, SSP) as an event simulation with representative workers.

S servers each hold 1/S of the parameters (key ranges of equal size) and are symmetric, so
one server is simulated and carries the traffic of every worker. W workers are represented
by at most 32 (speed factor, weight) pairs (:meth:`Speeds.representatives`): a
representative of weight w stands for w workers whose messages reach the server together,
so the server's NIC is busy w times as long. Per clock a worker::

    pull(c) ──▶ compute(c) ──▶ push(c) ──▶ server apply ──▶ pull(c+1)
                 (× its speed)   server NIC in    server CPU   server NIC out

A transfer of k messages lasts max(α + w·(Ψ/S)·β on the server, S·k·α + Ψ·β on the
worker): the server's NIC is shared by everyone (it serves requests in arrival order: the
"ready" policy; the latencies of different workers' conversations overlap), a worker's own
NIC sends its whole model once and waits for each of its k messages per server in turn.
The protocol (:mod:`disttrain.parallel.parameter_server.protocol`) fixes k: a pull is a
request, a reply header and the values (3 messages, 1 round trip); a push is a header, a
GRANT, the payload and a REPLY (4 messages, 2 round trips). α is the transport's
per-message cost, software included (calibrated on this machine); on this machine each
exchange also pays the measured wake-up of communication issued after compute
(:attr:`~disttrain.simulate.base.Case.wakeup`). When the profile measured a pull and a push
through disttrain's own server here (:mod:`~disttrain.probe.ps_probe`: 1.6-2.2 and
2.5-3.8 ms for LeNet, several times their messages' α-β cost, because both sides run
Python per message), those replace the formula on this machine. Of an exchange, the share
the server serves one worker at a time is what a second worker added to the probe's
clock (``ps_served_s``): on Gloo here about the whole exchange, on shared memory about
0.6 of it (docs/simulate.md, "Overheads"). That share is served in turn, once per worker
a representative stands for; the rest is the worker's own and runs on its cores beside
the other workers'. Each clock a worker also
runs the loop's own work (``Overheads.step_s``); the server applies the optimizer on Ψ/S.
On this machine workers and servers are processes sharing its cores (their compute and
the server's apply share them in the simulation). Modes:

* **sync** (BSP): the server applies once all workers of clock c have pushed; everyone
  then pulls. The step waits for the slowest worker.
* **async**: every push is applied as it arrives; a fast worker is never held back.
* **ssp** (bounded staleness s): like async, but a worker starts clock c only after every
  worker has pushed clock c − s − 1.

Servers sit on their own nodes, one NIC each (the cluster's inter-node link); workers share
their node's NIC. Step time is the time per W worker updates (one global batch).
"""

from __future__ import annotations

from disttrain.simulate.base import Case, StepResult
from disttrain.simulate.events import Simulation
from disttrain.simulate.memory import activations

MODES = ("sync", "async", "ssp")
PULL_MESSAGES = 3  # request header; reply header; values
PUSH_MESSAGES = 4  # request header; GRANT; payload; reply


def _split(case: Case) -> bool:
    """Whether exchanges are charged as probed served and own shares (this machine, a
    profile that probed a second worker)."""
    return bool(case.cluster.intra_costs is not None and case.cluster.nodes == 1
                and case.overheads.ps_served_s > 0 and case.overheads.ps_pull_s > 0)


def _transfer(case: Case, servers: int, weight: float, element_bytes: int,
              messages: int) -> tuple[float, float]:
    """(seconds on the server, seconds on the worker) of one representative's push (or
    pull) of the whole model, ``messages`` messages per server.

    On this machine, when the profile measured them, a pull and a push cost what
    disttrain's own server took for one worker (``Overheads.ps_pull_s``, ``ps_push_s``: its
    messages and both sides' Python). Their served share (``ps_served_s``, split between
    them in proportion) is served in turn, once per worker the representative stands for;
    the rest is the worker's own, which the workers run side by side on their cores. A
    profile without ``ps_served_s`` charges the whole exchange in turn."""
    psi = case.profile.params * element_bytes
    cluster = case.cluster
    if cluster.intra_costs is not None and cluster.nodes == 1:  # this machine: one host
        o = case.overheads
        measured = o.ps_pull_s if messages == PULL_MESSAGES else o.ps_push_s
        if _split(case):
            # the whole exchange when the second worker added all of it (rounding can
            # leave the rest a hair below 0)
            share = min(1.0, o.ps_served_s / (o.ps_pull_s + o.ps_push_s))
            return weight * share * measured, max(0.0, (1.0 - share) * measured)
        if measured > 0:
            return weight * measured, 0.0  # the S servers answer their shares side by side
        server = worker = cluster.intra_costs.at(case.workers + servers)
    else:
        server = cluster.inter_link()
        worker = cluster.inter_link(min(case.workers, cluster.devices_per_node))
    return max(server.alpha + weight * psi / servers * server.beta,
               worker.alpha * messages * servers + psi * worker.beta + case.wakeup), 0.0


def simulate_ps(case: Case, mode: str) -> StepResult:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    wl = case.workload
    servers = wl.servers or max(1, case.workers // 8)
    reps = wl.speeds.representatives(case.workers)
    compute_1 = case.profile.compute(case.global_batch / case.workers) * case.scale \
        + case.overheads.step_s
    sim = case.simulation()
    # the server's NIC, or on this machine its turn with one worker at a time: wall-clock
    # time (the server's CPU and its waits), not a core's worth of load
    for name in ("server.in", "server.out"):
        sim.resource(name, "ready")
    case.compute(sim, "server.cpu", servers, "ready")  # S symmetric servers, one simulated
    for r, (_, w) in enumerate(reps):
        case.compute(sim, f"w{r}", w)
    pull = [_transfer(case, servers, w, wl.element_bytes, PULL_MESSAGES) for _, w in reps]
    push = [_transfer(case, servers, w, wl.element_bytes, PUSH_MESSAGES) for _, w in reps]
    pulled = [_pull(sim, r, 0, pull[r], ()) for r in range(len(reps))]
    done: list[list[int]] = []  # per clock: the updates applied (one when sync)
    for c in range(wl.clocks):
        done.append(_clock(sim, case, mode, c, reps, (pull, push), pulled, done, servers,
                           compute_1))
    sim.run()
    return _result(case, mode, sim, reps, pulled, servers, compute_1)


def _pull(sim: Simulation, r: int, c: int, seconds: tuple[float, float],
          deps: tuple[int, ...]) -> int:
    """Representative ``r``'s pull of clock ``c``: the server's share, then its own."""
    served = sim.add(f"w{r}.pull{c}", "server.out", seconds[0], deps, "comm")
    return sim.add(f"w{r}.pulled{c}", f"w{r}", seconds[1], (served,), "comm") \
        if seconds[1] else served


def _push(sim: Simulation, r: int, c: int, seconds: tuple[float, float],
          deps: tuple[int, ...]) -> int:
    """Representative ``r``'s push of clock ``c``: its own share, then the server's."""
    if seconds[1]:
        deps = (sim.add(f"w{r}.pushing{c}", f"w{r}", seconds[1], deps, "comm"),)
    return sim.add(f"w{r}.push{c}", "server.in", seconds[0], deps, "comm")


def _clock(sim: Simulation, case: Case, mode: str, c: int, reps: list[tuple[float, float]],
           transfer: tuple[list[tuple[float, float]], list[tuple[float, float]]],
           pulled: list[int], done: list[list[int]], servers: int, compute_1: float
           ) -> list[int]:
    """Clock ``c`` of every representative: compute, push, apply, pull (``pulled`` is
    updated in place). Returns the clock's apply tasks."""
    wl = case.workload
    pull, push = transfer
    apply_1 = case.optimizer(case.profile.params / servers)
    pushes, applies = [], []
    for r, (factor, w) in enumerate(reps):
        deps = [pulled[r]]
        if mode == "ssp" and c - wl.staleness - 1 >= 0:  # wait for the slowest's clock
            deps += done[c - wl.staleness - 1]
        comp = sim.add(f"w{r}.c{c}", f"w{r}", compute_1 * factor, tuple(deps), "compute")
        pushes.append(_push(sim, r, c, push[r], (comp,)))
        if mode != "sync":  # applied on arrival
            applies.append(sim.add(f"apply{c}.{r}", "server.cpu", apply_1 * w,
                                   (pushes[-1],), "optimizer"))
    if mode == "sync":  # sum every worker's gradient, then one update
        reduce_s = case.workers * case.profile.params / servers * wl.element_bytes \
            * case.cluster.gamma
        applies.append(sim.add(f"apply{c}", "server.cpu", apply_1 + reduce_s, tuple(pushes),
                               "optimizer"))
    for r in range(len(reps)):
        src = applies[0] if mode == "sync" else applies[r]
        pulled[r] = _pull(sim, r, c + 1, pull[r], (src,))
    return applies


def _result(case: Case, mode: str, sim: Simulation, reps: list[tuple[float, float]],
            pulled: list[int], servers: int, compute_1: float) -> StepResult:
    wl = case.workload
    # throughput in worker updates per second: each representative's own rate
    rate = sum(w * wl.clocks / sim.end(pulled[r]) for r, (_, w) in enumerate(reps))
    step = case.workers / rate
    psi = case.profile.params
    saved = sum(lay.saved_bytes_per_sample for lay in case.profile.layers)
    batch = case.global_batch / case.workers
    mem = 2 * psi * wl.element_bytes + activations(saved, batch, wl.element_bytes)
    worker_bytes = psi * wl.element_bytes  # one push per step (pulls are received)
    server_busy = sim.busy("server.in") / sim.makespan if sim.makespan else 0.0
    notes = [f"{servers} server(s), server NIC busy {server_busy:.0%}"]
    slowest = max(f for f, _ in reps)
    if slowest > 1:
        notes.append(f"slowest worker ×{slowest:.2f}")
    return StepResult(
        f"ps-{mode}", case.workers, case.global_batch, step, case.ideal_s(), mem, worker_bytes,
        case.cluster.device_memory, tuple(notes),
        {"servers": servers, "representatives": len(reps), "compute_s": compute_1,
         "optimizer_s": case.optimizer(psi / servers),  # a server's apply, as _clock charges
         "server_bytes_per_step": case.workers * psi / servers * 2 * wl.element_bytes,
         "server_memory_bytes": psi / servers * (wl.element_bytes + wl.k_bytes),
         "server_nic_busy": server_busy, "events": len(sim)})
