"""Small CPU-friendly models and the model registry.

Every built-in model is an ``nn.Sequential``: its layers are listed in the order data flows
through them, so the pipeline strategy can cut it into stages (``model[:k]``, ``model[k:]``).
A model factory takes the dataset's :class:`~disttrain.train.data.DataInfo` (input shape,
number of classes, task) and returns an ``nn.Module``; users plug in their own factory as
``"package.module:factory"``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from disttrain.train.data import DataInfo
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


TRANSFORMER_MODELS = ("transformer", "transformer-d128")  # TransformerLMs: tp can split them
MODELS: dict[str, Callable[[DataInfo], nn.Module]] = {
    "lenet": lenet,
    "resnet": resnet,
    "resnet50-w8": resnet50_w8,
    "mlp": mlp,
    "transformer": transformer,
    "transformer-d128": transformer_d128,
}


def build_model(name: str, info: DataInfo) -> nn.Module:
    """The model registered as ``name`` (or returned by ``"pkg.mod:factory"``) for ``info``."""
    factory = resolve(MODELS, name, "model")
    model = call_factory(factory, info, "model")
    if not isinstance(model, nn.Module):
        raise ValueError(f"model {name!r}: the factory must return a torch.nn.Module, got "
                         f"{type(model).__name__}")
    return model
