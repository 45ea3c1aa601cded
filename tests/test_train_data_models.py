"""Datasets, models, registries and TrainConfig validation (no processes)."""

from __future__ import annotations

import pytest
import torch

from disttrain.train import DataInfo, DataOptions, DatasetSplits, TrainConfig, build_dataset
from disttrain.train.data import fetch
from disttrain.train.models import MODELS, build_model

NOT_CALLABLE = 3


def test_digits_split_is_disjoint_fixed_and_normalized():
    data = build_dataset("digits")
    assert data.info == DataInfo((1, 8, 8), 10)
    train_x, train_y = data.train.tensors
    test_x, test_y = data.test.tensors
    assert train_x.shape[1:] == (1, 8, 8) and len(train_x) + len(test_x) == 1797
    assert len(test_x) == round(1797 * 0.2)
    assert set(train_y.tolist()) == set(range(10)) == set(test_y.tolist())
    # the split is split() (disjoint, tested below) of the raw images with the fixed seed
    from disttrain.train.data import DIGITS_SPLIT_SEED, load_digits_arrays, split

    images, labels = load_digits_arrays()
    raw_train, raw_test = split(images, labels, 0.2, DIGITS_SPLIT_SEED)
    assert len(raw_train) + len(raw_test) == len(images)
    torch.testing.assert_close(train_y, raw_train.tensors[1])
    assert abs(float(train_x.mean())) < 1e-4 and abs(float(train_x.std()) - 1) < 1e-3
    again = build_dataset("digits", DataOptions(seed=99))  # the training seed never moves it
    torch.testing.assert_close(again.test.tensors[0], test_x)


def test_split_indices_are_disjoint():
    from disttrain.train.data import split

    inputs = torch.arange(50.0).unsqueeze(1)
    train, test = split(inputs, torch.zeros(50, dtype=torch.long), 0.2, seed=3)
    train_ids, test_ids = set(train.tensors[0].flatten().tolist()), set(
        test.tensors[0].flatten().tolist())
    assert not train_ids & test_ids and len(train_ids | test_ids) == 50 and len(test_ids) == 10


def test_synthetic_any_shape_is_deterministic_and_learnable_by_rule():
    options = DataOptions(num_samples=300, input_shape=(3, 5, 7), num_classes=4, seed=1)
    a, b = build_dataset("synthetic", options), build_dataset("synthetic", options)
    assert a.train.tensors[0].shape == (240, 3, 5, 7) and a.info.num_classes == 4
    torch.testing.assert_close(a.train.tensors[0], b.train.tensors[0])
    assert a.train.tensors[1].unique().numel() == 4
    other = build_dataset("synthetic", DataOptions(num_samples=300, input_shape=(3, 5, 7),
                                                   num_classes=4, seed=2))
    assert not torch.equal(other.train.tensors[0], a.train.tensors[0])


def test_synthetic_lm_targets_are_next_tokens():
    options = DataOptions(num_samples=100, seq_len=12, vocab_size=20, noise=0.0)
    data = build_dataset("synthetic-lm", options)
    inputs, targets = data.train.tensors
    assert inputs.shape == targets.shape == (80, 12) and inputs.dtype == torch.long
    assert data.info == DataInfo((12,), 20, "lm")
    torch.testing.assert_close(inputs[:, 1:], targets[:, :-1])
    # noise 0: each token has exactly one successor
    pairs = {(int(a), int(b)) for a, b in zip(inputs.flatten(), targets.flatten())}
    assert len(pairs) == len({a for a, _ in pairs})


@pytest.mark.parametrize("model,dataset,options,out", [
    ("lenet", "digits", DataOptions(), (10,)),
    ("lenet", "synthetic", DataOptions(input_shape=(3, 28, 28), num_classes=5), (5,)),
    ("lenet", "synthetic", DataOptions(input_shape=(2, 3, 5)), (10,)),
    ("resnet", "digits", DataOptions(), (10,)),
    ("resnet", "synthetic", DataOptions(input_shape=(3, 16, 16), num_classes=3), (3,)),
    ("mlp", "digits", DataOptions(), (10,)),
    ("mlp", "synthetic", DataOptions(input_shape=(20,)), (10,)),
    ("transformer", "synthetic-lm", DataOptions(seq_len=16, vocab_size=30), (16, 30)),
    ("transformer-d128", "synthetic-lm", DataOptions(seq_len=16, vocab_size=30), (16, 30)),
    ("resnet50-w8", "digits-28", DataOptions(), (10,)),
    ("resnet50-w8", "digits", DataOptions(), (10,)),
])
def test_models_forward_backward_shapes(model, dataset, options, out):
    data = build_dataset(dataset, DataOptions(num_samples=64, **{
        k: getattr(options, k) for k in ("input_shape", "num_classes", "seq_len", "vocab_size")}))
    net = build_model(model, data.info)
    assert isinstance(net, torch.nn.Sequential), "built-in models list their layers in order"
    inputs, targets = fetch(data.train, range(5))
    logits = net(inputs)
    assert logits.shape == (5, *out)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten())
    loss.backward()
    grads = [p.grad for p in net.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(float(g.abs().sum()) > 0 for g in grads)
    # running the layers one by one equals the model (what a pipeline split relies on)
    x = inputs
    net.eval()
    for layer in net:
        x = layer(x)
    torch.testing.assert_close(x, net(inputs))


def test_transformer_is_causal():
    data = build_dataset("synthetic-lm", DataOptions(num_samples=10, seq_len=8))
    net = build_model("transformer", data.info).eval()
    tokens = data.train.tensors[0][:2].clone()
    before = net(tokens)
    tokens[:, 5] = (tokens[:, 5] + 1) % data.info.num_classes
    after = net(tokens)
    torch.testing.assert_close(before[:, :5], after[:, :5])  # the past cannot see the future
    assert not torch.allclose(before[:, 5:], after[:, 5:])


@pytest.mark.parametrize("model,dataset", [("lenet", "synthetic-lm"), ("transformer", "digits"),
                                           ("mlp", "synthetic-lm"),
                                           ("resnet", "synthetic:1d")])
def test_model_dataset_mismatch_is_explained(model, dataset):
    options = DataOptions(input_shape=(12,)) if dataset.endswith("1d") else DataOptions()
    data = build_dataset(dataset.split(":")[0], options)
    with pytest.raises(ValueError, match="use"):
        build_model(model, data.info)


def tiny_model(info):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, info.num_classes))


def no_arg_dataset():
    x = torch.randn(20, 4)
    ds = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
    return DatasetSplits(ds, ds, DataInfo((4,), 2))


def test_user_factories_by_import_path():
    net = build_model(f"{__name__}:tiny_model", DataInfo((1, 8, 8), 7))
    assert net(torch.zeros(2, 1, 8, 8)).shape == (2, 7)
    assert build_dataset(f"{__name__}:no_arg_dataset").info.num_classes == 2


@pytest.mark.parametrize("name,match", [
    ("nosuch", "unknown model 'nosuch'; choose one of: lenet, mlp, resnet, resnet50-w8, "
     "transformer, transformer-d128, transformer-moe"),
    ("nosuch.module:f", "cannot import module"),
    (f"{__name__}:missing", "has no attribute"),
    (f"{__name__}:NOT_CALLABLE", "not a callable factory"),
    ("justcolon:", "not a valid import path"),
])
def test_bad_model_names(name, match):
    with pytest.raises(ValueError, match=match):
        build_model(name, DataInfo((1, 8, 8), 10))


def test_bad_dataset_names_and_results():
    with pytest.raises(ValueError, match="unknown dataset 'mnist'"):
        build_dataset("mnist")
    with pytest.raises(ValueError, match=r"must return disttrain\.train\.DatasetSplits"):
        build_dataset(f"{__name__}:tiny_model")  # returns a model, not splits
    assert set(MODELS) == {"lenet", "resnet", "resnet50-w8", "mlp", "transformer",
                           "transformer-d128", "transformer-moe"}


def test_resnet50_shape_and_upsampled_digits():
    """ResNet-50's 3-4-6-3 bottlenecks (53 convolutions with the 4 projections, 50 weight
    layers on the main path) at 1/8 width, on the digits at MNIST's 28×28."""
    data = build_dataset("digits-28")
    small = build_dataset("digits")
    assert data.info == DataInfo((1, 28, 28), 10)
    assert (len(data.train), len(data.test)) == (len(small.train), len(small.test))
    torch.testing.assert_close(data.train.tensors[1], small.train.tensors[1])
    net = build_model("resnet50-w8", data.info)
    convs = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 53 and convs[-1].out_channels == 8 * 8 * 4
    assert 360_000 < sum(p.numel() for p in net.parameters()) < 390_000


@pytest.mark.parametrize("kwargs,match", [
    ({"epochs": 1, "steps": 5}, "epochs or steps"),
    ({"epochs": 0}, "epochs"),
    ({"global_batch": 0}, "global_batch"),
    ({"optimizer": "lbfgs"}, "optimizer"),
    ({"precision": "fp8"}, "precision"),
    ({"lr": 0}, "lr"),
    ({"resume": True}, "checkpoint_dir"),
    ({"eval_every": -1}, "eval_every"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kwargs)


def test_global_batch_must_split_evenly():
    assert TrainConfig(global_batch=32, accumulate=2).micro_batch(4) == 4
    with pytest.raises(ValueError, match="does not split evenly over 3 data-parallel rank"):
        TrainConfig(global_batch=32).micro_batch(3)
    with pytest.raises(ValueError, match="input_shape"):
        DataOptions(input_shape=(0, 3))
