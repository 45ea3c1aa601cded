"""ZeRO-3's pattern on this machine: what each of its collectives costs besides its
calibrated ring time, read from :func:`~disttrain.probe.contention.unit_ops_in_step`.

The probe times a step of ZeRO-3's shape (per unit an all-gather issued before the unit's
compute and waited for after it, in a forward and a backward pass; in the backward a
reduce-scatter after the wait, all waited for at the end) with and without its
collectives. :func:`unit_price` turns what they added into a price per collective
(``Overheads.unit_op_by_ranks``, printed ``zero3_op_{p}ranks_s``) by simulating that same
pattern with the simulation's rules (:func:`unit_pattern_added`) and solving for the price
that adds as much: the price is then what the simulation must charge for the probe to come
out as measured.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from disttrain.simulate import cluster
from disttrain.simulate.collectives import collective_time, group_of


def unit_bytes(layers: Iterable[nn.Module]) -> list[int]:
    """Parameter bytes of each of the model's ``layers`` (its pipeline split, as the profile
    times it) that has parameters: ZeRO-3's units, as the simulation gathers them."""
    sizes = [sum(p.numel() * 4 for p in layer.parameters() if p.requires_grad)
             for layer in layers]
    return [n for n in sizes if n > 0]


def unit_price(added: float, sizes: list[int], ranks: int, transport: str,
               work_s: float = 0.0) -> float:
    """Per collective of ZeRO-3's pattern, what the simulation must charge each besides
    its calibrated ring time on this machine (``local(transport)``), in place of the call
    overhead and the wake-up, so that the probe's own pattern, simulated as the simulation
    runs collectives (on the link, one at a time, beside the compute), adds to its step
    what the probe measured (``added``, :func:`~disttrain.probe.contention.
    unit_ops_in_step`; ``work_s``, the probe's computation per unit and pass). Not the
    measured time less the calibrated times as if nothing overlapped: on 2 bound ranks the
    probe adds what its collectives cost calibrated (3.0 ms for LeNet on Gloo), so that
    difference reads 0, while the simulation hides part of each behind the units' compute
    and the runs pay ~0.1 ms a collective more (docs/simulate.md, "Why the model is built
    this way"). At least 0; 0 when the probe failed."""
    if added <= 0 or not sizes:
        return 0.0
    here = cluster.local(transport)
    group = group_of(here, ranks)
    gathers = [collective_time(here, "all_gather", "ring", group, n)[0] for n in sizes]
    scatters = [collective_time(here, "reduce_scatter", "ring", group, n)[0] for n in sizes]
    if unit_pattern_added(0.0, work_s, gathers, scatters) >= added:
        return 0.0
    low, high = 0.0, added  # each collective charged ``added`` more adds more than that
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if unit_pattern_added(mid, work_s, gathers, scatters) < added \
            else (low, mid)
    return (low + high) / 2


def unit_pattern_added(each: float, work_s: float, gathers: list[float],
                       scatters: list[float]) -> float:
    """What :func:`~disttrain.probe.contention.unit_ops_in_step`'s pattern adds to a
    step when every collective costs ``each`` plus its own time (``gathers[k]``,
    ``scatters[k]`` for unit k) on a link that runs one at a time beside the compute, as
    the simulation charges them: per unit and pass an all-gather issued as ``work_s`` of
    compute starts and waited for after it; in the backward pass a reduce-scatter issued
    after that wait, all waited for at the end of the pass."""
    clock = link = 0.0
    for backward in (False, True):
        for gather, scatter in zip(gathers, scatters, strict=True):
            link = max(clock, link) + each + gather
            clock = max(clock + work_s, link)
            if backward:
                link = max(clock, link) + each + scatter
        clock = max(clock, link) if backward else clock
    return clock - 2 * len(gathers) * work_s
