"""Tokenizers: bytes (the default, nothing to train) and byte-level BPE over Hugging Face `tokenizers`.

Both expose `vocab_size`, `eos_id` (the document separator), `encode(str) -> list[int]`,
`decode(ids) -> str`, `save(dir)` and `to_dict()`; `tokenizer_from_dir(dir)` restores what `save` wrote,
so a checkpoint carries its tokenizer.

    load_tokenizer("byte")                      # 256 byte ids + eos 256
    load_tokenizer("bpe:4096", texts=docs)      # train a BPE of 4096 ids on `docs`
    load_tokenizer("path/to/tokenizer.json")    # or a directory holding one
"""
import json
import os
from typing import Iterable

import numpy as np

from ..errors import InputError

CONFIG_FILE = "tokenizer_config.json"
BPE_FILE = "tokenizer.json"
EOS_TOKEN = "<|endoftext|>"


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus one end-of-document id 256 (vocab_size 257)."""

    kind = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def byte_lengths(self) -> np.ndarray:
        """UTF-8 bytes behind each id [vocab]: 1, and 0 for eos."""
        out = np.ones(self.vocab_size, dtype=np.int64)
        out[self.eos_id] = 0
        return out

    def to_dict(self) -> dict:
        return {"type": "byte", "vocab_size": self.vocab_size, "eos_id": self.eos_id}

    def save(self, directory: str):
        _write_json(os.path.join(directory, CONFIG_FILE), self.to_dict())


class BPETokenizer:
    """Byte-level BPE (GPT-2 style) with `<|endoftext|>` as the document separator."""

    kind = "bpe"

    def __init__(self, tok):
        self.tok = tok
        eos = tok.token_to_id(EOS_TOKEN)
        if eos is None:
            raise InputError(f"BPE tokenizer has no {EOS_TOKEN!r} token")
        self.eos_id = eos
        self.vocab_size = tok.get_vocab_size()

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "BPETokenizer":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        if vocab_size < 257 + 1:
            raise InputError(f"BPE vocab_size must be > 257 (256 bytes + eos), got {vocab_size}")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def from_file(cls, path: str) -> "BPETokenizer":
        from tokenizers import Tokenizer
        try:
            return cls(Tokenizer.from_file(path))
        except Exception as e:  # the Rust side raises plain Exceptions
            raise InputError(f"cannot load tokenizer {path}: {e}") from None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def byte_lengths(self) -> np.ndarray | None:
        """UTF-8 bytes behind each id [vocab] (special tokens 0); None unless the vocabulary is byte-level
        (each character of a token stands for one byte, GPT-2's byte-to-unicode map)."""
        from tokenizers import pre_tokenizers
        alphabet = set(pre_tokenizers.ByteLevel.alphabet())
        special = set(self.tok.get_added_tokens_decoder())
        out = np.zeros(self.vocab_size, dtype=np.int64)
        for token, i in self.tok.get_vocab(with_added_tokens=False).items():
            if i in special:
                continue
            if not set(token) <= alphabet:
                return None
            out[i] = len(token)
        return out

    def to_dict(self) -> dict:
        return {"type": "bpe", "vocab_size": self.vocab_size, "eos_id": self.eos_id, "file": BPE_FILE}

    def save(self, directory: str):
        self.tok.save(os.path.join(directory, BPE_FILE))
        _write_json(os.path.join(directory, CONFIG_FILE), self.to_dict())


def _write_json(path: str, obj: dict):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def tokenizer_from_dir(directory: str):
    """Restore the tokenizer that `save(directory)` wrote."""
    cfg_path = os.path.join(directory, CONFIG_FILE)
    if not os.path.exists(cfg_path):
        if os.path.exists(os.path.join(directory, BPE_FILE)):
            return BPETokenizer.from_file(os.path.join(directory, BPE_FILE))
        raise InputError(f"no tokenizer in {directory} (missing {CONFIG_FILE})")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"{cfg_path}: {e}") from None
    kind = cfg.get("type")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        return BPETokenizer.from_file(os.path.join(directory, cfg.get("file", BPE_FILE)))
    raise InputError(f"{cfg_path}: unknown tokenizer type {kind!r}")


def load_tokenizer(spec: str = "byte", texts: Iterable[str] | None = None):
    """"byte" | "bpe:N" (trained on `texts`) | a tokenizer.json file | a directory saved by `save`."""
    if spec == "byte":
        return ByteTokenizer()
    if spec.startswith("bpe:"):
        try:
            n = int(spec[4:])
        except ValueError:
            raise InputError(f"bad tokenizer spec {spec!r}: expected bpe:<vocab size>, e.g. bpe:4096") from None
        if texts is None:
            raise InputError("training a BPE tokenizer needs texts")
        return BPETokenizer.train(texts, n)
    if os.path.isdir(spec):
        return tokenizer_from_dir(spec)
    if os.path.isfile(spec):
        return BPETokenizer.from_file(spec)
    raise InputError(f"tokenizer {spec!r} is not 'byte', 'bpe:N', nor an existing file or directory")
