"""Receive buffers with room past their end, for messages that may be longer than expected.

Gloo's receive of a message longer than the buffer posted for it does not fail the
receive: Gloo's I/O thread aborts the whole process (SIGABRT). Code that receives from a
peer it does not fully trust to size its messages right (a parameter server's workers, a
pipeline stage running another version) therefore posts, on Gloo, a buffer larger than the
message it expects, and checks afterwards where the message ended. The room past the end
is anonymous memory: the kernel gives it pages only where a message writes, so reserving a
lot of it costs address space, not memory. The other transports enforce sizes themselves
(shared memory raises on a wrong size; NCCL never completes a receive larger than its
send), so they post exact buffers.
"""

from __future__ import annotations

import mmap
import sys

import torch

from disttrain.comm.communicator import Communicator

# MAP_NORESERVE: no swap is set aside for the room (Python ≥ 3.12 names the flag; Linux's
# value otherwise). Ignored where the kernel counts every mapping (vm.overcommit_memory=2).
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def aborts_on_overrun(comm: Communicator) -> bool:
    """Whether a message longer than the receive posted for it ends this process (Gloo
    over host memory) rather than failing the receive."""
    return comm.transport.name == "torch" and comm.device.type == "cpu"


def anonymous_buffer(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` zero bytes of anonymous memory (pages committed where written) as a uint8
    tensor, or None where the address space cannot be had (the caller then posts an exact
    buffer)."""
    try:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE
        return torch.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype=torch.uint8)
    except (OSError, ValueError, OverflowError):
        return None
