"""Tensor parallelism and sequence parallelism: one transformer layer split over the ranks of
a tensor-parallel group (Megatron-LM, Shoeybi et al. 2019; sequence parallelism, Korthikanti
et al. 2022). Read in this order:

* :mod:`.ops`: the communication, as autograd functions: f (identity forward, all-reduce
  backward), g (all-reduce forward, identity backward), the sequence-parallel pair
  (all-gather / reduce-scatter along the sequence) and the vocabulary-parallel
  cross-entropy (three per-token sums instead of gathering the logits);
* :mod:`.layers`: column- and row-parallel linear layers and the vocabulary-parallel
  embedding, each built from the module it replaces;
* :mod:`.plan`: a plan maps module-name patterns to styles (column-wise, row-wise,
  vocabulary-parallel embedding and head, sequence-parallel norms, ...), as data;
* :mod:`.api`: :func:`parallelize` applies a plan to any model and returns this
  rank's shard with its loss, its sequence-parallel gradients and
  :func:`full_state_dict`, which gathers the full parameters back;
* :mod:`.plans`: the built-in plans (:func:`plan_for`): Hugging Face GPT-2 and Llama;
* :mod:`.transformer`: disttrain's TransformerLM and its plan (:func:`apply_tensor_parallel`
  is :func:`parallelize` with it);
* :mod:`.theory`: bytes per rank per step and activation bytes, as pure functions that the
  tests hold the transport's counters and autograd's saved tensors to.

The dp × pp × tp mesh these groups come from is :mod:`disttrain.parallel.mesh`; the
strategies ``tp``, ``tp-sp``, ``3d`` and the ``torch-tp`` baseline are in
:mod:`disttrain.train.strategies.tensor`. See docs/tensor_parallel.md.
"""

from disttrain.parallel.tensor.api import (
    Parallelized,
    apply_tensor_parallel,
    full_state_dict,
    parallelize,
)
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
    join_sequence,
    reduce_from_tp,
    reduce_scatter_sequence,
    split_sequence,
    vocab_parallel_cross_entropy,
    vocab_parallel_loss,
)
from disttrain.parallel.tensor.plan import (
    CausalLMLoss,
    ColumnWise,
    EnterRegion,
    JoinSequence,
    LocalHeads,
    Plan,
    RowWise,
    SequenceParallel,
    SplitSequence,
    Style,
    VocabEmbedding,
    VocabHead,
)
from disttrain.parallel.tensor.plans import gpt2_plan, llama_plan, plan_for
from disttrain.parallel.tensor.transformer import (
    TensorParallelLM,
    check_divisible,
    transformer_lm_plan,
)

__all__ = [
    "CausalLMLoss",
    "ColumnParallelLinear",
    "ColumnWise",
    "EnterRegion",
    "JoinSequence",
    "LocalHeads",
    "Parallelized",
    "Plan",
    "RowParallelLinear",
    "RowWise",
    "SequenceParallel",
    "SplitSequence",
    "Style",
    "TPGroup",
    "TensorParallelLM",
    "VocabEmbedding",
    "VocabHead",
    "VocabParallelEmbedding",
    "all_gather_sequence",
    "apply_tensor_parallel",
    "check_divisible",
    "copy_to_tp",
    "full_state_dict",
    "gather_vocab",
    "gpt2_plan",
    "join_sequence",
    "llama_plan",
    "parallelize",
    "plan_for",
    "reduce_from_tp",
    "reduce_scatter_sequence",
    "split_sequence",
    "transformer_lm_plan",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_loss",
]
