"""Language-model datasets read from a user's files: token ids, memory-mapped, or plain text.

    --dataset tokens:data/train.bin --vocab-size 50304 --seq-len 256   # uint16 ids
    --dataset tokens:data/train.bin --token-dtype uint32 ...            # 4-byte ids
    --dataset text:corpus.txt --seq-len 128                             # bytes: 256 tokens

A ``tokens`` file is what nanoGPT-style trainers write: the token ids of the whole corpus,
one after another, as little-endian ``uint16`` (``uint32`` for vocabularies beyond 65,536),
with no header. A ``text`` file is read the same way one byte at a time: byte-level tokens,
vocabulary 256, whatever the encoding. Either is one stream of L tokens, cut into
N = (L - 1) // T samples of T = ``seq_len`` tokens whose targets are the next T tokens::

    stream     t0 t1 t2 t3 t4 t5 t6 t7 t8 t9 ...            (T = 4)
    sample 0   inputs t0 t1 t2 t3   targets t1 t2 t3 t4
    sample 1   inputs t4 t5 t6 t7   targets t5 t6 t7 t8
    sample i   the window of T + 1 tokens at i·T: inputs its first T, targets its last T

The last ``test_fraction`` of the samples (a contiguous tail, as a validation file cut from
the corpus's end) is the held-out split, so no training target is ever a held-out target.
The task is ``"lm"`` (like ``synthetic-lm``): ``--model transformer`` trains on it.

The file is opened with ``numpy.memmap`` and never read whole: a batch gathers its windows,
which reads only their pages; the map is reopened, not pickled, in another process. A file
that cannot be used is a one-line ``ValueError`` naming it and what is wrong: missing,
empty, a size that is not a whole number of tokens, too short for one training and one
held-out sample, a ``text`` file with NUL bytes (token ids, not text), or an id beyond the
vocabulary (checked over the first :data:`CHECKED_AT_OPEN` tokens when the dataset is
built, and in every batch as it is read).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

FILE_KINDS = ("tokens", "text")  # the dataset names that take a path: "tokens:PATH"
TOKEN_DTYPES = ("uint16", "uint32")
TEXT_VOCAB = 256
CHECKED_AT_OPEN = 1 << 27  # tokens whose ids are checked when the dataset is built
TEXT_SNIFF_BYTES = 1 << 16  # a NUL byte this early means the file is not text
_CHUNK = 1 << 24  # tokens per read while checking ids


def file_spec(name: str) -> tuple[str, str] | None:
    """``"tokens:PATH"`` → ``("tokens", PATH)``, likewise ``text:``; None for other names."""
    kind, sep, path = name.partition(":")
    if not sep or kind not in FILE_KINDS:
        return None
    if not path:
        raise ValueError(f"dataset {name!r} names no file; write it as {kind}:PATH")
    return kind, os.path.expanduser(path)


class TokenFile:
    """One file of token ids, memory-mapped on first use in each process."""

    def __init__(self, path: str, dtype: str, length: int, vocab: int, what: str) -> None:
        self.path, self.dtype, self.length, self.vocab = path, dtype, length, vocab
        self.what = what  # "tokens file PATH" or "text file PATH", for errors
        self._map: np.memmap[Any, Any] | None = None
        self._lock = threading.Lock()

    def tokens(self) -> np.memmap[Any, Any]:
        """The whole file as a read-only array (mapped, not read)."""
        if self._map is None:
            with self._lock:  # loader threads may ask at once
                if self._map is None:
                    self._map = np.memmap(self.path, dtype=np.dtype(self.dtype).newbyteorder(
                        "<"), mode="r", shape=(self.length,))
        return self._map

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_map"], state["_lock"] = None, None  # a map is reopened, not pickled
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def check_ids(self, ids: np.ndarray[Any, Any], positions: np.ndarray[Any, Any]) -> None:
        """Every id in ``ids`` (read at token ``positions``) is below the vocabulary."""
        if ids.size and int(ids.max()) >= self.vocab:
            at = int(np.argmax(ids >= self.vocab))
            self._bad_id(int(ids.flat[at]), int(positions.flat[at]))

    def _bad_id(self, token: int, position: int) -> None:
        raise ValueError(f"{self.what}: token id {token} (token {position}) is not below the "
                         f"vocabulary size {self.vocab}; give the tokenizer's vocabulary with "
                         f"--vocab-size (DataOptions.vocab_size) and check that --token-dtype "
                         f"({self.dtype}) is how the file was written")

    def check_head(self) -> None:
        """Check the ids of the first :data:`CHECKED_AT_OPEN` tokens, a chunk at a time."""
        tokens, end = self.tokens(), min(self.length, CHECKED_AT_OPEN)
        for start in range(0, end, _CHUNK):
            chunk = np.asarray(tokens[start:min(start + _CHUNK, end)])
            if int(chunk.max()) >= self.vocab:
                at = int(np.argmax(chunk >= self.vocab))
                self._bad_id(int(chunk[at]), start + at)


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Samples ``first .. first + count - 1`` of a token file: ``(inputs, targets)``, each
    ``seq_len`` int64 token ids, the targets one token ahead."""

    def __init__(self, source: TokenFile, first: int, count: int, seq_len: int) -> None:
        self.source, self.first, self.count, self.seq_len = source, first, count, seq_len

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.get_batch([index])
        return inputs[0], targets[0]

    def get_batch(self, indices: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples at ``indices`` as ``(inputs (B, T), targets (B, T))``, read at once."""
        index = np.asarray(torch.as_tensor(indices, dtype=torch.long).numpy())
        if index.size and (index.min() < 0 or index.max() >= self.count):
            raise IndexError(f"{self.source.what}: sample index out of range [0, {self.count})")
        starts = (index + self.first) * self.seq_len
        positions = starts[:, None] + np.arange(self.seq_len + 1)
        windows = self.source.tokens()[positions]  # gathers only these tokens' pages
        self.source.check_ids(windows, positions)
        tokens = torch.from_numpy(windows.astype(np.int64))
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def open_token_file(kind: str, path: str, dtype: str, vocab_size: int,
                    seq_len: int) -> TokenFile:
    """The checked file behind ``kind:path`` (see the module docstring for the checks)."""
    what = f"{kind} file {path}"
    if kind == "tokens" and dtype not in TOKEN_DTYPES:
        raise ValueError(f"token_dtype must be one of {', '.join(TOKEN_DTYPES)}, got {dtype!r}")
    dtype = dtype if kind == "tokens" else "uint8"
    try:
        size = os.stat(path).st_size
        if os.path.isdir(path):
            raise ValueError(f"{what}: is a directory; name the file itself")
        with open(path, "rb") as handle:
            head = handle.read(TEXT_SNIFF_BYTES)
    except FileNotFoundError:
        raise ValueError(f"{what}: no such file") from None
    except OSError as exc:
        raise ValueError(f"{what}: cannot read it ({exc.strerror or exc})") from None
    if size == 0:
        raise ValueError(f"{what}: the file is empty")
    width = np.dtype(dtype).itemsize
    if size % width:
        raise ValueError(f"{what}: {size} bytes is not a whole number of {dtype} tokens "
                         f"({width} bytes each); the file is truncated or was written with "
                         f"another --token-dtype")
    if kind == "text" and b"\0" in head:
        raise ValueError(f"{what}: holds NUL bytes (the first at byte {head.index(0)}), so it "
                         f"is not text; for a file of token ids use tokens:{path}")
    length, needed = size // width, 2 * seq_len + 1
    if length < needed:
        raise ValueError(f"{what}: {length} tokens are too few for one training and one "
                         f"held-out sample of --seq-len {seq_len} (at least {needed}); use a "
                         f"longer file or a smaller --seq-len")
    vocab = TEXT_VOCAB if kind == "text" else vocab_size
    source = TokenFile(path, dtype, length, vocab, what)
    if kind == "tokens":
        source.check_head()
    return source


def token_splits(source: TokenFile, seq_len: int,
                 test_fraction: float) -> tuple[TokenWindows, TokenWindows]:
    """The training windows and the held-out tail (at least one sample each)."""
    samples = (source.length - 1) // seq_len
    n_test = min(max(1, round(samples * test_fraction)), samples - 1)
    n_train = samples - n_test
    return (TokenWindows(source, 0, n_train, seq_len),
            TokenWindows(source, n_train, n_test, seq_len))
