"""Bytes on the wire: what the busiest rank sends in one collective, by algorithm.

The figures the transport's counters are checked against (tests, and the ``theory`` column
of ``disttrain bench comm``): ring all-reduce sends 2(p−1)/p·V per rank, naive (p−1)·V.

On the shared-memory transport nothing is sent: a rank *writes* its data into shared memory
once and the others read it there. Algorithm ``shm`` counts as sent the bytes a rank writes
for the others (and as received those it reads from them), so its all-reduce "sends" V on
any number of ranks: it writes its whole tensor once (or exposes it, when the tensor lives
in shared memory), where a ring sends 2(p−1)/p·V through the network.
"""

from __future__ import annotations


def _pow2_floor(p: int) -> int:
    return 1 << (p.bit_length() - 1)


def _log2(p: int) -> int:
    """⌈log₂ p⌉: rounds of a binomial tree."""
    return (p - 1).bit_length() if p > 1 else 0


def _gather_tree_max(p: int) -> int:
    """Blocks forwarded by the busiest non-root rank of a binomial gather: the top of the
    largest subtree, min(2^k, p − 2^k) blocks for relative rank 2^k."""
    return max(min(1 << k, p - (1 << k)) for k in range(_log2(p)))


def _hd_all_gather_max(p: int) -> int:
    """Blocks virtual rank 0 sends in recursive doubling after the non-power-of-two fold: at
    level k its group of 2^k virtual ranks, min(2^k, p − q) of which hold two blocks."""
    q = _pow2_floor(p)
    return sum((1 << k) + min(1 << k, p - q) for k in range(_log2(q)))


def theory_bytes_sent(op: str, algorithm: str, p: int, nbytes: int) -> float | None:
    """Bytes the busiest rank sends in one ``op`` with ``algorithm``: None for ``native``
    (torch.distributed's traffic is invisible), KeyError for an unknown pair.

    ``nbytes`` is the nccl-tests size (see :func:`predict`). Exact when the buffer splits
    evenly into the algorithm's blocks, as in the benchmark.
    """
    if algorithm == "native":
        return None
    if p <= 1:
        return 0.0
    v, lg, frac, q = float(nbytes), _log2(p), (p - 1) / p, _pow2_floor(p)
    fold = 0 if q == p else 1
    table = {
        ("all_reduce", "naive"): (p - 1) * v,
        ("all_reduce", "ring"): 2 * frac * v,
        ("all_reduce", "tree"): lg * v,  # the root broadcasts to ⌈log₂ p⌉ children
        ("all_reduce", "halving_doubling"): 2 * (q - 1) / q * v + fold * v,  # + the unfold
        ("broadcast", "naive"): (p - 1) * v,
        ("broadcast", "tree"): lg * v,
        ("reduce", "naive"): v,
        ("reduce", "tree"): v,
        ("gather", "naive"): v / p,
        ("gather", "tree"): _gather_tree_max(p) * v / p,
        ("scatter", "naive"): frac * v,
        ("scatter", "tree"): frac * v,
        ("all_gather", "naive"): frac * v,
        ("all_gather", "ring"): frac * v,
        ("all_gather", "halving_doubling"): _hd_all_gather_max(p) * v / p + fold * v,
        ("reduce_scatter", "naive"): frac * v,
        ("reduce_scatter", "ring"): frac * v,
        ("reduce_scatter", "halving_doubling"): v if fold else frac * v,  # folded: all of it
        ("all_to_all", "naive"): frac * v,
        ("barrier", "naive"): float(p - 1),
        ("barrier", "tree"): float(lg),
        # shm: bytes written into shared memory for the others (docs/shm_transport.md)
        ("all_reduce", "shm"): v,
        ("reduce_scatter", "shm"): v,  # every block, the rank's own included, in one round
        ("all_gather", "shm"): v / p,
        ("broadcast", "shm"): v,  # the root
        ("reduce", "shm"): v,
        ("gather", "shm"): v / p,
        ("scatter", "shm"): frac * v,  # the root
        ("all_to_all", "shm"): frac * v,
        ("barrier", "shm"): 0.0,
    }
    return table[(op, algorithm)]
