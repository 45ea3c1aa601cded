"""Pure functions that cut a flat buffer into per-rank segments and streaming sub-chunks.

Every algorithm uses the same cut, so rank ``i``'s segment is the same on every rank and on
every algorithm: ``n`` elements over ``parts`` parts gives the first ``n % parts`` parts one
extra element (sizes differ by at most one; zero-length parts are fine).
"""

from __future__ import annotations


def segment_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """[(start, end)] of ``parts`` contiguous segments covering range(n), sizes within one."""
    if parts <= 0:
        raise ValueError(f"parts must be positive, got {parts}")
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def sub_chunks(start: int, end: int, max_elems: int) -> list[tuple[int, int]]:
    """Split [start, end) into pieces of at most ``max_elems`` elements (none if empty)."""
    if max_elems <= 0:
        raise ValueError(f"max_elems must be positive, got {max_elems}")
    return [(a, min(a + max_elems, end)) for a in range(start, end, max_elems)]


def chunk_elems(chunk_bytes: int, element_size: int) -> int:
    """Elements per streamed sub-chunk for a byte budget (at least one)."""
    return max(1, chunk_bytes // max(1, element_size))


def power_of_two_floor(p: int) -> int:
    """The largest power of two ≤ p (p ≥ 1)."""
    return 1 << (p.bit_length() - 1)


def fold_map(p: int) -> tuple[int, list[list[int]]]:
    """How recursive halving/doubling handles a non-power-of-two ``p``.

    The largest power of two ``q ≤ p`` ranks take part; the first ``2·(p−q)`` ranks pair up
    (even rank hands its data to the odd rank above it and sits out). Returns ``q`` and, for
    each virtual rank ``0..q−1``, the real ranks it stands for, in order (one or two)::

        p = 6, q = 4:   virtual 0 = {0, 1}, 1 = {2, 3}, 2 = {4}, 3 = {5}
    """
    q = power_of_two_floor(p)
    extra = p - q
    members = [[2 * v, 2 * v + 1] for v in range(extra)]
    members += [[v + extra] for v in range(extra, q)]
    return q, members


def virtual_rank(rank: int, p: int) -> int | None:
    """This rank's virtual rank under :func:`fold_map`, or None if it sits out (folded)."""
    extra = p - power_of_two_floor(p)
    if rank < 2 * extra:
        return rank // 2 if rank % 2 == 1 else None
    return rank - extra
