"""Where a stage's incoming messages land: receive buffers whose ends are checked.

A receive is posted before its message arrives, sized as the message expected there
(:mod:`.link`). What arrives may not be that size: Gloo fills a receive with a shorter
message without saying how much arrived, and aborts the process on a longer one. So every
host buffer has its last 8 bytes marked (:func:`.wire.mark_end`), and on Gloo the receive is
posted into a *landing region* with :data:`ROOM_BYTES` of room past the expected end
(:mod:`disttrain.comm.overrun`), whose first 8 bytes are marked too: :meth:`Posted.fault`
then tells a message that ended short from one that went on.

One region per key (the link uses the direction), reused for every message: a fresh
mapping per message would cost a page fault per 4 KiB written (0.3 ms per MB on the host
these were measured on, against 0.015 ms into reused memory). Reuse means the payload must
leave the region (:attr:`Posted.reused`) before the next receive is posted there; a region
that a posted receive still holds is never handed out again, and after a failure
(:meth:`Landing.abandon`) every region is replaced, since an abandoned receive may still
land in it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

import torch

from disttrain.comm import Communicator, Work, overrun
from disttrain.parallel.pipeline import wire

# A message up to this much longer than expected is refused; a longer one still reaches
# Gloo's abort. Address space, not memory: pages are committed only where a message writes.
ROOM_BYTES = 1 << 30


@dataclass
class Posted:
    """A receive posted into ``buffer`` (on Gloo a landing region longer than the message)
    for a message of ``size`` bytes, with random marks in its last 8 bytes (``end``) and in
    the 8 past them (``past``)."""

    buffer: torch.Tensor
    size: int
    end: bytes | None
    past: bytes | None
    work: Work

    @property
    def reused(self) -> bool:
        """The buffer is a landing region: copy what is kept out of it."""
        return self.past is not None

    def fault(self) -> str | None:
        """None when the message filled the ``size`` bytes posted for it and, where there is
        room past them, did not go on; else ``"shorter than"`` or ``"longer than"``. (One
        k < 8 bytes too long that wrote the mark's own bytes passes, probability 2⁻⁸ᵏ.)"""
        if not wire.ends_whole(self.buffer[:self.size], self.end):
            return "shorter than"
        if not wire.untouched(self.buffer[self.size:self.size + wire.MARK_BYTES], self.past):
            return "longer than"
        return None

    def message(self) -> torch.Tensor:
        """The received bytes (call after :meth:`fault` said None)."""
        return self.buffer[:self.size]


class Landing:
    """The buffers a stage posts its receives into (landing regions on Gloo, fresh exact
    buffers elsewhere)."""

    def __init__(self, comm: Communicator) -> None:
        self.device = comm.device
        self._room = overrun.aborts_on_overrun(comm)
        self._regions: dict[Hashable, torch.Tensor] = {}
        self._abandoned: list[torch.Tensor] = []  # regions abandoned receives may still fill

    def post(self, key: Hashable, size: int, busy: Iterable[Posted],
             irecv: Callable[[torch.Tensor, int | None], Work]) -> Posted:
        """Post, with ``irecv(buffer, counted)``, the receive of a ``size``-byte message into
        ``key``'s landing region, unless a receive in ``busy`` still holds it (or an exact
        buffer, off Gloo, for an empty message, or with no address space for the room)."""
        region = self._region(key, size, busy)
        if region is None:
            buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
            return Posted(buffer, size, wire.mark_end(buffer), None, irecv(buffer, None))
        end = wire.mark_end(region[:size])
        past = wire.mark_end(region[size:size + wire.MARK_BYTES])
        return Posted(region, size, end, past, irecv(region, size))

    def _region(self, key: Hashable, size: int, busy: Iterable[Posted]) -> torch.Tensor | None:
        if not self._room or size == 0:  # an empty message is never sent: nothing to post
            return None
        region = self._regions.get(key)
        if region is None or region.numel() < size + ROOM_BYTES or any(
                p.buffer is region for p in busy):
            region = overrun.anonymous_buffer(size + ROOM_BYTES)
            if region is None:
                return None
            self._regions[key] = region
        return region

    def abandon(self, posted: Iterable[Posted]) -> None:
        """Receives ``posted`` will not be waited for: keep their buffers alive (they may
        still be written) and hand out new regions from now on."""
        self._abandoned += [p.buffer for p in posted]
        self._regions.clear()
