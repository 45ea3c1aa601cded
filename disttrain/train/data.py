"""Built-in datasets that need no download, the dataset registry, and batch fetching.

* ``digits``: scikit-learn's bundled handwritten digits (1797 real 8×8 grey images, 10
  classes, shipped inside the scikit-learn wheel), normalized and split 80/20 into train and
  held-out test by a fixed seed, so every run and every rank sees the same split.
* ``digits-28``: the same images upsampled to MNIST's 28×28 (bilinear), for MNIST-shaped
  models without a download.
* ``synthetic``: Gaussian inputs of any shape labelled by a fixed random linear "teacher"
  (``label = argmax(W·x)``), a rule a model can learn to high accuracy.
* ``synthetic-lm``: token sequences that follow a fixed random successor table with
  probability ``1 - noise`` (else a uniform token): next-token prediction is learnable.
* ``tokens:PATH`` and ``text:PATH``: a user's corpus, a memory-mapped file of token ids or
  plain text as bytes, cut into ``seq_len`` windows (:mod:`.token_files`).

A dataset factory takes :class:`DataOptions` and returns :class:`DatasetSplits`; users plug
in their own as ``"package.module:factory"`` (see docs/training.md). The loop reads each
step's batch with :func:`fetch`, on loader threads ahead of the step (:mod:`.loader`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from disttrain.train.registry import call_factory, resolve
from disttrain.train.token_files import TOKEN_DTYPES, file_spec, open_token_file, token_splits

DIGITS_SPLIT_SEED = 1797  # fixed: the held-out digits never depend on the training seed
TASKS = ("classification", "lm")
LOADER_FIELDS = ("loader_workers", "prefetch")  # how the data is read, not which data


@dataclass(frozen=True)
class DataOptions:
    """Sizes of the synthetic datasets (``digits`` ignores all but ``test_fraction``), the
    token files' layout, and how the loop reads batches: ``loader_workers`` threads fetch up
    to ``prefetch`` steps' batches ahead of the step (0 workers: in the step itself)."""

    num_samples: int = 2048  # train + test
    input_shape: tuple[int, ...] = (1, 8, 8)  # one sample, for "synthetic"
    num_classes: int = 10
    seq_len: int = 32  # tokens per sample, for "synthetic-lm", "tokens:" and "text:"
    vocab_size: int = 64  # "synthetic-lm"; "tokens:" ids must be below it ("text:": 256)
    noise: float = 0.1  # fraction of random tokens in "synthetic-lm"
    test_fraction: float = 0.2
    seed: int = 0  # generates the synthetic data (not the training order)
    token_dtype: str = "uint16"  # "tokens:" files: uint16 (nanoGPT's) or uint32 ids
    loader_workers: int = 1  # threads reading batches ahead of the step (0: in the step)
    prefetch: int = 2  # steps' batches read ahead of the step running

    def __post_init__(self) -> None:
        if self.num_samples < 2:
            raise ValueError(f"num_samples must be ≥ 2 (train and test), got {self.num_samples}")
        shape = tuple(self.input_shape)
        if not shape or any(not isinstance(d, int) or d < 1 for d in shape):
            raise ValueError(f"input_shape must be positive ints like (1, 8, 8), got "
                             f"{self.input_shape!r}")
        object.__setattr__(self, "input_shape", shape)
        if self.num_classes < 2:
            raise ValueError(f"num_classes must be ≥ 2, got {self.num_classes}")
        if self.seq_len < 1 or self.vocab_size < 2:
            raise ValueError(f"seq_len must be ≥ 1 and vocab_size ≥ 2, got {self.seq_len}, "
                             f"{self.vocab_size}")
        if not 0.0 <= self.noise <= 1.0:
            raise ValueError(f"noise must be in [0, 1], got {self.noise}")
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {self.test_fraction}")
        if self.token_dtype not in TOKEN_DTYPES:
            raise ValueError(f"token_dtype must be one of {', '.join(TOKEN_DTYPES)} (how the "
                             f"token file was written), got {self.token_dtype!r}")
        for name, low in (("loader_workers", 0), ("prefetch", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int ≥ {low}, got {value!r}")

    def identity(self) -> dict[str, object]:
        """The fields that decide the data (what a checkpoint must agree with): all but how
        it is read, and ``token_dtype`` only when it is not the default (checkpoints written
        before it existed still resume)."""
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k not in LOADER_FIELDS}
        if fields["token_dtype"] == DataOptions.token_dtype:
            del fields["token_dtype"]
        return fields


@dataclass(frozen=True)
class DataInfo:
    """What a model needs to know about its data."""

    input_shape: tuple[int, ...]  # one sample's input (without the batch dimension)
    num_classes: int  # classes, or the vocabulary size for a language model
    task: str = "classification"  # "classification": target (B,); "lm": target (B, T)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")


@dataclass(frozen=True)
class DatasetSplits:
    """A training split, a held-out split, and their description."""

    train: Dataset[Any]
    test: Dataset[Any]
    info: DataInfo

    def __post_init__(self) -> None:
        for name in ("train", "test"):
            split = getattr(self, name)
            if not hasattr(split, "__getitem__") or not hasattr(split, "__len__"):
                raise ValueError(f"DatasetSplits.{name} must be a map-style dataset "
                                 f"(__getitem__ and __len__), got {type(split).__name__}")
        if size(self.train) == 0 or size(self.test) == 0:
            raise ValueError("DatasetSplits.train and .test must both be non-empty")


def size(dataset: Dataset[Any]) -> int:
    """``len(dataset)`` (torch's Dataset type does not declare ``__len__``)."""
    return len(dataset)  # type: ignore[arg-type]


def fetch(dataset: Dataset[Any], indices: Sequence[int] | torch.Tensor) -> tuple[Any, Any]:
    """One batch ``(inputs, targets)``: a tensor gather for TensorDatasets, one read for a
    dataset with ``get_batch(indices)`` (a token file's), else collated items; items that
    are dicts (``{"input_ids": ..., "labels": ...}``) give ``(the dict, its labels)``, the
    dict being the model's keyword arguments (:mod:`disttrain.train.batches`)."""
    get_batch = getattr(dataset, "get_batch", None)
    if callable(get_batch):
        inputs, targets = get_batch(indices)
        return inputs, targets
    if isinstance(dataset, TensorDataset):
        index = torch.as_tensor(indices, dtype=torch.long)
        inputs, targets = dataset.tensors[0], dataset.tensors[1]
        return inputs[index], targets[index]
    batch = default_collate([dataset[int(i)] for i in indices])
    if isinstance(batch, Mapping):
        return dict(batch), batch.get("labels")
    return batch[0], batch[1]


def split(inputs: torch.Tensor, targets: torch.Tensor, test_fraction: float,
          seed: int) -> tuple[TensorDataset, TensorDataset]:
    """Shuffle by ``seed`` and cut into disjoint train/test TensorDatasets."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(inputs), generator=generator)
    n_test = max(1, round(len(inputs) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return (TensorDataset(inputs[train], targets[train]),
            TensorDataset(inputs[test], targets[test]))


def load_digits_arrays() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled digits as (images float32 (N, 1, 8, 8) in [0, 1], labels)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError("the 'digits' dataset needs scikit-learn: pip install "
                          "'disttrain[data]' (or pip install scikit-learn)") from exc
    bunch: Any = load_digits()
    images = torch.as_tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return images, torch.as_tensor(bunch.target, dtype=torch.long)


def digits(options: DataOptions) -> DatasetSplits:
    """Real handwritten digits, normalized with the training split's mean and std."""
    images, labels = load_digits_arrays()
    train, test = split(images, labels, options.test_fraction, DIGITS_SPLIT_SEED)
    mean, std = train.tensors[0].mean(), train.tensors[0].std()
    train, test = (TensorDataset((part.tensors[0] - mean) / std, part.tensors[1])
                   for part in (train, test))
    return DatasetSplits(train, test, DataInfo((1, 8, 8), 10))


def digits_28(options: DataOptions) -> DatasetSplits:
    """The same digits, upsampled to MNIST's 28×28 (bilinear): real images of MNIST's shape
    with no download."""
    split8 = digits(options)
    parts = []
    for part in (split8.train, split8.test):
        assert isinstance(part, TensorDataset)
        images, labels = part.tensors[0], part.tensors[1]
        big = torch.nn.functional.interpolate(images, size=(28, 28), mode="bilinear",
                                              align_corners=False)
        parts.append(TensorDataset(big, labels))
    return DatasetSplits(parts[0], parts[1], DataInfo((1, 28, 28), 10))


def synthetic(options: DataOptions) -> DatasetSplits:
    """Gaussian inputs labelled by a fixed random linear teacher: ``argmax(W·x)``."""
    generator = torch.Generator().manual_seed(options.seed)
    inputs = torch.randn(options.num_samples, *options.input_shape, generator=generator)
    features = inputs[0].numel()
    teacher = torch.randn(features, options.num_classes, generator=generator)
    labels = (inputs.reshape(options.num_samples, features) @ teacher).argmax(dim=1)
    train, test = split(inputs, labels, options.test_fraction, options.seed)
    return DatasetSplits(train, test, DataInfo(options.input_shape, options.num_classes))


def synthetic_lm(options: DataOptions) -> DatasetSplits:
    """Token sequences following a random successor table, with a ``noise`` share of random
    tokens. Inputs are ``tokens[:-1]``, targets ``tokens[1:]`` (next-token prediction)."""
    g = torch.Generator().manual_seed(options.seed)
    n, length, vocab = options.num_samples, options.seq_len + 1, options.vocab_size
    successor = torch.randperm(vocab, generator=g)
    tokens = torch.empty(n, length, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (n,), generator=g)
    for t in range(1, length):
        random_tokens = torch.randint(vocab, (n,), generator=g)
        noisy = torch.rand(n, generator=g) < options.noise
        tokens[:, t] = torch.where(noisy, random_tokens, successor[tokens[:, t - 1]])
    train, test = split(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(),
                        options.test_fraction, options.seed)
    return DatasetSplits(train, test, DataInfo((options.seq_len,), vocab, task="lm"))


DATASETS: dict[str, Callable[[DataOptions], DatasetSplits]] = {
    "digits": digits,
    "digits-28": digits_28,
    "synthetic": synthetic,
    "synthetic-lm": synthetic_lm,
}


def file_dataset(kind: str, path: str, options: DataOptions) -> DatasetSplits:
    """``tokens:PATH`` or ``text:PATH``: the file's ``seq_len`` windows, the tail held out."""
    source = open_token_file(kind, path, options.token_dtype, options.vocab_size,
                             options.seq_len)
    train, test = token_splits(source, options.seq_len, options.test_fraction)
    return DatasetSplits(train, test, DataInfo((options.seq_len,), source.vocab, task="lm"))


def check_dataset(name: str, options: DataOptions | None = None) -> None:
    """Fail now, in one line, on a dataset that cannot be built: an unknown name, a factory
    that does not import, a token or text file that cannot be used (opened and checked,
    not read)."""
    spec = file_spec(name)
    if spec is not None:
        file_dataset(*spec, options or DataOptions())
    else:
        resolve(DATASETS, name, "dataset")


def build_dataset(name: str, options: DataOptions | None = None) -> DatasetSplits:
    """The dataset registered as ``name``, the file named by ``"tokens:PATH"`` or
    ``"text:PATH"``, or the one a ``"pkg.mod:factory"`` returns."""
    spec = file_spec(name)
    if spec is not None:
        return file_dataset(*spec, options or DataOptions())
    factory = resolve(DATASETS, name, "dataset")
    splits = call_factory(factory, options or DataOptions(), "dataset")
    if not isinstance(splits, DatasetSplits):
        raise ValueError(f"dataset {name!r}: the factory must return "
                         f"disttrain.train.DatasetSplits, got {type(splits).__name__}")
    return splits
