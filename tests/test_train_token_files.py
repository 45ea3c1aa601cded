"""A user's corpus as data: ``tokens:PATH`` (a memory-mapped file of token ids) and
``text:PATH`` (bytes). The windows against an independent cut of the same tokens, a run on a
file against the same tokens in memory (one process, and ddp on two ranks against one),
resuming mid-epoch with loader threads reading ahead, and the one-line errors of unusable
files."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from disttrain.cli import main
from disttrain.train import DataInfo, DataOptions, DatasetSplits, TrainConfig, build_dataset, train
from disttrain.train.data import check_dataset, fetch

SEQ, VOCAB, LENGTH = 8, 24, 2000
MEMORY = "tests.test_train_token_files:in_memory"


@pytest.fixture(autouse=True)
def one_thread():
    """Same thread count as the pool ranks, and no oversubscription on 2 shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def corpus() -> np.ndarray:
    """2000 tokens that follow a fixed successor table 90 % of the time: learnable."""
    rng = np.random.default_rng(7)
    successor = rng.permutation(VOCAB)
    tokens = np.empty(LENGTH, dtype=np.int64)
    tokens[0] = 0
    for i in range(1, LENGTH):
        tokens[i] = successor[tokens[i - 1]] if rng.random() < 0.9 else rng.integers(VOCAB)
    return tokens


def write_tokens(path: Path, dtype: str = "uint16") -> str:
    corpus().astype(dtype).tofile(path)
    return f"tokens:{path}"


def in_memory(options: DataOptions) -> DatasetSplits:
    """The same tokens as TensorDatasets, cut here independently of disttrain: sample i is
    tokens [i·T, i·T + T) and its targets one token later; the last fifth held out."""
    tokens, length = torch.from_numpy(corpus()), options.seq_len
    n = (len(tokens) - 1) // length
    inputs, targets = tokens[:n * length].view(n, length), tokens[1:n * length + 1].view(n, length)
    held = round(n * options.test_fraction)
    return DatasetSplits(TensorDataset(inputs[:-held], targets[:-held]),
                         TensorDataset(inputs[-held:], targets[-held:]),
                         DataInfo((length,), options.vocab_size, task="lm"))


def everything(split) -> tuple[torch.Tensor, torch.Tensor]:
    return fetch(split, torch.arange(len(split)))


def options(**kwargs) -> DataOptions:
    return DataOptions(seq_len=SEQ, vocab_size=VOCAB, **kwargs)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_windows_are_the_stream_cut_every_seq_len_tokens(tmp_path, dtype):
    data = build_dataset(write_tokens(tmp_path / "t.bin", dtype), options(token_dtype=dtype))
    want = in_memory(options())
    assert data.info == DataInfo((SEQ,), VOCAB, task="lm")
    for got_split, want_split in ((data.train, want.train), (data.test, want.test)):
        got, expected = everything(got_split), want_split.tensors
        assert got[0].dtype == torch.long and got[0].is_contiguous()
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    inputs, targets = data.train[5]  # one item is the batch's row
    assert torch.equal(inputs, want.train.tensors[0][5])
    assert torch.equal(targets, want.train.tensors[1][5])


def test_text_is_bytes_with_a_vocabulary_of_256(tmp_path):
    text = "naïve café, " * 30  # UTF-8: some characters are two bytes
    (tmp_path / "c.txt").write_text(text, encoding="utf-8")
    data = build_dataset(f"text:{tmp_path / 'c.txt'}", options())
    assert data.info == DataInfo((SEQ,), 256, task="lm")
    raw = torch.tensor(list(text.encode("utf-8")))
    inputs, targets = everything(data.train)
    assert torch.equal(inputs[1], raw[SEQ:2 * SEQ]) and torch.equal(targets[1],
                                                                    raw[SEQ + 1:2 * SEQ + 1])


def quiet(**kwargs) -> TrainConfig:
    return TrainConfig(log_every=0, progress=False, model="transformer", **kwargs)


def params(result) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in result.model.state_dict().items()}


def test_a_run_on_a_token_file_equals_the_same_tokens_in_memory(tmp_path):
    """Bit for bit: the file read by two loader threads three steps ahead, the tensors in
    the step itself."""
    config = quiet(steps=6, global_batch=16, optimizer="adam", lr=3e-3)
    on_file = train(dataclasses.replace(config, dataset=write_tokens(tmp_path / "t.bin"),
                                        data=options(loader_workers=2, prefetch=3)))
    in_ram = train(dataclasses.replace(config, dataset=MEMORY, data=options(loader_workers=0)))
    assert on_file.losses == in_ram.losses
    assert on_file.accuracy == in_ram.accuracy and on_file.eval_loss == in_ram.eval_loss
    got, want = params(on_file), params(in_ram)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def rank_train(comm, config: TrainConfig):
    result = train(config, comm)
    return params(result), result.without_model()


def test_ddp_on_a_token_file_matches_one_process_in_memory(pools, tmp_path):
    """Two ranks, each reading its shard of every global batch from the file."""
    config = quiet(steps=5, global_batch=16, lr=0.1, data=options())
    reference = train(dataclasses.replace(config, dataset=MEMORY))
    per_rank = pools(2).run(rank_train, dataclasses.replace(
        config, strategy="ddp", dataset=write_tokens(tmp_path / "t.bin")))
    want = params(reference)
    for rank, (got, result) in enumerate(per_rank):
        assert result.dp_size == 2 and result.steps == 5
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, r=rank, n=name: f"rank {r} {n}: {m}")
        assert result.final_loss == pytest.approx(reference.final_loss, rel=1e-5)


def test_resume_mid_epoch_continues_exactly(tmp_path):
    """199 training windows, 12 steps of 16 per epoch: stop at step 5 with 3 steps' batches
    read ahead, resume (reading in the step this time: how batches are read is not part of
    the checkpoint) and pass the epoch boundary; the same losses and parameters."""
    dataset = write_tokens(tmp_path / "t.bin")
    base = quiet(dataset=dataset, global_batch=16, optimizer="adam", lr=3e-3, eval_every=0,
                 data=options(loader_workers=2, prefetch=3))
    whole = train(dataclasses.replace(base, steps=16))
    assert whole.steps_per_epoch == 12
    ckpt = str(tmp_path / "ckpt")
    first = train(dataclasses.replace(base, steps=5, checkpoint_dir=ckpt))
    assert first.losses == whole.losses[:5]
    resumed = train(dataclasses.replace(base, steps=16, checkpoint_dir=ckpt, resume=True,
                                        data=options(loader_workers=0)))
    assert resumed.start_step == 5 and resumed.losses == whole.losses[5:]
    got, want = params(resumed), params(whole)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------- unusable files
def _write(path: Path, content: bytes | None) -> None:
    if content is not None:
        path.write_bytes(content)


BAD_FILES = [
    # (id, kind, content (None: no file; "dir": a directory), options, what is wrong)
    ("missing", "tokens", None, {}, "no such file"),
    ("directory", "tokens", "dir", {}, "is a directory"),
    ("empty", "tokens", b"", {}, "the file is empty"),
    ("odd-size", "tokens", b"\x01\x00\x02", {}, "3 bytes is not a whole number of uint16 "
                                                "tokens (2 bytes each)"),
    ("odd-uint32", "tokens", b"\x01\x00" * 3, {"token_dtype": "uint32"},
     "6 bytes is not a whole number of uint32 tokens (4 bytes each)"),
    ("too-short", "tokens", np.arange(2 * SEQ, dtype=np.uint16).tobytes(), {},
     f"{2 * SEQ} tokens are too few for one training and one held-out sample of --seq-len "
     f"{SEQ} (at least {2 * SEQ + 1})"),
    ("beyond-vocab", "tokens", np.array([1, 2, 3, 4, 5, VOCAB] + [0] * 40, np.uint16).tobytes(),
     {}, f"token id {VOCAB} (token 5) is not below the vocabulary size {VOCAB}"),
    ("text-empty", "text", b"", {}, "the file is empty"),
    ("text-binary", "text", b"abc\x00" * 20, {}, "holds NUL bytes (the first at byte 3), so it "
                                                 "is not text"),
    ("text-too-short", "text", b"hi", {}, "2 tokens are too few"),
]


@pytest.mark.parametrize("kind,content,extra,wrong", [c[1:] for c in BAD_FILES],
                         ids=[c[0] for c in BAD_FILES])
def test_an_unusable_file_is_a_one_line_error_naming_it(tmp_path, kind, content, extra, wrong):
    path = tmp_path / "corpus"
    if content == "dir":
        path.mkdir()
    else:
        _write(path, content)
    for build in (build_dataset, check_dataset):  # the loop's, and the CLI's early check
        with pytest.raises(ValueError) as caught:
            build(f"{kind}:{path}", options(**extra))
        message = str(caught.value)
        assert message.startswith(f"{kind} file {path}: ") and wrong in message, message
        assert "\n" not in message


def test_a_dataset_name_without_a_path_is_an_error():
    with pytest.raises(ValueError, match=r"dataset 'tokens:' names no file; write it as "
                                         r"tokens:PATH"):
        build_dataset("tokens:")


def test_an_id_past_the_checked_head_fails_the_batch_that_reads_it(tmp_path, monkeypatch):
    import disttrain.train.token_files as token_files

    tokens = np.zeros(200, dtype=np.uint16)
    tokens[100] = 999
    tokens.tofile(tmp_path / "t.bin")
    monkeypatch.setattr(token_files, "CHECKED_AT_OPEN", 50)
    data = build_dataset(f"tokens:{tmp_path / 't.bin'}", options())  # the head is fine
    fetch(data.train, [0, 1])
    with pytest.raises(ValueError, match=r"t\.bin: token id 999 \(token 100\) is not below "
                                         r"the vocabulary size 24"):
        fetch(data.train, [3, 12])  # sample 12 holds tokens 96..104


def test_the_command_line_refuses_a_bad_file_before_any_rank_starts(tmp_path, capsys,
                                                                    monkeypatch):
    from disttrain.train import spawn

    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(spawn, "run_local", no_ranks)
    (tmp_path / "t.bin").write_bytes(b"\x01\x00\x02")
    assert main(["run", "--strategy", "ddp", "-n", "2", "--model", "transformer",
                 "--dataset", f"tokens:{tmp_path / 't.bin'}", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"disttrain run: error: tokens file {tmp_path / 't.bin'}: 3 bytes is not a "
                   f"whole number of uint16 tokens (2 bytes each); the file is truncated or "
                   f"was written with another --token-dtype")


def test_the_command_line_trains_a_transformer_on_a_text_file(tmp_path, capsys):
    (tmp_path / "c.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    assert main(["run", "--model", "transformer", "--dataset", f"text:{tmp_path / 'c.txt'}",
                 "--seq-len", "16", "--steps", "4", "--global-batch", "8", "--log-every", "0",
                 "--eval-every", "0", "--loader-workers", "2", "--prefetch", "1"]) == 0
    out = capsys.readouterr().out
    assert "result strategy=single world_size=1 global_batch=8 steps=4" in out, out
