"""Shared pieces of the loop tests on Hugging Face models: tiny GPT-2 and Llama configs
(2 layers, width 32, 4 heads, Llama with 2 key/value heads, vocabulary 48, 8 positions),
written as the JSON files ``--model-config`` reads; the loop's config for them; a rank
function for the pools; a dict dataset (``{"input_ids", "labels"}`` items, as a tokenized
Hugging Face dataset gives). No test here."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch
from torch.utils.data import Dataset

from disttrain.train import TrainConfig, train
from disttrain.train.data import DataOptions, DatasetSplits, synthetic_lm

VOCAB, SEQ = 48, 8
CONFIGS: dict[str, dict[str, Any]] = {
    "gpt2": {"n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": SEQ, "resid_pdrop": 0.0,
             "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "llama": {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": SEQ},
}


def config_file(name: str) -> str:
    """The model's transformers config as a JSON file (written once per process)."""
    path = os.path.join(tempfile.gettempdir(), f"disttrain-test-hf-{name}-{os.getuid()}.json")
    if not os.path.exists(path):
        with open(path + ".part", "w", encoding="utf-8") as f:
            json.dump(CONFIGS[name], f)
        os.replace(path + ".part", path)
    return path


def loop_config(name: str, **changes: Any) -> TrainConfig:
    """fp32, Adam, three steps of 8 sequences of synthetic-lm, evaluated at the end."""
    settings: dict[str, Any] = {
        "model": f"hf:{name}", "model_config": config_file(name), "dataset": "synthetic-lm",
        "data": DataOptions(num_samples=48, seq_len=SEQ, vocab_size=VOCAB), "steps": 3,
        "global_batch": 8, "optimizer": "adam", "lr": 1e-3, "eval_every": 0,
        "log_every": 0, "progress": False}
    return TrainConfig(**{**settings, **changes})


def rank_train(comm: Any, config: TrainConfig) -> tuple[dict[str, torch.Tensor], Any]:
    """This rank's trained parameters (its stage's, under the model's names) and result."""
    torch.set_num_threads(1)
    result = train(config, comm)
    state = {k: v.detach().clone() for k, v in result.model.state_dict().items()}
    return state, result.without_model()


class TokenDicts(Dataset[dict[str, torch.Tensor]]):
    """Items ``{"input_ids": (T,), "labels": (T,)}``, labels equal to the inputs (the model
    shifts them), the last ``masked`` labels of every item ignored (-100): every
    micro-batch holds as many labelled tokens, so the mean of the micro-batches' means
    (what data parallelism and pipelines average) is the batch's mean."""

    def __init__(self, tokens: torch.Tensor, masked: int = 2) -> None:
        self.tokens, self.masked = tokens, masked

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.tokens[i].clone()
        labels[-self.masked:] = -100
        return {"input_ids": self.tokens[i], "labels": labels}


def token_dicts(options: DataOptions) -> DatasetSplits:
    """``--dataset tests.hf_loop_cases:token_dicts``: synthetic-lm's sequences as dicts."""
    splits = synthetic_lm(options)
    train_ids, test_ids = (split.tensors[0] for split in (splits.train, splits.test))
    return DatasetSplits(TokenDicts(train_ids), TokenDicts(test_ids), splits.info)


def without_key_bias(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """GPT-2's fused q, k, v bias with its key third zeroed: a bias added to every key
    shifts a query's scores by one constant, which softmax ignores, so its gradient is
    rounding noise that Adam scales into full-size steps, different for every order of the
    same sums (tests/tensor_parallel_cases.py says the same of the TransformerLM's)."""
    if not name.endswith("attn.c_attn.bias"):
        return tensor
    tensor = tensor.clone()
    tensor.view(3, -1)[1].zero_()
    return tensor


def worst_relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]
                         ) -> tuple[float, str]:
    """The largest ‖got − want‖ / ‖want‖ over the keys of ``got`` (key biases aside) and
    its name."""
    worst, name = 0.0, ""
    for key, value in got.items():
        value, wanted = without_key_bias(key, value), without_key_bias(key, want[key])
        err = float((value - wanted).norm() / wanted.norm().clamp_min(1e-30))
        if err >= worst:
            worst, name = err, key
    return worst, name
