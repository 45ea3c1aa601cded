"""All-reduce in a loop until something breaks (for partition and kill tests): prints
``ready`` after the first one; ends with the error it got."""

import time

import torch

import disttrain

comm = disttrain.init()
comm.all_reduce(torch.ones(4))
print("ready", flush=True)
while True:
    comm.all_reduce(torch.ones(1024))
    time.sleep(0.05)
