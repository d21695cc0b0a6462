"""Token streams for training: documents tokenised once into one flat array per split, with the
tokenizer's eos id after every document, then cut into windows.

    data = TokenData.from_corpus(corpus, tokenizer)
    ids, resets = data.get_batch("train", 8, 256, batch_generator(seed, step))   # [8, 256] each
    for ids, resets in data.sequential("val", 8, 256): ...

`resets[b, t]` is True where a document starts (the token after an eos), so the model restarts its
recurrent state and attention there. Random windows depend only on the generator, so seeding it from
(seed, step, micro-batch, rank) makes a resumed run see exactly the batches of an uninterrupted one and
gives each DDP rank disjoint draws.
"""
import os
from typing import Iterator

import numpy as np
import torch
from torch import Tensor

from ..errors import InputError


def encode_documents(docs: list[str], tokenizer) -> np.ndarray:
    """docs -> flat array `doc0 eos doc1 eos ...` (uint16 when the vocabulary fits, else int32)."""
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.int32
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    if getattr(tokenizer, "kind", None) == "byte":  # fast path: bytes are ids
        parts = [np.frombuffer(d.encode("utf-8"), dtype=np.uint8).astype(dtype) for d in docs]
    elif hasattr(tokenizer, "encode_batch"):
        parts = [np.asarray(ids, dtype=dtype) for ids in tokenizer.encode_batch(docs)]
    else:
        parts = [np.asarray(tokenizer.encode(d), dtype=dtype) for d in docs]
    out = []
    for p in parts:
        out += [p, eos]
    return np.concatenate(out) if out else np.zeros(0, dtype=dtype)


def batch_generator(seed: int, step: int, micro: int = 0, rank: int = 0) -> torch.Generator:
    """A generator seeded only by (seed, step, micro-batch, rank): batches are reproducible on resume."""
    key = ((seed * 1_000_003 + step) * 1_009 + micro) * 8_191 + rank
    return torch.Generator().manual_seed(key % (2 ** 63))


def _resets(arr: np.ndarray, starts: np.ndarray, T: int, eos: int) -> np.ndarray:
    """[B, T] bool: True where the previous token of the stream is eos (or at the stream start)."""
    idx = starts[:, None] + np.arange(T)
    prev = np.asarray(arr[np.maximum(idx - 1, 0)]) == eos
    prev[idx == 0] = True
    return prev


class TokenData:
    """Tokenised train/val streams plus the tokenizer that made them."""

    def __init__(self, train: np.ndarray, val: np.ndarray, tokenizer, source: str = ""):
        self.splits = {"train": train, "val": val}
        self.tokenizer = tokenizer
        self.source = source
        self.spec = {"data": source or None, "max_bytes": None}   # how to load it again (load_data sets it)

    @classmethod
    def from_corpus(cls, corpus, tokenizer) -> "TokenData":
        return cls(encode_documents(corpus.train, tokenizer), encode_documents(corpus.val, tokenizer), tokenizer,
                   corpus.source)

    @classmethod
    def from_token_files(cls, path: str, tokenizer) -> "TokenData":
        """Token ids from `path` (see data/token_files.py), memory-mapped; ids must fit the tokenizer."""
        from .token_files import check_ids, load_token_splits
        train, val, meta = load_token_splits(path, tokenizer.eos_id)
        if meta.get("eos_id") is not None and int(meta["eos_id"]) != tokenizer.eos_id:
            raise InputError(f"{path}: its documents end with id {meta['eos_id']} but the tokenizer's eos id is "
                             f"{tokenizer.eos_id} (pass the tokenizer that made the file with --tokenizer)")
        for name, arr in (("train", train), ("val", val)):
            check_ids(arr, tokenizer.vocab_size, f"{path} ({name} split, tokenizer vocab {tokenizer.vocab_size})")
        return cls(train, val, tokenizer, path)

    def tokens(self, split: str) -> np.ndarray:
        if split not in self.splits:
            raise InputError(f"unknown split {split!r} (train | val)")
        return self.splits[split]

    def get_batch(self, split: str, batch_size: int, seq_len: int,
                  generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """Random windows: input_ids [B, T] long, resets [B, T] bool."""
        arr = self.tokens(split)
        if len(arr) < seq_len + 1:
            raise InputError(f"the {split} split has {len(arr)} tokens; seq_len {seq_len} needs at least "
                             f"{seq_len + 1} (use more data or a shorter --seq-len)")
        starts = torch.randint(0, len(arr) - seq_len + 1, (batch_size,), generator=generator).numpy()
        idx = starts[:, None] + np.arange(seq_len)
        ids = torch.from_numpy(np.asarray(arr[idx]).astype(np.int64))
        return ids, torch.from_numpy(_resets(arr, starts, seq_len, self.tokenizer.eos_id))

    def sequential(self, split: str, batch_size: int, seq_len: int, max_batches: int | None = None,
                   ) -> Iterator[tuple[Tensor, Tensor]]:
        """Windows covering the split in order, each overlapping the previous by one token so every
        token after the first is predicted exactly once. The last batch may be smaller or shorter."""
        yield from sequential_windows(self.tokens(split), batch_size, seq_len, self.tokenizer.eos_id, max_batches)


def eval_starts(n_tokens: int, seq_len: int, max_tokens: int | None = None, seed: int = 0) -> tuple[np.ndarray, bool]:
    """Start offsets of evaluation windows over a stream of `n_tokens`, and whether they cover all of it.

    Windows start every `seq_len - 1` tokens, overlapping by one, so each token after the first is predicted
    once. When the stream predicts more than `max_tokens` tokens, a fixed sample of those windows (seeded, in
    stream order) predicting about `max_tokens` tokens is taken instead; the short tail window goes with the
    whole-stream case only."""
    if seq_len < 2:
        raise InputError(f"seq_len must be >= 2, got {seq_len}")
    stride = seq_len - 1
    n_full = max(0, (n_tokens - 1) // stride)
    starts = np.arange(n_full) * stride
    if max_tokens is None or n_tokens - 1 <= max_tokens:
        tail = n_full * stride
        return (np.append(starts, tail) if n_tokens - tail >= 2 else starts), True
    k = max(1, min(n_full, max_tokens // stride))
    return np.sort(np.random.default_rng(seed).choice(n_full, size=k, replace=False)) * stride, False


def windows_at(arr: np.ndarray, starts: np.ndarray, batch_size: int, seq_len: int, eos: int | None,
               ) -> Iterator[tuple[Tensor, Tensor | None]]:
    """(input_ids [b, t], resets [b, t] or None when eos is None) for windows of `seq_len` tokens at `starts`
    (a window running past the end is cut there and yielded alone)."""
    full = starts[starts + seq_len <= len(arr)]
    for i in range(0, len(full), batch_size):
        s = full[i: i + batch_size]
        ids = torch.from_numpy(np.asarray(arr[s[:, None] + np.arange(seq_len)]).astype(np.int64))
        yield ids, (None if eos is None else torch.from_numpy(_resets(arr, s, seq_len, eos)))
    for s in starts[starts + seq_len > len(arr)]:
        t = len(arr) - int(s)
        if t >= 2:
            ids = torch.from_numpy(np.asarray(arr[s:]).astype(np.int64))[None]
            yield ids, (None if eos is None else torch.from_numpy(_resets(arr, np.array([s]), t, eos)))


def sequential_windows(arr: np.ndarray, batch_size: int, seq_len: int, eos: int | None,
                       max_batches: int | None = None) -> Iterator[tuple[Tensor, Tensor | None]]:
    """Windows covering the whole stream in order (see `eval_starts`); at most `max_batches` batches."""
    starts, _ = eval_starts(len(arr), seq_len)
    for n, batch in enumerate(windows_at(arr, starts, batch_size, seq_len, eos)):
        if max_batches is not None and n >= max_batches:
            return
        yield batch


def load_data(path: str | None, tokenizer=None, max_bytes: int | None = None) -> TokenData:
    """Training data from `path`: text (None = the built-in corpus; a file, folder, .jsonl or .parquet; see
    data/corpus.py) or token ids (.npy, .bin + sidecar, or a folder with train/val token files; see
    data/token_files.py). `tokenizer` is a tokenizer object or a `load_tokenizer` spec; None means bytes for
    text and, for token files, the tokenizer their sidecar names (else bytes). `data.spec` records how to load the same data again."""
    from .corpus import load_corpus
    from .token_files import is_token_path, read_token_file
    from .tokenizer import load_tokenizer
    spec = {"data": path, "max_bytes": max_bytes}
    if path is not None and os.path.exists(path) and is_token_path(path):
        if isinstance(tokenizer, str) and tokenizer.startswith("bpe:"):
            raise InputError(f"{path} holds token ids already: a BPE cannot be trained on it (pass the "
                             f"tokenizer that made it with --tokenizer)")
        if tokenizer is None:
            first = path if not os.path.isdir(path) else next(
                os.path.join(path, f) for f in ("train.npy", "train.bin") if os.path.exists(os.path.join(path, f)))
            tokenizer = read_token_file(first)[1].get("tokenizer") or "byte"
        if isinstance(tokenizer, str):
            tokenizer = load_tokenizer(tokenizer)
        data = TokenData.from_token_files(path, tokenizer)
    else:
        corpus = load_corpus(path, max_bytes=max_bytes)
        tok = tokenizer if not isinstance(tokenizer, (str, type(None))) else \
            load_tokenizer(tokenizer or "byte", texts=corpus.train)
        data = TokenData.from_corpus(corpus, tok)
    data.spec = spec
    return data
