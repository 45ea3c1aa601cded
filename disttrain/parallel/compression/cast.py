"""16-bit gradient compression: cast down, all-reduce, cast up (2× fewer bytes than fp32).

Like torch's ``fp16_compress_hook`` and Horovod's ``Compression.fp16``. The bucket is divided
by the world size *before* the cast, so the sum over ranks stays in the range of the
16-bit type (fp16 overflows above 65504; bf16 keeps fp32's range with 8 bits of mantissa).
Compression here is :meth:`CastCompressor.compress` / :meth:`CastCompressor.decompress`
around one all-reduce, the Horovod shape of the interface.
"""

from __future__ import annotations

import torch

from disttrain.comm import Communicator
from disttrain.parallel.buckets import Bucket
from disttrain.parallel.compression.base import Compressor, PendingReduction, ThenFinish


class CastCompressor(Compressor):
    """Send gradients as ``dtype`` (``torch.float16`` or ``torch.bfloat16``)."""

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"CastCompressor dtype must be torch.float16 or torch.bfloat16, "
                             f"got {dtype}")
        self.dtype = dtype
        self.name = "fp16" if dtype == torch.float16 else "bf16"

    def compress(self, tensor: torch.Tensor, world_size: int) -> torch.Tensor:
        """The payload: ``tensor / world_size`` in the 16-bit dtype (a new tensor)."""
        payload = tensor.to(self.dtype, copy=True)
        return payload.div_(world_size) if world_size > 1 else payload

    @staticmethod
    def decompress(payload: torch.Tensor, out: torch.Tensor) -> None:
        """Write the reduced payload back into ``out`` in its own dtype."""
        out.copy_(payload)

    def start(self, bucket: Bucket, comm: Communicator,
              algorithm: str | None) -> PendingReduction:
        payload = self.compress(bucket.flat, comm.world_size)
        work = comm.all_reduce(payload, "sum", algorithm=algorithm, async_op=True)
        return ThenFinish([work], lambda: self.decompress(payload, bucket.flat))

    def __repr__(self) -> str:
        return f"CastCompressor({self.dtype})"
