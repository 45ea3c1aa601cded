"""A rank exits while a send it polled was never received.

Rank 0 posts a send that rank 1 never receives and polls it once (which starts the thread
that waits for it); both ranks call ``disttrain.shutdown()`` and exit. A daemon waiting
thread woke while the interpreter finalized and aborted the process ("terminate called
without an active exception"); the thread is now joined at exit, with a warning naming the
message.
"""

import torch

import disttrain

comm = disttrain.init()
if comm.rank == 0:
    work = comm.isend(torch.ones(100_000), 1, tag=1)
    print(f"polled: {work.is_completed()}", flush=True)
disttrain.shutdown()
print(f"rank {comm.rank} done", flush=True)
