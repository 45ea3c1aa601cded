"""The strategies users know by name, as data: which mesh dimensions each uses, how large,
and with what options. One table, read by the composer that builds them
(:mod:`disttrain.train.strategies.compose`), the simulator, the memory formulas and the
benchmark, so a name is defined once.

A preset's dimensions follow the mesh (:mod:`disttrain.parallel.mesh`), each with a rule
for its size: ``ALL`` (every rank), ``FLAG`` (``--tp``, ``--pp``, ``--dp``: 1 when not
given), ``FLAG_OR_ALL`` (the flag, else every rank) and ``REST`` (the ranks the others
leave). The options say what runs along them: ``zero`` is the ZeRO stage over the data-
parallel ranks (0: DDP's replicated state), ``schedule`` the pipeline's, ``microbatches``
a fixed count (model parallelism is a pipeline of one micro-batch), ``sequence_parallel``
tensor parallelism's variant. ``ddp``, ``zero1-3``, ``gpipe``, ``1f1b``, ``model-parallel``,
``tp``, ``tp-sp`` and ``3d`` are all one composition: tensor parallelism, then a pipeline
(or the whole module), then DDP or ZeRO over dp. The parameter servers are another
architecture (servers beside workers), and ``single`` is the reference.

Pure data, no torch: the simulator's model imports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALL, FLAG, FLAG_OR_ALL, REST = "all", "flag", "flag-or-all", "rest"
RULES = (ALL, FLAG, FLAG_OR_ALL, REST)
# ParallelOptions fields (flags) by what they tune
DATA_PARALLEL = frozenset({"bucket_cap_mb", "find_unused_parameters", "broadcast_buffers"})
PIPELINE = frozenset({"schedule", "microbatches", "partition", "pp_size"})
SERVERS = frozenset({"servers", "straggler", "straggler_every"})
MESH = frozenset({"tp_size", "dp_size", "pp_size", "sequence_parallel", "zero", "algorithm",
                  "schedule", "microbatches", "partition"})
CONTEXT = frozenset({"cp_size", "cp_variant", "dp_size", "algorithm"})
EXPERTS = frozenset({"ep_size", "dp_size", "algorithm"})


@dataclass(frozen=True)
class Preset:
    """One strategy name: its dimensions (mesh dimension, size rule) and options."""

    description: str
    dims: tuple[tuple[str, str], ...] = ()
    zero: int = 0  # ZeRO stage over the data-parallel ranks (0: replicated, DDP)
    schedule: str | None = None  # the pipeline's ("gpipe", "1f1b") when pp is used
    microbatches: int | None = None  # fixed micro-batches per step (None: --microbatches)
    sequence_parallel: bool = False
    parameter_server: str | None = None  # "sync", "async", "ssp": servers beside workers
    reference: bool = False  # one process: the reference every other must match
    options: frozenset[str] = frozenset()  # the ParallelOptions fields it accepts

    def __post_init__(self) -> None:
        for dim, rule in self.dims:
            if rule not in RULES:
                raise ValueError(f"preset dimension {dim}: rule {rule!r} is not one of {RULES}")
        if not 0 <= self.zero <= 3:
            raise ValueError(f"zero stage {self.zero} is not 0..3")

    @property
    def uses(self) -> frozenset[str]:
        """The mesh dimensions this preset may spread over (``dp`` for data parallelism)."""
        return frozenset(dim for dim, _ in self.dims)

    @property
    def kind(self) -> str:
        """How its ranks divide the data: ``data`` (replicas), ``pipeline`` (replicas of a
        pipeline), ``model`` (one split model), ``mesh`` (dp × pp × tp), ``ps``."""
        if self.parameter_server:
            return "ps"
        if self.uses & {"tp", "cp", "ep"}:
            return "mesh"
        if "pp" in self.uses:
            return "pipeline" if "dp" in self.uses else "model"
        return "data"


def _zero(stage: int, what: str) -> Preset:
    return Preset(f"ZeRO stage {stage}: {what} sharded", (("dp", ALL),), zero=stage,
                  options=frozenset({"algorithm", "dp_shard", "dp_replicate", "meta_init"}))


def _pipeline(schedule: str, what: str, more: frozenset[str] = frozenset()) -> Preset:
    return Preset(f"pipeline, {what}", (("pp", FLAG_OR_ALL), ("dp", REST)), schedule=schedule,
                  options=PIPELINE | more)


def _servers(mode: str, what: str, more: frozenset[str] = frozenset()) -> Preset:
    return Preset(f"parameter server, {what}", parameter_server=mode, options=SERVERS | more)


PRESETS: dict[str, Preset] = {
    "single": Preset("one process, the reference", reference=True),
    "ddp": Preset("disttrain DataParallel: bucketed all-reduce overlapping backward",
                  (("dp", ALL),), options=DATA_PARALLEL | {"compression", "algorithm"}),
    "zero1": _zero(1, "optimizer state"),
    "zero2": _zero(2, "optimizer state and gradients"),
    "zero3": _zero(3, "optimizer state, gradients and parameters"),
    "model-parallel": Preset("layers split over the ranks, one batch at a time (a pipeline "
                             "of one micro-batch)", (("pp", ALL),), schedule="gpipe",
                             microbatches=1, options=frozenset({"partition"})),
    "gpipe": _pipeline("gpipe", "GPipe schedule (all forwards, then all backwards)"),
    "1f1b": _pipeline("1f1b", "1F1B schedule (PipeDream-Flush; --virtual-stages V: "
                              "interleaved)", frozenset({"virtual_stages"})),
    "ps-sync": _servers("sync", "synchronous SGD (workers + --servers ranks)"),
    "ps-async": _servers("async", "asynchronous SGD (updates applied on arrival)",
                         frozenset({"staleness_lr"})),
    "ps-ssp": _servers("ssp", "stale-synchronous SGD (at most --staleness steps ahead)",
                       frozenset({"staleness", "staleness_lr"})),
    "tp": Preset("tensor parallel over every rank: attention by heads, MLP column-then-row, "
                 "vocabulary-parallel embedding and loss", (("tp", ALL),),
                 options=frozenset({"algorithm", "sequence_parallel"})),
    "tp-sp": Preset("tensor parallel with sequence parallelism (LayerNorm regions split "
                    "along the sequence)", (("tp", ALL),), sequence_parallel=True,
                    options=frozenset({"algorithm", "sequence_parallel"})),
    "3d": Preset("data × pipeline × context × tensor parallel on one mesh (--dp, --pp, "
                 "--cp, --tp; --zero 1-3 over dp)",
                 (("tp", FLAG), ("cp", FLAG), ("pp", FLAG), ("dp", REST)), schedule="1f1b",
                 options=MESH | {"cp_size", "cp_variant"}),
    "cp": Preset("context parallel: each sequence split over the ranks, causal attention "
                 "across them (ring or Ulysses)", (("cp", FLAG_OR_ALL), ("dp", REST)),
                 options=CONTEXT),
    "ep": Preset("expert parallel: each mixture-of-experts layer's experts spread over the "
                 "ranks, tokens moved by all-to-all", (("ep", FLAG_OR_ALL), ("dp", REST)),
                 options=EXPERTS),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of: "
                         f"{', '.join(PRESETS)}") from None


def zero_presets() -> tuple[str, ...]:
    """The names of ZeRO's stages over plain data parallelism, in stage order."""
    return tuple(sorted((n for n, p in PRESETS.items() if p.zero and p.kind == "data"),
                        key=lambda n: PRESETS[n].zero))


DEGREES = ("dp", "pp", "cp", "ep", "tp")  # the sizes a preset's rules set, mesh order


def degrees(preset: Preset, world_size: int, **flags: int | None) -> dict[str, int]:
    """Each mesh dimension's size (``dp``, ``pp``, ``cp``, ``ep``, ``tp``) for
    ``world_size`` ranks under ``preset``, given the flags (``dp=``, ``pp=``, …; None: not
    given); sizes that do not fit are a ValueError naming the flags and the fix."""
    unknown = sorted(set(flags) - set(DEGREES))
    if unknown:
        raise ValueError(f"unknown mesh size(s) {unknown}; the flags are {', '.join(DEGREES)}")
    sizes = dict.fromkeys(DEGREES, 1)
    rest = None
    for dim, rule in preset.dims:
        given = flags.get(dim)
        if rule == ALL:
            sizes[dim] = world_size
        elif rule == FLAG:
            sizes[dim] = 1 if given is None else given
        elif rule == FLAG_OR_ALL:
            sizes[dim] = world_size if given is None else given
        else:
            rest = dim
    shown = [d for d in DEGREES if d in ("dp", "pp", "tp") or (
        d in preset.uses and (sizes[d] > 1 or flags.get(d) is not None))]  # cp, ep: if used
    if rest is not None:
        others = math.prod(size for dim, size in sizes.items() if dim != rest)
        given = flags.get(rest)
        if given is not None:
            sizes[rest] = given
        elif world_size % others:
            named = " × ".join(f"--{d} {sizes[d]}" for d in shown if d != rest)
            raise ValueError(f"{named} = {others} does not divide the world size "
                             f"{world_size}; choose sizes whose product divides it ({rest} "
                             f"takes the rest)")
        else:
            sizes[rest] = world_size // others
    product = math.prod(sizes.values())
    if product != world_size:
        named = " × ".join(f"--{d} {sizes[d]}" for d in shown)
        raise ValueError(f"{named} = {product} ranks, but the world has {world_size}; make "
                         f"the product equal the world size")
    return sizes
