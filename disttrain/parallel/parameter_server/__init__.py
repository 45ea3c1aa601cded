"""The parameter server: workers push gradients to sharded servers and pull parameters back.

Servers hold contiguous key ranges of the flattened parameters and apply the optimizer;
workers compute gradients. ``sync`` (BSP), ``async`` (ASGD) and ``ssp`` (bounded staleness)
differ in when a push is applied and when a worker may read (:mod:`.config`); sparse
embedding tables move by rows. Messages are a fixed validated header plus raw tensors over
the Communicator's point-to-point calls (Li et al., "Scaling Distributed Machine Learning
with the Parameter Server", OSDI 2014; Ho et al., NIPS 2013). See docs/parameter_server.md.

    roles = assign_roles(comm.world_size, num_servers)   # workers ranks 0..W−1, servers last
    if roles.role(comm.rank).kind == "server":
        report = run_parameter_server(comm, roles, model, make_optimizer, config)
    else:
        ps = PSWorker(comm, model, roles, config)   # then pull / backward / push per batch

The package, in reading order:

* :mod:`.config`: :class:`PSConfig` and the consistency models it selects (the clock
  table that gates reads, the staleness histogram);
* :mod:`.partition`: who holds what: roles by rank, key ranges per server, the copies
  between a model and its keys (all pure functions, the same on every rank);
* :mod:`.protocol`: the wire (a validated int64 header, raw payloads), the errors that name
  a peer, and the one-thread event loop every conversation runs on;
* :mod:`.channel`: the two ends of a conversation, a worker's to one server and a server's
  to every worker;
* :mod:`.server` and :mod:`.shard`: the server's loop, and the parameters, optimizer state,
  pending gradients and checkpoint of its key range;
* :mod:`.worker`: :class:`PSWorker`, a worker's handle on the servers for any training loop;
* :mod:`.reports`: how a run ends: per-rank reports, their sums, the same final model on
  every survivor;
* :mod:`.recsys`: a recommendation-style model and click data for sparse runs.
"""

from disttrain.parallel.parameter_server.config import (
    MODES,
    STALENESS_LR,
    ClockTable,
    PSConfig,
    StalenessHistogram,
    StragglerSpec,
    parse_straggler,
    parse_straggler_spec,
)
from disttrain.parallel.parameter_server.partition import (
    SERVERS_ENV,
    Partition,
    PSRoles,
    Role,
    Segment,
    TensorSpec,
    assign_roles,
    partition,
    servers_from_env,
    specs_of,
)
from disttrain.parallel.parameter_server.protocol import (
    ProtocolError,
    PSError,
    PSPayloadError,
    PSPeerError,
    PSPeerFailedError,
    PSRejectedError,
    PSTimeoutError,
)
from disttrain.parallel.parameter_server.recsys import (
    SPARSE_PARAMS,
    ClickData,
    ClickModel,
    make_click_data,
)
from disttrain.parallel.parameter_server.reports import ServerReport, WorkerReport
from disttrain.parallel.parameter_server.server import (
    ParameterServer,
    build_parameter_server,
    run_parameter_server,
)
from disttrain.parallel.parameter_server.shard import ServerShard, load_checkpoint
from disttrain.parallel.parameter_server.worker import PSWorker

__all__ = [
    "MODES",
    "SERVERS_ENV",
    "SPARSE_PARAMS",
    "STALENESS_LR",
    "ClickData",
    "ClickModel",
    "ClockTable",
    "PSConfig",
    "PSError",
    "PSPayloadError",
    "PSPeerError",
    "PSPeerFailedError",
    "PSRejectedError",
    "PSRoles",
    "PSTimeoutError",
    "PSWorker",
    "ParameterServer",
    "Partition",
    "ProtocolError",
    "Role",
    "Segment",
    "ServerReport",
    "ServerShard",
    "StalenessHistogram",
    "StragglerSpec",
    "TensorSpec",
    "WorkerReport",
    "assign_roles",
    "build_parameter_server",
    "load_checkpoint",
    "make_click_data",
    "parse_straggler",
    "parse_straggler_spec",
    "partition",
    "run_parameter_server",
    "servers_from_env",
    "specs_of",
]
