"""Interop: a disttrain checkpoint exported as torch.distributed.checkpoint loads into torch's own
FSDP2 (``fully_shard``) on another number of ranks, and one torch's FSDP2 wrote imports into
disttrain (ZeRO-3 on 3 ranks loads it), bit for bit; safetensors exported from GPT-2 trained
under ZeRO-2 load in ``transformers`` with the same logits and import back. Damaged files
are refused in one line naming them; nothing is unpickled beyond DCP's metadata classes."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
import torch

from disttrain.cli import main
from disttrain.parallel.checkpoint_files import CheckpointError
from disttrain.train import DataOptions, TrainConfig, train
from disttrain.train.interop import export_checkpoint, import_checkpoint, load_weights
from tests import interop_cases
from tests.checkpoint_cases import assert_identical, state

pytestmark = pytest.mark.timeout(240)

CONFIG = TrainConfig(model="transformer", dataset="synthetic-lm",
                     data=DataOptions(num_samples=80, seq_len=8, vocab_size=48), steps=2,
                     global_batch=12, optimizer="adam", lr=3e-3, eval_every=0, log_every=0,
                     progress=False)


def rank_train(comm, config: TrainConfig) -> None:
    train(config, comm)


def test_a_zero3_checkpoint_loads_into_torch_fsdp2(pools, tmp_path):
    """zero3 on 3 ranks → DCP (the blocks as written, never gathered) → fully_shard on 2."""
    pools(3).run(rank_train, dataclasses.replace(CONFIG, strategy="zero3",
                                                 checkpoint_dir=str(tmp_path / "ckpt")))
    out = tmp_path / "dcp"
    assert main(["checkpoint", "export", "--format", "dcp", str(tmp_path / "ckpt"),
                 str(out)]) == 0
    saved = state(tmp_path / "ckpt" / "step-00000002")
    for loaded in pools(2).run(interop_cases.rank_fsdp_load, str(out)):
        assert_identical(loaded["state"], saved, "torch's FSDP2 loaded")
        assert loaded["hyper"]["lr"] == 3e-3 and loaded["hyper"]["betas"] == (0.9, 0.999)
    import_checkpoint(str(out), str(tmp_path / "back"), "dcp")  # and home again
    assert_identical(state(tmp_path / "back"), saved, "imported from the export")


def test_a_checkpoint_torch_fsdp2_wrote_imports_and_loads_into_zero3(pools, tmp_path):
    torch_dir, out = tmp_path / "torch", tmp_path / "imported"
    want = pools(2).run(interop_cases.rank_fsdp_save, str(torch_dir), 2)[0]
    assert main(["checkpoint", "import", "--format", "dcp", str(torch_dir), str(out)]) == 0
    assert_identical(state(out), want, "imported from torch's DCP")
    params = {k: v for k, v in want.items() if "/" not in k}
    for got in pools(3).run(interop_cases.rank_zero_load, str(out)):
        assert_identical(got, params, "ZeRO-3 on 3 ranks loaded torch's checkpoint")


def test_a_damaged_or_foreign_dcp_is_refused_in_one_line(pools, tmp_path, capfd):
    torch_dir = tmp_path / "torch"
    pools(2).run(interop_cases.rank_fsdp_save, str(torch_dir), 1)
    data = bytearray((torch_dir / "__1_0.distcp").read_bytes())
    (torch_dir / "__1_0.distcp").write_bytes(bytes(data[: len(data) // 2]))
    assert main(["checkpoint", "import", "--format", "dcp", str(torch_dir),
                 str(tmp_path / "a")]) == 2
    err = capfd.readouterr().err.strip()
    assert err.startswith(f"disttrain checkpoint: error: DCP file {torch_dir / '__1_0.distcp'}")
    assert "\n" not in err
    (torch_dir / ".metadata").write_bytes(pickle.dumps(Path("/")))  # a class DCP never writes
    with pytest.raises(CheckpointError, match=r"PosixPath|not a DCP metadata class|cannot be"):
        import_checkpoint(str(torch_dir), str(tmp_path / "b"), "dcp")
    (torch_dir / ".metadata").write_bytes(pickle.dumps(print))  # code: never run
    with pytest.raises(CheckpointError, match=r"builtins\.print is not a DCP metadata class"):
        import_checkpoint(str(torch_dir), str(tmp_path / "c"), "dcp")


def test_safetensors_load_in_transformers_with_the_same_logits(pools, tmp_path):
    """GPT-2 trained under ZeRO-2 on 2 ranks → safetensors and config.json → transformers'
    ``from_pretrained`` gives the trained model's logits; imported back, a freshly
    initialised model loads them too."""
    from transformers import AutoModelForCausalLM

    trained = pools(2).run(interop_cases.rank_zero_hf_save, str(tmp_path / "ckpt"))[0]
    out = tmp_path / "hf"
    export_checkpoint(str(tmp_path / "ckpt"), str(out), "safetensors")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "manifest.json",
                                                    "model.safetensors"]
    hf = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tokens = torch.randint(0, 48, (3, 8), generator=torch.Generator().manual_seed(0))
    reference = AutoModelForCausalLM.from_config(hf.config).eval()
    reference.load_state_dict(trained)  # the trained model as the run ended
    with torch.no_grad():
        assert torch.equal(hf(tokens).logits, reference(tokens).logits)
    back = tmp_path / "back"
    assert main(["checkpoint", "import", "--format", "safetensors", str(out), str(back)]) == 0
    torch.manual_seed(7)  # other weights everywhere: the import must fill every one
    fresh = AutoModelForCausalLM.from_config(hf.config).eval()
    load_weights(fresh, str(back))
    with torch.no_grad():
        assert torch.equal(fresh(tokens).logits, reference(tokens).logits)


def test_a_damaged_safetensors_file_is_refused_by_name(tmp_path):
    train(dataclasses.replace(CONFIG, checkpoint_dir=str(tmp_path / "ckpt")))
    out = tmp_path / "st"
    export_checkpoint(str(tmp_path / "ckpt"), str(out), "safetensors")
    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"checkpoint file {weights} is damaged: its "
                                              f"SHA-256 differs"):
        import_checkpoint(str(out), str(tmp_path / "back"), "safetensors")
