"""``disttrain.init()``: join the job this process was started in and return its Communicator.

One call works under ``disttrain launch``, ``torchrun``, Slurm's ``srun``, ``mpirun``, with explicit
arguments, or in a plain ``python train.py`` (a world of one)::

    comm = disttrain.init()          # torchrun's, mpirun's or srun's variables
    comm.all_reduce(grad)
    disttrain.shutdown(comm)

It picks the backend by the device (``device="cuda"``: NCCL on this rank's GPU,
``cuda:LOCAL_RANK``; ``"cpu"``: Gloo; ``None``/``"auto"``: NCCL when CUDA is available, else
Gloo; ``backend=`` or $DISTTRAIN_BACKEND overrides), bounds the rendezvous and every later
wait by a timeout (``timeout_s``, else $DISTTRAIN_TIMEOUT, else 5 minutes; the start-up by
``init_timeout_s``, else $DISTTRAIN_INIT_TIMEOUT, else the larger of the two), turns on desync
checks with ``debug=True`` or DISTTRAIN_DEBUG=1, and installs the failure hooks of
:mod:`disttrain.launch.hooks` (error record, flight-recorder dump, named root cause, and a
bounded exit: ``exit_timeout_s``, else $DISTTRAIN_EXIT_TIMEOUT, else 30 s).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
import os
import weakref
from typing import Any

import torch
import torch.distributed as dist

from disttrain.comm import CommConfig, Communicator, liveness
from disttrain.comm.p2p_work import polled_messages, wait_polled_messages
from disttrain.launch import env as envmod
from disttrain.launch import hooks, netif, rendezvous, threads

log = logging.getLogger(__name__)
_opened: list[weakref.ref[Communicator]] = []  # what init() returned, for shutdown()
_exit_handler_registered = False
_init_pid: int | None = None  # the process that called init(): a forked child must not shut down


class InitError(RuntimeError):
    """This process could not join the job (its peers or the master are unreachable);
    ``suspects``: the ranks to blame, when known."""

    def __init__(self, message: str, suspects: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.suspects = suspects


def init(backend: str | None = None, *, device: str | None = None, rank: int | None = None,
         world_size: int | None = None, local_rank: int | None = None,
         master_addr: str | None = None, master_port: int | None = None,
         timeout_s: float | None = None, init_timeout_s: float | None = None,
         debug: bool | None = None, exit_timeout_s: float | None = None) -> Communicator:
    """Initialize torch.distributed for this process's place in the job; return the
    Communicator over all ranks. Arguments override what the environment says.

    ``timeout_s`` bounds every blocking wait of the communicator; ``init_timeout_s`` how
    long ranks wait for each other to start; ``exit_timeout_s`` how long this process may
    take to exit once it fails (then it is stopped with its stacks on stderr; 0: no bound).
    A process that ends without :func:`shutdown` is shut down at exit (unless it fails)."""
    global _exit_handler_registered, _init_pid
    environ = os.environ
    place = envmod.resolve_placement(environ, rank=rank, world_size=world_size,
                                     local_rank=local_rank, master_addr=master_addr,
                                     master_port=master_port)
    timeout = envmod.resolve_timeout(timeout_s, environ)
    start_timeout = envmod.resolve_init_timeout(init_timeout_s, timeout, environ)
    debug_checks = envmod.resolve_debug(debug, environ)
    exit_timeout = envmod.resolve_exit_timeout(exit_timeout_s, environ)
    name = envmod.choose_backend(backend, environ, torch.cuda.is_available(), device)
    if name == "nccl":
        check_gpus_for_nccl(place.local_world_size, torch.cuda.device_count(), environ)
    if name == "nccl" or (device or "auto").startswith("cuda") or (
            device in (None, "auto") and torch.cuda.is_available()):
        # cuda:N as named; else cuda:LOCAL_RANK, shared round-robin when ranks outnumber
        # GPUs (Gloo only)
        named = device is not None and ":" in device
        torch.cuda.set_device(torch.device(device) if named and device else
                              place.local_rank % torch.cuda.device_count())
    hooks.install(None, place.rank, exit_timeout_s=exit_timeout)  # a failure to join too
    if dist.is_initialized():
        _check_existing(place)
    else:
        sharing = _init_process_group(name, place, start_timeout, timeout)
        _choose_threads(place, sharing)
    comm = Communicator.from_torch(config=CommConfig(timeout_s=timeout,
                                                     debug_checks=debug_checks))
    hooks.register(comm)
    _init_pid = os.getpid()
    if not _exit_handler_registered:
        atexit.register(_shutdown_at_exit)
        _exit_handler_registered = True
    _opened.append(weakref.ref(comm))
    if place.rank == 0:
        log.info("disttrain.init: %d rank(s) over %s (placement from %s, timeout %gs%s)",
                 place.world_size, name, place.source, timeout,
                 ", desync checks on" if debug_checks else "")
    return comm


def check_gpus_for_nccl(local_ranks: int, gpus: int, environ: Any) -> None:
    """Refuse, in one line, a node whose ranks would share GPUs under NCCL (it refuses two
    ranks on one GPU, later and less clearly: "Duplicate GPU detected"). With
    ``CUDA_VISIBLE_DEVICES`` set, each rank may see its own GPU as ``cuda:0`` (Slurm's
    ``--gpus-per-task``): then one visible GPU per rank is enough."""
    if gpus == 0:
        raise InitError("the NCCL backend needs a CUDA GPU per rank, and torch finds none "
                        "here; use backend='gloo' (or DISTTRAIN_BACKEND=gloo)")
    if local_ranks > gpus and not environ.get("CUDA_VISIBLE_DEVICES"):
        raise InitError(f"NCCL needs a GPU of its own per rank, but this node runs "
                        f"{local_ranks} ranks on {gpus} GPU(s) (NCCL refuses two ranks on one "
                        f"GPU); start at most {gpus} rank(s) per node, or use backend='gloo' "
                        f"(CUDA tensors staged through pinned host memory)")


def shutdown(comm: Communicator | None = None) -> None:
    """Close ``comm`` (finishing its queued work; with no argument, every communicator
    :func:`init` returned) and leave the process group.

    Call it at the end of a run: the closed communicators hold no process group any more, so
    the groups are freed here, while the interpreter runs. A Gloo group still alive at
    interpreter shutdown is freed during it, which aborted about one exit in eight here
    (torch 2.13: "terminate called without an active exception", SIGABRT). Every
    communicator is closed and the group destroyed even if one close fails; the first
    error is raised afterwards."""
    wait_polled_messages()  # a polled isend still in flight gets its chance, as at exit
    targets = [comm] if comm is not None else [ref() for ref in _opened]
    _opened[:] = [] if comm is None else [ref for ref in _opened if ref() not in (None, comm)]
    first: Exception | None = None
    for opened in targets:
        if opened is None:
            continue
        try:
            opened.close()
        except Exception as exc:
            first = first or exc
    if dist.is_initialized():
        dist.destroy_process_group()
    # Objects in reference cycles (a communicator's work handles and closures) can still
    # hold a group, its store or its work until the cycle collector runs, which may be
    # during interpreter shutdown: under mpirun, where rank 0 hosts the store, that aborted
    # most exits of rank 0 (SIGABRT, "terminate called without an active exception").
    # Collect now, while the interpreter runs.
    gc.collect()
    if first is not None:
        raise first


def _shutdown_at_exit() -> None:
    """A script that ends without :func:`shutdown` still frees its process groups before
    interpreter shutdown (see :func:`shutdown`); also when it destroyed the group itself,
    since the communicators still hold it, and also on the way out of an error of the
    rank's own (a ValueError in its code: its communicators are healthy, and a Gloo group
    freed at interpreter shutdown would turn its exit status 1 into SIGABRT about one time
    in seven). Nothing is done in a forked child, after a communicator failed (peers may be
    gone), with asynchronous collectives unfinished (closing would wait for them) or, on
    the way out of an error, with polled messages in flight or another backend than Gloo.
    The shutdown is bounded as a failing rank's exit is (``DISTTRAIN_EXIT_TIMEOUT``), so
    one that hangs cannot hold the exit; the bound is lifted once it is done (a failing
    rank's stays)."""
    if os.getpid() != _init_pid:
        return
    failing = hooks.is_failing()
    comms = [c for c in (ref() for ref in _opened) if c is not None and not c.closed]
    failed = [c.rank for c in comms if c.failed]
    busy = [(c.rank, c.unfinished) for c in comms if c.unfinished]
    if failed or busy or (failing and (polled_messages() or not _gloo_group())):
        if not failing:
            log.warning("disttrain: exiting without disttrain.shutdown() while %s; the "
                        "process group is left to interpreter shutdown",
                        f"the communicator of rank {failed[0]} has failed" if failed else
                        f"asynchronous collectives are unfinished (rank, count: {busy})")
        return
    if not comms and not dist.is_initialized():
        return
    bounded = hooks.bound_exit()
    try:
        shutdown()
    except Exception as exc:  # the process is ending anyway: say why it was not clean
        log.warning("disttrain: could not shut down cleanly at exit: %s", exc)
    if bounded:  # done in time: what other exit handlers do is not ours to bound
        hooks.release_exit_bound()


def _gloo_group() -> bool:
    try:
        return dist.is_initialized() and dist.get_backend() == "gloo"
    except (RuntimeError, ValueError):  # no default group after all
        return False


def _check_existing(place: envmod.Placement) -> None:
    """torch.distributed is already up (e.g. the script called init_process_group): reuse it
    when it agrees with the environment."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if (rank, world) != (place.rank, place.world_size) and place.source != "single":
        raise InitError(f"torch.distributed is already initialized as rank {rank} of {world}, "
                        f"but the {place.source} placement says rank {place.rank} of "
                        f"{place.world_size}; call disttrain.init() instead of "
                        "init_process_group, or pass matching rank=/world_size=")


def _choose_threads(place: envmod.Placement, sharing: int) -> None:
    """Intra-op threads as under every launcher (:mod:`disttrain.launch.threads`): the
    cores this process may use over the ``sharing`` ranks of this host on the same cores;
    an OMP_NUM_THREADS already set (disttrain launch, torchrun, the user) is torch's own."""
    if os.environ.get(threads.OMP_VAR):
        return
    count = threads.threads_per_rank(sharing)
    threads.set_threads(count)
    if place.rank == 0:
        log.info("disttrain.init: %d intra-op thread(s) per rank (%d usable core(s) shared "
                 "by %d rank(s) here)", count, threads.usable_cores(), sharing)


def _init_process_group(backend: str, place: envmod.Placement, timeout_s: float,
                        op_timeout_s: float) -> int:
    """Join the job's process group; returns how many ranks of this host share this
    process's cores (counted in the store while joining)."""
    if place.master_port is None:  # a world of one needs no rendezvous
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=timeout_s))
        return 1
    if backend == "gloo" and not os.environ.get("GLOO_SOCKET_IFNAME") and place.world_size > 1:
        interface = netif.gloo_interface_for(place.master_addr, place.single_host)
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
            log.debug("rank %d: Gloo uses interface %s (master %s%s)", place.rank, interface,
                      place.master_addr, ", every rank on this host" if place.single_host else "")
    # Under disttrain launch and torchrun the launcher hosts the store (it outlives any
    # worker); otherwise rank 0 does.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() == "true"
    per_node = (place.local_world_size if place.source == "torchrun"
                and place.local_world_size < place.world_size else None)
    port = None  # the store's, once found: a derived port may not be the first candidate
    try:
        store = rendezvous.open_store(place, timeout_s, agent)
        port = getattr(store, "port", None)
        if agent:  # a restarted job meets in the same store: each attempt gets its own keys
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"disttrain/attempt{attempt}/", store)
        cores = f"disttrain/cores/{liveness.host_key().hex()[:24]}/{threads.mask_key()}"
        store.add(cores, 1)  # before joining: once all have joined, the count is final
        rendezvous.join(store, place.rank, place.world_size, timeout_s, per_node)
        sharing = int(store.add(cores, 0))
        rendezvous.init_group(backend, store, place.rank, place.world_size, timeout_s,
                              op_timeout_s)
    except rendezvous.RendezvousError as exc:
        ports = place.port_candidates()
        where = port if port is not None else (
            ports[0] if len(ports) == 1 else f"{ports[0]}-{ports[-1]} (derived)")
        raise InitError(
            f"rank {place.rank} of {place.world_size} could not join the process group at "
            f"{place.master_addr}:{where}: {exc}. Check that all "
            f"{place.world_size} ranks were started and that MASTER_ADDR/MASTER_PORT name the "
            "node of rank 0 (its port reachable from here)", exc.suspects) from exc
    return sharing
