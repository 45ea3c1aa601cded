"""The parameter server: workers push gradients to sharded servers and pull parameters back.

Servers hold contiguous key ranges of the flattened parameters and apply the optimizer;
workers compute gradients. ``sync`` (BSP), ``async`` (ASGD) and ``ssp`` (bounded staleness)
differ in when a push is applied and when a worker may read (:mod:`.consistency`); sparse
embedding tables move by rows. Messages are a
fixed validated header plus raw tensors over the Communicator's point-to-point calls (Li et
al., "Scaling Distributed Machine Learning with the Parameter Server", OSDI 2014; Ho et al.,
NIPS 2013). See docs/parameter_server.md.

    roles = assign_roles(comm.world_size, num_servers)   # workers ranks 0..W−1, servers last
    if roles.role(comm.rank).kind == "server":
        report = run_parameter_server(comm, roles, model, make_optimizer, config)
    else:
        ps = PSWorker(comm, model, roles, config)   # then pull / backward / push per batch
"""

from disttrain.parallel.parameter_server.config import (
    MODES,
    STALENESS_LR,
    PSConfig,
    StragglerSpec,
    parse_straggler,
    parse_straggler_spec,
)
from disttrain.parallel.parameter_server.consistency import ClockTable, StalenessHistogram
from disttrain.parallel.parameter_server.errors import (
    ProtocolError,
    PSError,
    PSPeerError,
    PSPeerFailedError,
    PSRejectedError,
    PSTimeoutError,
)
from disttrain.parallel.parameter_server.partition import (
    Partition,
    Segment,
    TensorSpec,
    partition,
    specs_of,
)
from disttrain.parallel.parameter_server.recsys import (
    SPARSE_PARAMS,
    ClickData,
    ClickModel,
    make_click_data,
)
from disttrain.parallel.parameter_server.reports import ServerReport, WorkerReport
from disttrain.parallel.parameter_server.roles import (
    SERVERS_ENV,
    PSRoles,
    Role,
    assign_roles,
    servers_from_env,
)
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
