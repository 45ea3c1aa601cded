"""No torch, so it starts fast: prints its env contract; argv[1] picks what happens next.

ok      exit 0
exit7   once every rank has started, rank 1 exits with code 7; the others would sleep a minute
sigint  print "ready", then wait for SIGINT and write its name to argv[2]/signal-rank<R>
listen  print the local addresses of every socket listening on MASTER_PORT (from
        /proc/net/tcp and tcp6, hexadecimal as there: 0100007F is 127.0.0.1), then exit 0
"""

import json
import os
import signal
import sys
import time

NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
mode, rank = sys.argv[1], os.environ["RANK"]
print(json.dumps({name: os.environ.get(name) for name in NAMES}), flush=True)
print(f"stderr of rank {rank}", file=sys.stderr, flush=True)
if len(sys.argv) > 2:
    with open(os.path.join(sys.argv[2], f"pid-rank{rank}"), "w") as f:
        f.write(str(os.getpid()))


def on_signal(signum, frame):
    with open(os.path.join(sys.argv[2], f"signal-rank{rank}"), "w") as f:
        f.write(signal.Signals(signum).name)
    sys.exit(3)


def listeners(port):
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue  # IPv6 is off
        with open(table) as f:
            for row in list(f)[1:]:
                local, state = row.split()[1], row.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.append(address)
    return found


if mode == "listen":
    print(json.dumps({"listening": listeners(int(os.environ["MASTER_PORT"]))}), flush=True)
elif mode == "exit7" and rank == "1":
    deadline = time.monotonic() + 60  # let every rank print first: the test reads it all
    while len([n for n in os.listdir(sys.argv[2]) if n.startswith("pid-")]) < int(
            os.environ["WORLD_SIZE"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    print("rank 1 gives up with code 7", file=sys.stderr, flush=True)
    sys.exit(7)
elif mode == "exit7":
    time.sleep(60)
elif mode == "sigint":
    signal.signal(signal.SIGINT, on_signal)
    print("ready", flush=True)
    time.sleep(60)
