"""Tensor parallelism and sequence parallelism: one transformer layer split over the ranks of
a tensor-parallel group (Megatron-LM, Shoeybi et al. 2019; sequence parallelism, Korthikanti
et al. 2022). Read in this order:

* :mod:`.ops`: the communication, as autograd functions: f (identity forward, all-reduce
  backward), g (all-reduce forward, identity backward), the sequence-parallel pair
  (all-gather / reduce-scatter along the sequence) and the vocabulary-parallel
  cross-entropy (three per-token sums instead of gathering the logits);
* :mod:`.layers`: column- and row-parallel linear layers and the vocabulary-parallel
  embedding, each built from the module it replaces;
* :mod:`.transformer`: :func:`apply_tensor_parallel` turns disttrain's TransformerLM into
  this rank's shard (attention split by heads, MLP column-then-row, vocabulary-parallel
  embedding and head) and :func:`full_state_dict` gathers the full parameters back;
* :mod:`.theory`: bytes per rank per step and activation bytes, as pure functions that the
  tests hold the transport's counters and autograd's saved tensors to.

The dp × pp × tp mesh these groups come from is :mod:`disttrain.parallel.mesh`; the
strategies ``tp``, ``tp-sp``, ``3d`` and the ``torch-tp`` baseline are in
:mod:`disttrain.train.strategies.tensor`. See docs/tensor_parallel.md.
"""

from disttrain.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from disttrain.parallel.tensor.ops import (
    TPGroup,
    all_gather_sequence,
    copy_to_tp,
    gather_vocab,
    reduce_from_tp,
    reduce_scatter_sequence,
    vocab_parallel_cross_entropy,
)
from disttrain.parallel.tensor.transformer import (
    TensorParallelLM,
    apply_tensor_parallel,
    check_divisible,
    full_state_dict,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TPGroup",
    "TensorParallelLM",
    "VocabParallelEmbedding",
    "all_gather_sequence",
    "apply_tensor_parallel",
    "check_divisible",
    "copy_to_tp",
    "full_state_dict",
    "gather_vocab",
    "reduce_from_tp",
    "reduce_scatter_sequence",
    "vocab_parallel_cross_entropy",
]
