"""Small CPU-friendly models and the model registry.

Every built-in model is an ``nn.Sequential``: its layers are listed in the order data flows
through them, so the pipeline strategy can cut it into stages (``model[:k]``, ``model[k:]``).
A model factory takes the dataset's :class:`~disttrain.train.data.DataInfo` (input shape,
number of classes, task) and returns an ``nn.Module``; users plug in their own factory as
``"package.module:factory"``. Hugging Face models (``hf:gpt2``, ``hf:llama``, the extra
``hf``) are built from their transformers config (``--model-config FILE.json``), never
downloaded: :func:`hf_model`.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from disttrain.train.data import DataInfo
from disttrain.train.moe import TransformerMoE
from disttrain.train.registry import call_factory, resolve
from disttrain.train.transformer import TransformerLM


def _image_shape(info: DataInfo, model: str) -> tuple[int, int, int]:
    if info.task != "classification" or len(info.input_shape) != 3:
        raise ValueError(f"model {model!r} classifies images of shape (C, H, W); this dataset "
                         f"has {info.task} inputs of shape {info.input_shape}: use 'mlp' or "
                         f"'transformer' instead")
    c, h, w = info.input_shape
    return c, h, w


class LeNet(nn.Sequential):
    """LeNet-style CNN: two conv → ReLU → max-pool stages, then three fully connected layers.

    3×3 convolutions with padding keep the spatial size, and ceil-mode pooling halves it, so
    any input size works (8×8 digits: 8 → 4 → 2; 28×28: 28 → 14 → 7).
    """

    def __init__(self, in_channels: int = 1, height: int = 8, width: int = 8,
                 num_classes: int = 10, channels: tuple[int, int] = (16, 32),
                 hidden: tuple[int, int] = (120, 84)) -> None:
        c1, c2 = channels
        h, w = math.ceil(math.ceil(height / 2) / 2), math.ceil(math.ceil(width / 2) / 2)
        super().__init__(
            nn.Conv2d(in_channels, c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True),
            nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True),
            nn.Flatten(),
            nn.Linear(c2 * h * w, hidden[0]), nn.ReLU(),
            nn.Linear(hidden[0], hidden[1]), nn.ReLU(),
            nn.Linear(hidden[1], num_classes),
        )


class BasicBlock(nn.Module):
    """ResNet's basic block: ``relu(x' + bn(conv(relu(bn(conv(x))))))``, where ``x'`` is ``x``
    or, when the shape changes, a strided 1×1 projection of it (He et al., 2016)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet(nn.Sequential):
    """A small ResNet: a 3×3 stem, one basic block per width (each later one halving the
    spatial size), global average pooling and a linear classifier."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10,
                 widths: tuple[int, ...] = (16, 32, 64)) -> None:
        if not widths:
            raise ValueError("ResNet needs at least one width")
        layers: list[nn.Module] = [
            nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]), nn.ReLU()]
        previous = widths[0]
        for i, width in enumerate(widths):
            layers.append(BasicBlock(previous, width, stride=1 if i == 0 else 2))
            previous = width
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(previous, num_classes)]
        super().__init__(*layers)


class Bottleneck(nn.Module):
    """ResNet-50's block: 1×1 reduce → 3×3 (strided) → 1×1 expand to 4× the width, each
    with batch norm, plus the input or its strided 1×1 projection (He et al., 2016)."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out = width * self.expansion
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, stride, padding=1, bias=False), nn.BatchNorm2d(width),
            nn.ReLU(), nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out))
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out, 1, stride, bias=False),
                                          nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet50Shaped(nn.Sequential):
    """ResNet-50's layout, 3-4-6-3 bottleneck blocks (50 weight layers), at ``base`` channels
    instead of 64 (8: one eighth of the width, 1/64 of the parameters) and with a 3×3
    stride-1 stem instead of the 7×7 stride-2 stem and max-pool, which are for 224×224
    images: on 28×28 the four stages see 28, 14, 7 and 4 pixels a side."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, base: int = 8,
                 blocks: tuple[int, ...] = (3, 4, 6, 3)) -> None:
        layers: list[nn.Module] = [nn.Conv2d(in_channels, base, 3, padding=1, bias=False),
                                   nn.BatchNorm2d(base), nn.ReLU()]
        channels = base
        for stage, count in enumerate(blocks):
            width = base * 2 ** stage
            for i in range(count):
                layers.append(Bottleneck(channels, width, stride=2 if stage and not i else 1))
                channels = width * Bottleneck.expansion
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)]
        super().__init__(*layers)


class MLP(nn.Sequential):
    """Flatten, then Linear → ReLU for each hidden width, then a linear classifier."""

    def __init__(self, in_features: int, num_classes: int,
                 hidden: tuple[int, ...] = (128, 128)) -> None:
        layers: list[nn.Module] = [nn.Flatten()]
        previous = in_features
        for width in hidden:
            layers += [nn.Linear(previous, width), nn.ReLU()]
            previous = width
        layers.append(nn.Linear(previous, num_classes))
        super().__init__(*layers)


def lenet(info: DataInfo) -> nn.Module:
    c, h, w = _image_shape(info, "lenet")
    return LeNet(c, h, w, info.num_classes)


def resnet(info: DataInfo) -> nn.Module:
    c, _, _ = _image_shape(info, "resnet")
    return ResNet(c, info.num_classes)


def resnet50_w8(info: DataInfo) -> nn.Module:
    c, _, _ = _image_shape(info, "resnet50-w8")
    return ResNet50Shaped(c, info.num_classes, base=8)


def mlp(info: DataInfo) -> nn.Module:
    if info.task != "classification":
        raise ValueError(f"model 'mlp' classifies fixed-size inputs; this dataset's task is "
                         f"{info.task!r}: use 'transformer'")
    return MLP(math.prod(info.input_shape), info.num_classes)


def _lm_shape(info: DataInfo, model: str) -> tuple[int, int]:
    """(vocabulary, sequence length) of a token dataset; ValueError for other data."""
    if info.task != "lm" or len(info.input_shape) != 1:
        raise ValueError(f"model {model!r} is a language model over token sequences; this "
                         f"dataset has {info.task} inputs of shape {info.input_shape}: use "
                         f"dataset 'synthetic-lm' or your own token dataset")
    return info.num_classes, info.input_shape[0]


def transformer(info: DataInfo) -> nn.Module:
    vocab, length = _lm_shape(info, "transformer")
    return TransformerLM(vocab_size=vocab, max_len=length)


def transformer_d128(info: DataInfo) -> nn.Module:
    """The benchmark's default model: 2 blocks of width 128 (4 heads), about 0.42M
    parameters with a 64-token vocabulary; enough work per token that two ranks beat one
    process with two threads (docs/benchmarks.md)."""
    vocab, length = _lm_shape(info, "transformer-d128")
    return TransformerLM(vocab_size=vocab, max_len=length, d_model=128, n_heads=4, n_layers=2)


def transformer_moe(info: DataInfo) -> nn.Module:
    """The transformer with mixture-of-experts feed-forward blocks: 4 experts, top-2,
    capacity factor 1.25 (disttrain/train/moe.py; spread over ranks by --ep)."""
    vocab, length = _lm_shape(info, "transformer-moe")
    return TransformerMoE(vocab_size=vocab, max_len=length)


TRANSFORMER_MODELS = ("transformer", "transformer-d128")  # TransformerLMs: tp can split them
MOE_MODELS = ("transformer-moe",)  # with mixture-of-experts layers: ep spreads their experts
MODELS: dict[str, Callable[[DataInfo], nn.Module]] = {
    "lenet": lenet,
    "resnet": resnet,
    "resnet50-w8": resnet50_w8,
    "mlp": mlp,
    "transformer": transformer,
    "transformer-d128": transformer_d128,
    "transformer-moe": transformer_moe,
}


HF_MODELS = ("hf:gpt2", "hf:llama")  # transformers causal LMs, built from --model-config


def is_hf_model(name: str) -> bool:
    """``"hf:..."`` names a Hugging Face model (not an import path, despite the colon)."""
    return name.startswith("hf:")


def _hf_settings(name: str, config_file: str) -> dict[str, Any]:
    """The JSON object in ``config_file``; a one-line ValueError for anything else."""
    try:
        with open(config_file, encoding="utf-8") as f:
            settings = json.load(f)
    except OSError as exc:
        raise ValueError(f"model {name!r}: cannot read --model-config {config_file} "
                         f"({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"model {name!r}: --model-config {config_file} is not JSON "
                         f"({exc.msg}, line {exc.lineno})") from None
    if not isinstance(settings, dict):
        raise ValueError(f"model {name!r}: --model-config {config_file} must hold a JSON "
                         f"object of config fields, got {type(settings).__name__}")
    return settings


def hf_model(name: str, info: DataInfo, config_file: str | None) -> nn.Module:
    """A Hugging Face causal LM (``hf:gpt2``: GPT2LMHeadModel, ``hf:llama``:
    LlamaForCausalLM) built from its transformers config, given as JSON in
    ``config_file``, never downloaded. A missing ``vocab_size`` is the dataset's; token ids
    default inside the vocabulary; ``use_cache`` defaults to off (training). A config that
    transformers rejects, a field it does not know, or one too small for the data is a
    one-line ValueError."""
    if name not in HF_MODELS:
        raise ValueError(f"unknown model {name!r}; the Hugging Face models are "
                         f"{', '.join(HF_MODELS)}")
    if config_file is None:
        raise ValueError(f"model {name!r} is built from its transformers config: give "
                         f"--model-config FILE.json")
    try:
        import transformers
    except ImportError:
        raise ValueError(f"model {name!r} needs Hugging Face transformers: pip install "
                         f"'disttrain[hf]'") from None
    vocab, length = _lm_shape(info, name)
    model_type = name.removeprefix("hf:")
    settings = _hf_settings(name, config_file)
    if settings.pop("model_type", model_type) != model_type:
        raise ValueError(f"model {name!r}: --model-config {config_file} is for another "
                         f"model_type; write {model_type!r} or leave it out")
    default = transformers.AutoConfig.for_model(model_type)
    known = set(default.to_dict()) | set(getattr(default, "attribute_map", {}))
    unknown = sorted(set(settings) - known)
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"model {name!r}: --model-config {config_file} sets {unknown[0]!r}, "
                         f"which a {model_type} config does not have{hint}")
    settings.setdefault("vocab_size", vocab)
    settings.setdefault("use_cache", False)
    for token in ("bos_token_id", "eos_token_id"):
        given = getattr(default, token, None)
        if isinstance(given, int) and given >= settings["vocab_size"]:
            settings.setdefault(token, settings["vocab_size"] - 1)
    try:
        config = transformers.AutoConfig.for_model(model_type, **settings)
        model = transformers.AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # transformers raises many kinds: say which, on one line
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ValueError(f"model {name!r}: transformers rejects --model-config "
                         f"{config_file}: {reason}") from None
    if config.vocab_size < vocab or config.max_position_embeddings < length:
        raise ValueError(f"model {name!r}: --model-config {config_file} has vocab_size="
                         f"{config.vocab_size} and {config.max_position_embeddings} "
                         f"positions; the dataset needs {vocab} and {length}")
    assert isinstance(model, nn.Module)
    return model


def check_model(name: str, model_config: str | None, info: Callable[[], DataInfo]) -> None:
    """Fail now, in one line, on a model that cannot be built: an unknown name, a factory
    that does not import, ``--model-config`` beside a model that takes none, or a Hugging
    Face config that transformers rejects or that is too small for the data (``info()``,
    read only then). A Hugging Face model is built on the meta device: shapes, no memory."""
    if not is_hf_model(name):
        if model_config is not None:
            raise ValueError(f"--model-config is for the Hugging Face models "
                             f"({', '.join(HF_MODELS)}); model {name!r} takes none")
        resolve(MODELS, name, "model")
        return
    with torch.device("meta"):
        hf_model(name, info(), model_config)


def build_model(name: str, info: DataInfo, model_config: str | None = None) -> nn.Module:
    """The model registered as ``name`` (or returned by ``"pkg.mod:factory"``, or a Hugging
    Face model built from ``model_config``, :func:`hf_model`) for ``info``."""
    if is_hf_model(name):
        return hf_model(name, info, model_config)
    if model_config is not None:
        raise ValueError(f"--model-config is for the Hugging Face models "
                         f"({', '.join(HF_MODELS)}); model {name!r} takes none")
    factory = resolve(MODELS, name, "model")
    model = call_factory(factory, info, "model")
    if not isinstance(model, nn.Module):
        raise ValueError(f"model {name!r}: the factory must return a torch.nn.Module, got "
                         f"{type(model).__name__}")
    return model
