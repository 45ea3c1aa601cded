"""disttrain.init(), then a communicator on the shared-memory transport, one all-reduce."""

import torch

import disttrain
from disttrain.comm import CommConfig, Communicator
from disttrain.comm.transports import make_transport

joined = disttrain.init()
comm = Communicator(make_transport("shm", timeout_s=30), CommConfig(timeout_s=30))
comm.all_reduce(torch.ones(4))
comm.close()
disttrain.shutdown()
