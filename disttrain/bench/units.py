"""Byte sizes for the command line: ``4KiB``, ``16MiB``, ``1GiB``, ``512B``, ``4096`` ⇄ ints.

Binary units only (KiB = 1024 B), as nccl-tests and the tables in docs/ use; ``K``/``M``/``G``
and ``KB``/``MB``/``GB`` are read as the binary units too, so ``-b 4K`` means what a user of
nccl-tests expects.
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"4KiB"`` → 4096. Raises ValueError naming the accepted forms."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"cannot read size {text!r}; write a byte count like 4096, 512B, "
                         f"4KiB, 16MiB or 1GiB")
    number, unit = match.groups()
    value = float(number) * _UNITS[unit.lower()]
    if value != int(value):
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return int(value)


def parse_sizes(text: str) -> list[int]:
    """A comma-separated list of sizes, duplicates dropped, in ascending order."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError("--sizes is empty; give sizes like 4KiB,1MiB,64MiB")
    return sorted({parse_size(p) for p in parts})


def size_range(start: int, stop: int, factor: int) -> list[int]:
    """``start, start·factor, …`` up to ``stop``, always ending with ``stop`` itself."""
    if start <= 0 or stop < start or factor < 2:
        raise ValueError(f"size_range needs 0 < start ≤ stop and factor ≥ 2, got "
                         f"{start}, {stop}, {factor}")
    sizes = []
    size = start
    while size < stop:
        sizes.append(size)
        size *= factor
    return [*sizes, stop]


def format_size(nbytes: float) -> str:
    """4096 → ``"4 KiB"``; exact multiples print without decimals."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes:.0f} B"
