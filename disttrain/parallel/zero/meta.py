"""Meta-device initialisation: a model built on ``torch.device("meta")`` is materialised shard by
shard, never whole, and equals what eager initialisation with the same seed builds, bit for bit.

    with torch.device("meta"):
        model = Transformer(config)        # shapes only: no memory, no random numbers drawn
    torch.manual_seed(0)                   # the same seed on every rank
    zero = ZeRO3(model, comm, adam)        # each rank keeps its shards, never the model

**Why it equals eager initialisation.** Eager construction runs each torch layer's
``reset_parameters()`` at the end of its ``__init__``, so children draw from the global
generator before their parent; ``model.apply(fn)`` calls ``fn`` in that order too
(post-order). A wrapper runs the same initialisers in the same order, each module once, on
every rank from the same generator state (checked: ranks seeded differently are an error,
not a silently different model). Every rank therefore draws the same numbers for every
unit, keeps its shard and drops the rest; no value crosses the network.

**What exists at once.** Stage 3 walks the modules in that order, materialises a unit (the
parameters it gathers together) just before the first module of the unit's subtree runs
its initialiser, and right after the unit's own module (the last of its subtree) keeps this
rank's shard and frees the rest::

    post-order:   l0        l1        l2   ...   root      (default units: every module
    unit l0:     [open─init─shard,free]                     that owns parameters)
    unit l1:               [open─init─shard,free]
    peak:         this rank's shards + one unit (+ the root's unit, open throughout, when
                  parameters sit outside every unit: it is gathered for all of forward too)

Stages 1 and 2 keep every parameter on every rank by design (PΨ): meta initialisation
writes straight into their flat buffer, so the wrap-time peak is that buffer instead of the
eager model plus the buffer (2PΨ), never less than the model.

**Initialisers.** ``MetaInit(init=fn)`` calls ``fn(module)`` on every module; without it,
each module that holds tensors on the meta device calls its own ``reset_parameters()`` (or
``init_weights()``), and one with neither is an error naming it. Floating tensors start as
NaN, so a parameter no initialiser wrote is an error naming it, not silent garbage.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel.mesh import check_agreement
from disttrain.parallel.zero.memory import WrapMemory
from disttrain.parallel.zero.sharding import ShardLayout, param_views

Group = tuple[nn.Module, Sequence[nn.Parameter]]
"""Parameters materialised together, and the module whose subtree holds their users."""

_DEFAULT_METHODS = ("reset_parameters", "init_weights")


@dataclass(frozen=True)
class MetaInit:
    """How a ZeRO wrapper materialises a model built on the meta device.

    * ``init``: called as ``init(module)`` on every module, children before parents (the
      order of ``model.apply(init)``); it must set the module's own tensors. ``None``: each
      module that holds meta tensors calls its own ``reset_parameters()`` or
      ``init_weights()``, as eager construction does.
    * ``device``: where the shards live; ``None``: the communicator's device.
    """

    init: Callable[[nn.Module], object] | None = None
    device: torch.device | str | None = None

    def __post_init__(self) -> None:
        if self.init is not None and not callable(self.init):
            raise ValueError(f"MetaInit.init must be a function init(module) or None, got "
                             f"{self.init!r}")
        if self.device is not None:
            try:
                device = torch.device(self.device)
            except (RuntimeError, TypeError) as exc:
                raise ValueError(f"MetaInit.device={self.device!r} is not a device ('cpu', "
                                 f"'cuda:0', …): {exc}") from exc
            if device.type == "meta":
                raise ValueError("MetaInit.device is where the shards are materialised; "
                                 "choose a real device ('cpu', 'cuda'), not 'meta'")


@dataclass(frozen=True)
class InitPlan:
    """Every module in post-order (``name``, module, its initialiser or None), the device,
    and parameter names by identity (for errors)."""

    device: torch.device
    steps: tuple[tuple[str, nn.Module, Callable[[], object] | None], ...]
    names: dict[int, str]
    by_user: bool


def plan(model: nn.Module, meta_init: MetaInit | None, default: torch.device
         ) -> InitPlan | None:
    """The initialisation plan of a model on the meta device; ``None`` for a materialised
    one. Raises, naming the module, if a module holding meta tensors has no initialiser."""
    named = [*model.named_parameters(remove_duplicate=False),
             *model.named_buffers(remove_duplicate=False)]
    meta = [n for n, t in named if t.is_meta]
    if not meta:
        if meta_init is not None:
            raise ValueError("meta_init is for a model built on torch.device('meta'), but no "
                             "tensor of this one is on it; drop meta_init")
        return None
    real = [n for n, t in named if not t.is_meta]
    if real:
        raise ValueError(f"the model is partly on the meta device ({meta[0]!r}) and partly "
                         f"materialised ({real[0]!r}); build all of it under "
                         f"torch.device('meta'), or none")
    meta_init = meta_init or MetaInit()
    device = default if meta_init.device is None else torch.device(meta_init.device)
    steps = []
    for name, module in _post_order(model):
        steps.append((name, module, _initialiser(name, module, meta_init.init)))
    names = {id(t): n for n, t in (*model.named_parameters(), *model.named_buffers())}
    return InitPlan(device, tuple(steps), names, meta_init.init is not None)


def _post_order(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules children first (``model.apply``'s order), each once."""
    seen: set[int] = set()
    order: list[tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> None:
        seen.add(id(module))
        for child_name, child in module.named_children():
            if id(child) not in seen:
                visit(f"{name}.{child_name}" if name else child_name, child)
        order.append((name, module))

    visit("", model)
    return order


def _initialiser(name: str, module: nn.Module, init: Callable[[nn.Module], object] | None
                 ) -> Callable[[], object] | None:
    if init is not None:
        return lambda: init(module)
    own = [n for n, t in (*module.named_parameters(recurse=False),
                          *module.named_buffers(recurse=False)) if t.is_meta]
    if not own:
        return None
    for method in _DEFAULT_METHODS:
        found = getattr(module, method, None)
        if callable(found):
            return found  # type: ignore[no-any-return]
    where = f"module {name!r}" if name else "the root module"
    raise ValueError(f"{where} ({type(module).__name__}) holds {own[0]!r} on the meta device "
                     f"but has no reset_parameters() or init_weights() to initialise it: give "
                     f"it one, or pass meta_init=MetaInit(init=fn) with fn(module) setting "
                     f"each module's own tensors")


def check_same_generator(comms: Sequence[Communicator | None], device: torch.device) -> None:
    """Raise on every rank unless all ranks' random generators (of ``device``) agree: each
    rank initialises every unit itself, so they must draw the same numbers."""
    state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
    digest = int.from_bytes(hashlib.sha256(state.cpu().numpy().tobytes()).digest()[:7], "big")
    for comm in comms:
        if comm is not None and comm.world_size > 1:
            check_agreement(comm, [digest], "the random generator state (hashed) before meta "
                            "initialisation", fix="seed every rank alike (torch.manual_seed) "
                            "before wrapping: each rank draws every unit and keeps its shard")


def bind(params: Sequence[nn.Parameter], views: Sequence[torch.Tensor]) -> None:
    """Give each meta parameter its view (NaN-filled) as its memory, keeping the parameter
    object (``torch.utils.swap_tensors``: tied modules and references stay valid)."""
    with torch.no_grad():
        for p, view in zip(params, views):
            if view.is_floating_point():
                view.fill_(float("nan"))
            torch.utils.swap_tensors(p, nn.Parameter(view, requires_grad=p.requires_grad))


def detach_from_buffer(params: Sequence[nn.Parameter]) -> None:
    """Give each parameter bound by :func:`bind` a fresh tensor of its own: a view shares
    its buffer's version counter, so a later in-place write to the buffer (ZeRO-3's
    all-gather before backward) would look to autograd like a change to every parameter
    that forward saved. Eager parameters have counters of their own; so do these now."""
    for p in params:
        empty = torch.empty(0, dtype=p.dtype, device=p.device)
        torch.utils.swap_tensors(p, nn.Parameter(empty, requires_grad=p.requires_grad))


def bind_flat(params: Sequence[nn.Parameter], layout: ShardLayout, dtype: torch.dtype,
              device: torch.device, memory: WrapMemory) -> torch.Tensor:
    """A padded flat buffer (padding zeros) whose views become the parameters' memory."""
    flat = torch.zeros(layout.padded_total, dtype=dtype, device=device)
    memory.add(flat)
    bind(params, param_views(flat, params, layout))
    return flat


def materialise(plan: InitPlan, groups: Sequence[Group], memory: WrapMemory,
                open_group: Callable[[int], None] | None = None,
                close_group: Callable[[int], None] | None = None) -> None:
    """Run every initialiser in plan order; ``open_group(g)`` before the first module of
    group g's subtree (it binds the group's parameters; None: they are bound already),
    ``close_group(g)`` right after the group's own module (checked first: no parameter of
    it may still be NaN). Tensors outside every group (frozen parameters, buffers) are
    materialised and kept."""
    position = {id(m): i for i, (_, m, _) in enumerate(plan.steps)}
    spans = [(min(position[id(m)] for m in root.modules()), position[id(root)])
             for root, _ in groups]
    closed: dict[int, int] = {}  # parameter of a closed group → its version then
    for i, (name, module, initialise) in enumerate(plan.steps):
        for g, (start, _) in enumerate(spans):
            if start == i and open_group is not None:
                open_group(g)
        _materialise_own(plan, name, module, memory)
        if initialise is not None:
            with torch.no_grad():
                initialise()
        for g, (_, end) in enumerate(spans):
            if end == i:
                _check_set(plan, groups[g][1])
                if close_group is not None:
                    close_group(g)
                closed.update({id(p): p._version for p in groups[g][1]})
    kept = [*(p for _, m, _ in plan.steps for p in m.parameters(recurse=False)
              if id(p) not in closed), *(b for _, m, _ in plan.steps for b in m.buffers(False))]
    _check_set(plan, kept)
    late = [p for _, m, _ in plan.steps for p in m.parameters(recurse=False)
            if id(p) in closed and p._version != closed[id(p)]]
    if late:
        raise ValueError(f"an initialiser wrote parameter {plan.names[id(late[0])]!r} after its "
                         f"unit was sharded (it initialises another unit's parameters): pass "
                         f"units=[...] with one unit holding the initialiser's module and its "
                         f"parameters")


def _materialise_own(plan: InitPlan, name: str, module: nn.Module, memory: WrapMemory) -> None:
    """Materialise ``module``'s own meta tensors that no group bound (frozen parameters,
    buffers): NaN-filled, kept. A trainable one still on meta lies outside its group."""
    for pname, p in module.named_parameters(recurse=False):
        if p.is_meta and p.requires_grad:
            raise ValueError(f"module {name or 'root'!r} initialises parameter "
                             f"{plan.names.get(id(p), pname)!r} before its unit is "
                             f"materialised (a parameter tied across units): pass units=[...] "
                             f"with one unit holding every module that uses it")
        if p.is_meta:
            bind([p], [torch.empty(p.shape, dtype=p.dtype, device=plan.device)])
            memory.add(p)
    for b in module.buffers(recurse=False):
        if b.is_meta:
            fresh = torch.zeros(b.shape, dtype=b.dtype, device=plan.device)
            if fresh.is_floating_point():
                fresh.fill_(float("nan"))
            torch.utils.swap_tensors(b, fresh)
            memory.add(b)


def _check_set(plan: InitPlan, tensors: Sequence[torch.Tensor]) -> None:
    """Raise, naming it, if a floating tensor is still NaN (no initialiser wrote it)."""
    for t in tensors:
        if t.is_floating_point() and t.numel() and bool(torch.isnan(t).any()):
            name = plan.names.get(id(t), "a tensor")
            how = ("MetaInit.init does not set it (it is called on every module, children "
                   "first)" if plan.by_user else "its module's reset_parameters() / "
                   "init_weights() does not set it")
            raise ValueError(f"meta initialisation left {name!r} unset (NaN): {how}; set every "
                             f"tensor there (or pass units=[...] so that the module whose "
                             f"initialiser sets it shares its unit)")
