"""disttrain.init(), one all-reduce, then the local IPv4 addresses of this process's TCP
sockets (Gloo's connections and the store's) as one JSON report per rank."""

import json
import os
import socket
import struct

import torch

import disttrain

comm = disttrain.init()
comm.all_reduce(torch.ones(2))
inodes = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        continue
    if target.startswith("socket:["):
        inodes.add(target[len("socket:["):-1])
addresses = set()
with open("/proc/net/tcp") as f:
    for line in list(f)[1:]:
        fields = line.split()
        if fields[9] in inodes:
            local = int(fields[1].split(":")[0], 16)
            addresses.add(socket.inet_ntoa(struct.pack("<I", local)))
print(json.dumps({"addresses": sorted(addresses)}), flush=True)
disttrain.shutdown()
