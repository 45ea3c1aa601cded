"""The Hugging Face model names: ``hf:gpt2`` and ``hf:llama`` built from a transformers
config given as JSON (never downloaded), filled from the dataset where it is silent; a
config transformers rejects, a field it does not know, a config too small for the data, a
missing or unreadable file, or ``hf:`` without the extra installed, is a one-line error."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from disttrain.train.data import DataInfo
from disttrain.train.models import HF_MODELS, build_model

pytest.importorskip("transformers")

INFO = DataInfo(input_shape=(12,), num_classes=48, task="lm")
GPT2 = {"n_layer": 1, "n_embd": 24, "n_head": 4, "n_positions": 16}
LLAMA = {"num_hidden_layers": 1, "hidden_size": 24, "intermediate_size": 32,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16}


def _file(tmp_path: Path, settings: Any) -> str:
    path = tmp_path / "config.json"
    path.write_text(settings if isinstance(settings, str) else json.dumps(settings))
    return str(path)


def _error(name: str, config: str | None, info: DataInfo = INFO) -> str:
    with pytest.raises(ValueError) as caught:
        build_model(name, info, config)
    message = str(caught.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize(("name", "settings", "kind"), [
    ("hf:gpt2", GPT2, "GPT2LMHeadModel"), ("hf:llama", LLAMA, "LlamaForCausalLM")])
def test_a_config_file_builds_the_model_with_the_datasets_vocabulary(tmp_path, name, settings,
                                                                       kind):
    model: Any = build_model(name, INFO, _file(tmp_path, settings))
    assert type(model).__name__ == kind and name in HF_MODELS
    assert model.config.vocab_size == 48 and model.config.use_cache is False
    assert model.config.eos_token_id < 48  # GPT-2's 50256 would lie outside
    assert model.get_output_embeddings().weight.shape == (48, 24)


def test_a_config_transformers_rejects_is_one_line(tmp_path):
    message = _error("hf:gpt2", _file(tmp_path, {**GPT2, "n_head": 5}))
    assert "transformers rejects --model-config" in message and "divisible" in message
    message = _error("hf:llama", _file(tmp_path, {**LLAMA, "num_attention_heads": 5}))
    assert "transformers rejects" in message and "multiple of the number" in message


def test_a_field_the_config_does_not_have_is_named_with_the_likely_one(tmp_path):
    message = _error("hf:gpt2", _file(tmp_path, {**GPT2, "n_layers": 2}))
    assert "sets 'n_layers'" in message and "did you mean 'n_layer'?" in message


def test_a_config_too_small_for_the_data_says_what_it_needs(tmp_path):
    message = _error("hf:gpt2", _file(tmp_path, {**GPT2, "n_positions": 8}))
    assert "8 positions; the dataset needs 48 and 12" in message
    message = _error("hf:llama", _file(tmp_path, {**LLAMA, "vocab_size": 40}))
    assert "vocab_size=40" in message


def test_bad_files_and_names_are_one_line(tmp_path):
    assert "give --model-config FILE.json" in _error("hf:gpt2", None)
    assert "is not JSON" in _error("hf:gpt2", _file(tmp_path, "{n_layer: 1"))
    assert "must hold a JSON object" in _error("hf:gpt2", _file(tmp_path, "[1, 2]"))
    assert "cannot read" in _error("hf:gpt2", str(tmp_path / "missing.json"))
    assert "is for another model_type" in _error(
        "hf:gpt2", _file(tmp_path, {**LLAMA, "model_type": "llama"}))
    assert "the Hugging Face models are hf:gpt2, hf:llama" in _error("hf:bert", None)
    assert "takes none" in _error("transformer", _file(tmp_path, GPT2))
    assert "language model over token sequences" in _error(
        "hf:gpt2", _file(tmp_path, GPT2), DataInfo(input_shape=(1, 8, 8), num_classes=10))


def test_without_the_extra_the_error_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    assert "pip install 'disttrain[hf]'" in _error("hf:llama", _file(tmp_path, LLAMA))
