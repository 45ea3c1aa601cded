"""Context parallelism: a sequence too long for one rank's activations split over the ranks
of a ``cp`` group, causal attention computed across them (Megatron-Core's context
parallelism; ring attention, Liu et al. 2023; DeepSpeed-Ulysses, Jacobs et al. 2023).
Read in this order:

* :mod:`.layout`: the zig-zag split, as pure data: rank r holds chunks r and 2·cp − 1 − r
  of 2·cp, so causal masking leaves no rank idle (:func:`split_sequence` cuts a batch, the
  true positions of each rank's tokens, the ring's schedule of which queries meet which
  keys at each step);
* :mod:`.ring`: ring attention, an autograd function: key/value blocks go round the ring
  (``isend``/``irecv``, the next block's transfer overlapping the current block's
  attention), partial results merged by the running log-sum-exp; backward sends the blocks
  round again with their gradients;
* :mod:`.ulysses`: the all-to-all variant: sequence-split → head-split, ordinary causal
  attention on the whole sequence for heads/cp heads, and back;
* :mod:`.api`: :func:`apply_context_parallel` puts the two into disttrain's TransformerLM
  (or its tensor-parallel shard): position embeddings at each rank's true positions, each
  rank's share of the loss, the gradients summed over the group;
* :mod:`.theory`: bytes per rank per step and attention's activation bytes, as pure
  functions that the tests hold the transport's counters and autograd's saved tensors to.

A training step on each rank of the group::

    model = apply_context_parallel(lm, cp_comm, "ring")      # once, collective
    tokens, targets = (split_sequence(t, cp_comm.rank, cp_comm.world_size)
                       for t in (tokens, targets))
    loss = model.loss(model(tokens), targets)                  # this rank's share
    loss.backward()
    model.reduce_context_parallel_grads()                      # sum over cp
    optimizer.step()

See docs/context_parallel.md.
"""

from disttrain.parallel.context.api import (
    VARIANTS,
    ContextParallelConfig,
    ContextParallelLM,
    apply_context_parallel,
    sum_gradients,
)
from disttrain.parallel.context.layout import (
    check_sequence,
    positions,
    ring_schedule,
    split_sequence,
    work_blocks,
)
from disttrain.parallel.context.ring import ring_attention
from disttrain.parallel.context.theory import (
    attention_activation_bytes,
    attention_bytes_sent,
    bytes_sent,
)
from disttrain.parallel.context.ulysses import ulysses_attention

__all__ = [
    "VARIANTS",
    "ContextParallelConfig",
    "ContextParallelLM",
    "apply_context_parallel",
    "attention_activation_bytes",
    "attention_bytes_sent",
    "bytes_sent",
    "check_sequence",
    "positions",
    "ring_attention",
    "ring_schedule",
    "split_sequence",
    "sum_gradients",
    "ulysses_attention",
    "work_blocks",
]
