"""``disttrain launch``: the command line of :mod:`disttrain.launch.launcher`.

Flag names follow torchrun's (both ``--node-rank`` and ``--node_rank`` spellings work), so a
torchrun command line becomes a disttrain one by changing the first word.
"""

from __future__ import annotations

import argparse
import sys

from disttrain.launch.config import LaunchConfig, LaunchError

_EPILOG = """examples:
  disttrain launch -n 4 train.py --lr 0.1
  disttrain launch -n 2 -m mypkg.train
  # parameter server: 4 workers (ranks 0-3) and 1 server (rank 4)
  disttrain launch -n 4 --servers 1 -m disttrain run --strategy ps-async --epochs 3
  # ... going on without a worker that dies
  disttrain launch -n 4 --servers 1 --tolerate-worker-loss -m disttrain run --strategy ps-async
  # two machines, run on each with its own --node-rank:
  disttrain launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 -n 8 train.py

environment: DISTTRAIN_TIMEOUT (seconds per blocking wait), DISTTRAIN_DEBUG=1 (desync
checks), DISTTRAIN_FLIGHT_DIR (where flight-recorder dumps go). With --servers S every
process gets DISTTRAIN_PS_SERVERS=S and ROLE_NAME=worker|server. See docs/launching.md."""


def configure(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "launch", help="start N workers with torchrun's environment and watch them",
        description="Start workers with torchrun's environment contract (RANK, LOCAL_RANK, "
        "WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). When one fails, the others "
        "are stopped and the root cause is reported; the exit code is the failed worker's.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--nproc-per-node", "--nproc_per_node", dest="nproc_per_node",
                   type=int, default=1, metavar="N", help="workers on this node (default 1)")
    p.add_argument("--servers", type=int, default=0, metavar="S",
                   help="also start S parameter-server processes, ranks N..N+S-1, and tell "
                   "every process (DISTTRAIN_PS_SERVERS=S; one machine only; default 0)")
    p.add_argument("--tolerate-worker-loss", action="store_true",
                   help="with --servers: a worker rank (0..N-1) that fails or dies does not "
                   "stop the job; the others go on (ps-async and ps-ssp outlive a worker) "
                   "and the launcher reports the loss")
    p.add_argument("--nnodes", default="1", metavar="M", help="machines in the job (default 1)")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=None,
                   metavar="K", help="this machine's index, 0..M-1")
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None,
                   metavar="HOST", help="address of node 0 (default 127.0.0.1 on one node)")
    p.add_argument("--master-port", "--master_port", dest="master_port", type=int,
                   default=None, metavar="P", help="rendezvous port on node 0 (default: free)")
    p.add_argument("--store-bind-addr", dest="store_bind_addr", default=None, metavar="ADDR",
                   help="address node 0's rendezvous store listens on (default: --master-addr, "
                   "or 127.0.0.1 on one node; 0.0.0.0 for every interface)")
    p.add_argument("--grace-period", dest="grace_s", type=float, default=5.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when stopping workers (default 5)")
    p.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int,
                   default=0, metavar="N",
                   help="after a worker fails, stop all and start them again, up to N times "
                   "(default 0); workers see TORCHELASTIC_RESTART_COUNT, and 'disttrain run' "
                   "resumes from its --checkpoint-dir (docs/recovery.md)")
    p.add_argument("--run-dir", default=None, metavar="DIR",
                   help="where error records and flight-recorder dumps go (default: a new "
                   "temporary directory, removed after a successful run)")
    p.add_argument("--no-prefix", dest="prefix_output", action="store_false",
                   help="do not prefix output lines with [rank R]")
    p.add_argument("-m", "--module", action="store_true",
                   help="run the target as a module (python -m TARGET)")
    p.add_argument("target", nargs="?", default="", help="script to run (or module with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace) -> LaunchConfig:
    """Flags → LaunchConfig (which validates them)."""
    try:
        nnodes = int(args.nnodes)
    except ValueError:
        raise ValueError(f"--nnodes {args.nnodes!r} must be a whole number of machines "
                         "(elastic ranges like 1:4 are not supported)") from None
    return LaunchConfig(
        target=args.target, nproc_per_node=args.nproc_per_node, args=tuple(args.args),
        module=args.module, nnodes=nnodes,
        node_rank=0 if args.node_rank is None else args.node_rank,
        master_addr=args.master_addr, master_port=args.master_port,
        store_bind_addr=args.store_bind_addr, grace_s=args.grace_s,
        run_dir=args.run_dir, prefix_output=args.prefix_output, servers=args.servers,
        max_restarts=args.max_restarts, tolerate_worker_loss=args.tolerate_worker_loss)


def run(args: argparse.Namespace) -> int:
    from disttrain.launch.restarts import launch_with_restarts

    try:
        return launch_with_restarts(build_config(args))
    except (ValueError, LaunchError) as exc:
        print(f"disttrain launch: error: {exc}", file=sys.stderr)
        return 2
