"""The loop's side of a Hugging Face training script, in one process: a GPT-2 or Llama as
the chain a pipeline cuts (the model's logits exactly, its own names, GPT-2's tied head
untied and listed); transformers' ``labels=`` loss equal to the loop's cross-entropy on the
aligned targets; dict batches fetched, moved and aligned; ``disttrain run`` with
``--model-config`` (a config transformers rejects is one line, before any rank starts)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from disttrain.cli import main
from disttrain.parallel.pipeline import layers_of
from disttrain.parallel.pipeline.hf import hf_stages
from disttrain.parallel.pipeline.partition import layer_names
from disttrain.train.batches import batch_aligner, shift_labels
from disttrain.train.data import DataInfo, DataOptions, fetch
from disttrain.train.device import to_device
from disttrain.train.loop import loss_fn
from disttrain.train.models import build_model
from tests.hf_loop_cases import SEQ, VOCAB, config_file, token_dicts

INFO = DataInfo((SEQ,), VOCAB, task="lm")


def model(name: str) -> Any:
    torch.manual_seed(0)
    return build_model(f"hf:{name}", INFO, config_file(name))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_chain_computes_the_models_logits_under_its_names(name):
    original = model(name)
    chain = hf_stages(copy.deepcopy(original))
    ids = torch.randint(VOCAB, (3, SEQ))
    want = original(input_ids=ids).logits
    assert torch.equal(chain(ids), want)
    assert torch.equal(chain({"input_ids": ids, "labels": ids}), want)
    layers = layers_of(chain)
    names = layer_names(chain, layers)
    state = {f"{n}.{k}": v for n, layer in zip(names, layers)
             for k, v in layer.state_dict().items()}
    assert sorted(state) == sorted(original.state_dict())
    assert all(torch.equal(state[k], v) for k, v in original.state_dict().items())
    if name == "gpt2":  # untied: the head holds a copy, listed with the embedding
        assert chain.tied == [("transformer.wte.weight", "lm_head.weight")]
        assert layers[-1].weight is not layers[0].weight
    else:
        assert chain.tied == []


def test_a_padding_mask_or_an_unknown_key_is_refused_in_one_line():
    chain = hf_stages(model("llama"))
    ids = torch.randint(VOCAB, (2, SEQ))
    mask = torch.ones_like(ids)
    chain({"input_ids": ids, "attention_mask": mask})  # all ones: nothing dropped
    mask[0, -1] = 0
    for batch in ({"input_ids": ids, "attention_mask": mask},
                  {"input_ids": ids, "token_type_ids": ids}):
        with pytest.raises(ValueError, match="only the hidden states") as caught:
            chain(batch)
        assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match="chains transformers' GPT-2 and Llama"):
        hf_stages(nn.Linear(2, 2))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_labels_loss_is_the_cross_entropy_of_the_aligned_targets(name):
    """transformers shifts the labels inside; the loop shifts them once when it fetches."""
    m = model(name)
    ids = torch.randint(VOCAB, (4, SEQ))
    labels = ids.clone()
    labels[0, -3:] = -100  # padding, ignored by both
    own = m(input_ids=ids, labels=labels)
    aligned = shift_labels(labels)
    assert torch.allclose(loss_fn(m(ids), aligned), own.loss, rtol=1e-6)
    assert loss_fn(own, aligned) is own.loss  # a loss the model computed is the loss


def test_dict_batches_are_fetched_moved_and_aligned():
    splits = token_dicts(DataOptions(num_samples=16, seq_len=SEQ, vocab_size=VOCAB))
    inputs, targets = fetch(splits.train, [0, 1, 2])
    assert set(inputs) == {"input_ids", "labels"} and torch.equal(targets, inputs["labels"])
    moved, _ = to_device((inputs, targets), torch.device("cpu"), torch.float64)
    assert isinstance(moved, dict) and moved["input_ids"].dtype == torch.long
    _, aligned = batch_aligner(model("gpt2"))((inputs, targets))
    assert torch.equal(aligned, shift_labels(targets))
    assert batch_aligner(nn.Linear(2, 2))((inputs, targets))[1] is targets  # not a causal LM


def test_run_trains_a_hugging_face_model_from_its_config(capsys):
    code = main(["run", "--model", "hf:llama", "--model-config", config_file("llama"),
                 "--dataset", "synthetic-lm", "--seq-len", str(SEQ), "--vocab-size",
                 str(VOCAB), "--steps", "2", "--global-batch", "4", "--log-every", "0"])
    assert code == 0
    assert "result strategy=single world_size=1 global_batch=4 steps=2" in capsys.readouterr().out


@pytest.mark.parametrize(("settings", "message"), [
    ({"n_layer": 2, "n_embd": 32, "n_head": 5}, "transformers rejects --model-config"),
    ({"n_layers": 2}, "did you mean 'n_layer'?"),
])
def test_run_refuses_a_bad_config_in_one_line_before_any_rank_starts(tmp_path, capsys,
                                                                      settings, message):
    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps(settings))
    assert main(["run", "--strategy", "ddp", "-n", "2", "--model", "hf:gpt2",
                 "--model-config", str(path), "--dataset", "synthetic-lm", "--seq-len",
                 str(SEQ), "--steps", "1"]) != 0
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err and err.startswith("disttrain run: error: model 'hf:gpt2'")


def test_model_config_beside_another_model_is_refused(capsys):
    assert main(["run", "--model", "mlp", "--model-config", config_file("gpt2")]) != 0
    assert "model 'mlp' takes none" in capsys.readouterr().err
