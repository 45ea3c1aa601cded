"""Profiles built on paper, for models too large to measure here: ResNet-101 on ImageNet,
and GPT-style transformer language models (``gpt-1.3b``, ``gpt-13b``).

ResNet-101 (He et al. 2016, Table 1): a 7×7 stem, bottleneck blocks (1×1, 3×3, 1×1 with
4× expansion) in four stages of 3, 4, 23 and 3 blocks at 56², 28², 14² and 7², and a
2048 → 1000 classifier: 44.5M parameters. Each layer's share of the forward cost is its
multiply-adds (2·k²·C_in·C_out·H·W FLOPs per convolution), normalised so that the model
does ``forward_flops`` per image; backward costs twice the forward (gradients of inputs
and of weights). Saved activations are the block outputs and their three intermediate
maps (fp32, ×2 for the BatchNorm and ReLU copies). Times are for a device sustaining
``device_flops``; pass the same number as the cluster's so no rescaling happens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from disttrain.parallel.tensor.theory import LMShape, block_activation_elements
from disttrain.simulate.profile import LayerProfile, ModelProfile

RESNET101_BLOCKS = ((64, 3, 56), (128, 4, 28), (256, 23, 14), (512, 3, 7))
HE_FORWARD_MULT_ADDS = 7.8e9  # per 224² image (He et al. count multiply-adds as FLOPs)


def _conv(k: int, cin: int, cout: int, hw: int) -> tuple[int, int]:
    """(parameters, multiply-adds) of a bias-free k×k convolution with an hw² output."""
    return k * k * cin * cout, k * k * cin * cout * hw * hw


def _bottleneck(cin: int, width: int, hw: int, stride: int) -> tuple[int, int, int]:
    """(parameters, multiply-adds, saved activation elements) of one bottleneck block."""
    out = 4 * width
    parts = [_conv(1, cin, width, hw * stride), _conv(3, width, width, hw),
             _conv(1, width, out, hw)]
    if stride != 1 or cin != out:
        parts.append(_conv(1, cin, out, hw))
    bn = 2 * (2 * width + 2 * out)  # BatchNorm γ, β per channel
    params = sum(p for p, _ in parts) + bn
    macs = sum(m for _, m in parts)
    saved = 2 * (width * (hw * stride) ** 2 + width * hw * hw + 2 * out * hw * hw)
    return params, macs, saved


def _layers() -> list[tuple[str, int, int, int, int]]:
    """(name, params, mult-adds, saved elements, output elements) per layer, per image."""
    stem_p, stem_m = _conv(7, 3, 64, 112)
    rows = [("stem", stem_p + 128, stem_m, 2 * 64 * 112 * 112 + 64 * 56 * 56, 64 * 56 * 56)]
    cin = 64
    for stage, (width, blocks, hw) in enumerate(RESNET101_BLOCKS):
        for b in range(blocks):
            stride = 2 if b == 0 and stage > 0 else 1
            params, macs, saved = _bottleneck(cin, width, hw, stride)
            rows.append((f"conv{stage + 2}_{b + 1}", params, macs, saved, 4 * width * hw * hw))
            cin = 4 * width
    rows.append(("fc", cin * 1000 + 1000, cin * 1000, cin, 1000))
    return rows


def resnet101(device_flops: float, forward_flops: float = 2 * HE_FORWARD_MULT_ADDS,
              optimizer_bytes_per_s: float = 700e9) -> ModelProfile:
    """ResNet-101 for 224² images on a device sustaining ``device_flops`` FLOP/s.

    ``forward_flops`` defaults to He et al.'s 7.8 G multiply-adds = 15.6 GFLOP per image.
    The optimizer step streams ~20 bytes per parameter (weights, gradient, momentum) at
    ``optimizer_bytes_per_s`` (HBM bandwidth).
    """
    rows = _layers()
    total_macs = sum(r[2] for r in rows)
    layers = []
    for name, params, macs, saved, out in rows:
        fwd = forward_flops * macs / total_macs / device_flops
        layers.append(LayerProfile(name, 0.0, fwd, 0.0, 2 * fwd, params, 4.0 * saved,
                                   4.0 * out))
    return ModelProfile("resnet101", tuple(layers), device_flops,
                        20 / optimizer_bytes_per_s, source="analytic (He et al. 2016)")


def gpt(shape: LMShape, name: str, device_flops: float,
        optimizer_bytes_per_s: float = 700e9) -> ModelProfile:
    """A pre-norm GPT with disttrain's TransformerLM layout (embeddings, blocks, LayerNorm,
    head) on sequences of ``shape.max_len`` tokens. Forward FLOPs per sequence: a block
    2·(12sh² + 2s²h) (QKV, out, the 4h MLP, attention scores and sums: Narayanan et al.
    2021, eq. 2 without the vocabulary term), the head 2shV; backward twice the forward.
    Saved activations per block are :func:`~disttrain.parallel.tensor.theory.block_activation
    _elements` (what autograd keeps here, fp32); the others keep their input."""
    s, h, v, a = shape.max_len, shape.d_model, shape.vocab_size, shape.n_heads
    block = 2 * (12 * s * h * h + 2 * s * s * h)
    rows = [("embeddings", v * h + s * h, 2 * s * h, 2 * s, s * h),
            *((f"block{i + 1}", 12 * h * h + 13 * h, block,
               block_activation_elements(s, 1, h, a, 1, False), s * h)
              for i in range(shape.n_layers)),
            ("norm", 2 * h, 5 * s * h, s * h + 2 * s, s * h),
            ("head", h * v + v, 2 * s * h * v, s * h, s * v)]
    layers = [LayerProfile(n, 0.0, flops / device_flops, 0.0, 2 * flops / device_flops,
                           params, 4.0 * saved, 4.0 * out, 2)
              for n, params, flops, saved, out in rows]
    return ModelProfile(name, tuple(layers), device_flops, 20 / optimizer_bytes_per_s,
                        source="analytic (GPT, Narayanan et al. 2021)", transformer=shape)


GPT_SHAPES = {  # GPT-3 paper sizes (Brown et al. 2020, Table 2.1), vocabulary padded to 64
    "gpt-1.3b": LMShape(vocab_size=50304, d_model=2048, n_heads=16, n_layers=24,
                        max_len=2048),
    "gpt-13b": LMShape(vocab_size=50304, d_model=5120, n_heads=40, n_layers=40,
                       max_len=2048),
    # the long-sequence variant: 32k tokens (context parallelism's case)
    "gpt-1.3b-32k": LMShape(vocab_size=50304, d_model=2048, n_heads=16, n_layers=24,
                            max_len=32768),
}
MOE = {"gpt-1.3b-moe8": ("gpt-1.3b", 8, 2)}  # name → (dense shape, experts, top-k)


def gpt_moe(shape: LMShape, name: str, device_flops: float, experts: int,
            top_k: int) -> ModelProfile:
    """:func:`gpt` with every block's MLP a mixture of ``experts`` (Switch/GShard layout):
    each block holds ``experts`` MLPs of 8h² parameters, a token runs ``top_k`` of them
    (the forward FLOPs of the MLP part × top_k)."""
    dense = gpt(shape, name, device_flops)
    h, s = shape.d_model, shape.max_len
    mlp_params, mlp_flops = 8 * h * h, 2 * 8 * s * h * h
    layers = []
    for i, lay in enumerate(dense.layers):
        if 0 < i <= shape.n_layers:
            extra = (top_k - 1) * mlp_flops / device_flops
            lay = replace(lay, params=lay.params + (experts - 1) * mlp_params,
                          forward_per_sample=lay.forward_per_sample + extra,
                          backward_per_sample=lay.backward_per_sample + 2 * extra)
        layers.append(lay)
    return replace(dense, layers=tuple(layers),
                   moe=(experts, top_k, tuple(range(1, shape.n_layers + 1)),
                        shape.n_layers * experts * mlp_params))


def _dense(name: str) -> Callable[[float], ModelProfile]:
    return lambda flops: gpt(GPT_SHAPES[name], name, flops)


def _sparse(name: str) -> Callable[[float], ModelProfile]:
    base, experts, top_k = MOE[name]
    return lambda flops: gpt_moe(GPT_SHAPES[base], name, flops, experts, top_k)


ANALYTIC: dict[str, Callable[[float], ModelProfile]] = {
    "resnet101": resnet101, **{n: _dense(n) for n in GPT_SHAPES}, **{n: _sparse(n) for n in MOE}}
