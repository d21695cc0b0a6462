"""Prepared token shards: a corpus tokenised once into memory-mapped files, read lazily by training.

    DIR/meta.json                       format, version, tokenizer spec, dtype, vocab, eos, shards per split
    DIR/tokenizer_config.json           the tokenizer (+ tokenizer.json for BPE), as a checkpoint holds it
    DIR/train-00000.bin (+ .bin.json)   raw ids in `token_files` format; documents end with the eos id
    DIR/val-00000.bin   (+ .bin.json)

A split is one stream: its shards concatenated in order (a document may cross a shard boundary).
`open_shards(DIR)` gives a `TokenData` whose splits are `ShardStream`s: they index like a NumPy array but
read only the windows asked for, so a corpus larger than memory trains. `meta.json` is written last: a
directory without it is an interrupted `data prepare` and is refused.
"""
import json
import os

import numpy as np

from ..errors import InputError
from .token_files import read_json_object, read_token_file, write_token_file

META_FILE = "meta.json"
FORMAT, VERSION = "hybridlm-shards", 1
SPLITS = ("train", "val")


def shard_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def is_shard_dir(path: str | None) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, META_FILE))


class ShardStream:
    """Several 1-D memory maps read as one: `len`, `s[i]`, `s[a:b]` and `s[index_array]` like an ndarray."""

    def __init__(self, shards: list[np.ndarray]):
        self.shards = [s for s in shards if len(s)]
        self.ends = np.cumsum([len(s) for s in self.shards], dtype=np.int64)
        self.starts = self.ends - [len(s) for s in self.shards]
        self.dtype = self.shards[0].dtype if self.shards else np.dtype(np.uint16)

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __getitem__(self, key):
        if isinstance(key, slice):
            a, b, step = key.indices(len(self))
            if step != 1:
                raise IndexError("ShardStream slices take step 1")
            first = int(np.searchsorted(self.ends, a, side="right"))
            parts = []
            for i in range(first, len(self.shards)):
                if self.starts[i] >= b:
                    break
                lo, hi = max(a, self.starts[i]) - self.starts[i], min(b, self.ends[i]) - self.starts[i]
                parts.append(np.asarray(self.shards[i][lo:hi]))
            return np.concatenate(parts) if parts else np.zeros(0, self.dtype)
        idx = np.asarray(key, dtype=np.int64)
        if idx.size and (idx.min() < -len(self) or idx.max() >= len(self)):
            raise IndexError(f"index out of range for a stream of {len(self)} tokens")
        flat = np.where(idx < 0, idx + len(self), idx).ravel()
        which = np.searchsorted(self.ends, flat, side="right")
        out = np.empty(flat.shape, self.dtype)
        for i in np.unique(which):
            hit = which == i
            out[hit] = self.shards[i][flat[hit] - self.starts[i]]
        return out.reshape(idx.shape) if idx.ndim else out[0]


class ShardWriter:
    """Appends token arrays to `DIR/{split}-NNNNN.bin`, starting a new shard every `shard_tokens` ids."""

    def __init__(self, directory: str, split: str, dtype: np.dtype, shard_tokens: int, meta: dict):
        self.directory, self.split, self.dtype = directory, split, dtype
        self.shard_tokens, self.meta = shard_tokens, meta
        self.pending: list[np.ndarray] = []
        self.n_pending = 0
        self.shards: list[dict] = []
        self.documents = 0

    def add(self, ids: np.ndarray, documents: int):
        self.documents += documents
        while len(ids):
            take = min(len(ids), self.shard_tokens - self.n_pending)
            self.pending.append(ids[:take])
            self.n_pending += take
            ids = ids[take:]
            if self.n_pending == self.shard_tokens:
                self.flush()

    def flush(self):
        if not self.n_pending:
            return
        name = f"{self.split}-{len(self.shards):05d}.bin"
        write_token_file(os.path.join(self.directory, name), np.concatenate(self.pending).astype(self.dtype), self.meta)
        self.shards.append({"file": name, "tokens": self.n_pending})
        self.pending, self.n_pending = [], 0

    def summary(self) -> dict:
        self.flush()
        return {"shards": self.shards, "tokens": sum(s["tokens"] for s in self.shards), "documents": self.documents}


def write_meta(directory: str, meta: dict):
    tmp = os.path.join(directory, META_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, "version": VERSION, **meta}, f, indent=2)
    os.replace(tmp, os.path.join(directory, META_FILE))


def read_meta(directory: str) -> dict:
    path = os.path.join(directory, META_FILE)
    if not os.path.isfile(path):
        raise InputError(f"{directory} holds no {META_FILE}: not a prepared dataset (or `data prepare` was "
                         f"interrupted)")
    meta = read_json_object(path)
    if meta.get("format") != FORMAT:
        raise InputError(f"{path}: not a {FORMAT} file")
    if meta.get("version") != VERSION:
        raise InputError(f"{path}: format version {meta.get('version')} (this hybridlm reads {VERSION})")
    return meta


def open_shards(directory: str, tokenizer=None):
    """A prepared directory -> `TokenData` of lazy `ShardStream`s and the tokenizer saved there (or `tokenizer`,
    e.g. a resumed checkpoint's, which must agree with it)."""
    from .loader import TokenData
    from .tokenizer import tokenizer_from_dir
    meta = read_meta(directory)
    saved = tokenizer_from_dir(directory)
    if tokenizer is not None and (tokenizer.vocab_size, tokenizer.eos_id) != (saved.vocab_size, saved.eos_id):
        raise InputError(f"{directory} was tokenised with vocab {saved.vocab_size} / eos {saved.eos_id}, the model "
                         f"uses vocab {tokenizer.vocab_size} / eos {tokenizer.eos_id}")
    splits = {}
    for split in SPLITS:
        entry = meta.get("splits", {}).get(split)
        if not entry or not entry.get("tokens"):
            raise InputError(f"{directory}: the {split} split is empty")
        arrays = []
        for shard in entry["shards"]:
            arr, _ = read_token_file(os.path.join(directory, shard["file"]))
            if len(arr) != shard["tokens"]:
                raise InputError(f"{directory}/{shard['file']}: holds {len(arr):,} ids, {META_FILE} says "
                                 f"{shard['tokens']:,}")
            arrays.append(arr)
        splits[split] = ShardStream(arrays)
    return TokenData(splits["train"], splits["val"], tokenizer or saved, source=directory)
