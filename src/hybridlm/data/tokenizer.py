"""Tokenizers: bytes (the default, nothing to train) and byte-level BPE over Hugging Face `tokenizers`.

Both expose `vocab_size`, `eos_id` (the document separator), `encode(str) -> list[int]`,
`decode(ids) -> str`, `save(dir)` and `to_dict()`; `tokenizer_from_dir(dir)` restores what `save` wrote,
so a checkpoint carries its tokenizer. `save` writes what transformers reads too: tokenizer.json (the byte
tokenizer as an equivalent merge-free byte-level BPE) and a tokenizer_config.json naming `PreTrainedTokenizerFast`
and the special tokens, with our own description under its "hybridlm" key, so `AutoTokenizer.from_pretrained(dir)`
loads a run's tokenizer; `tokenizer_from_dir` also reads a transformers tokenizer directory (tokenizer.json).

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


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in character for each byte 0..255 (the alphabet of the ByteLevel pre-tokenizer)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _hf_config(tok) -> dict:
    """tokenizer_config.json: what transformers' AutoTokenizer needs, plus ours under "hybridlm"."""
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.eos_token, "pad_token": tok.eos_token,
           "clean_up_tokenization_spaces": False, "hybridlm": tok.to_dict()}
    return cfg | ({"chat_template": tok.chat_template} if getattr(tok, "chat_template", None) else {})


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus one end-of-document id 256 (vocab_size 257)."""

    kind = "byte"
    vocab_size = 257
    eos_id = 256
    eos_token = EOS_TOKEN

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

    @staticmethod
    def backend():
        """The same tokenizer as a `tokenizers.Tokenizer`: a byte-level BPE with no merges whose vocabulary maps each
        byte's stand-in character to the byte's value, and `<|endoftext|>` = 256; it encodes any text to its UTF-8
        bytes and decodes them back exactly."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
        tok = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(_byte_chars())}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False)])
        return tok

    def save(self, directory: str):
        self.backend().save(os.path.join(directory, BPE_FILE))
        _write_json(os.path.join(directory, CONFIG_FILE), _hf_config(self))


class BPETokenizer:
    """Byte-level BPE (GPT-2 style) with `<|endoftext|>` (or a transformers tokenizer's `eos_token`) as the document
    separator."""

    kind = "bpe"

    def __init__(self, tok, eos_token: str = EOS_TOKEN, chat_template: str | None = None):
        self.tok = tok
        eos = tok.token_to_id(eos_token)
        if eos is None:
            raise InputError(f"BPE tokenizer has no {eos_token!r} token")
        self.eos_id, self.eos_token, self.chat_template = eos, eos_token, chat_template   # jinja, for chat models
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
    def from_file(cls, path: str, eos_token: str = EOS_TOKEN, chat_template: str | None = None) -> "BPETokenizer":
        from tokenizers import Tokenizer
        try:
            tok = Tokenizer.from_file(path)
        except Exception as e:  # the Rust side raises plain Exceptions
            raise InputError(f"cannot load tokenizer {path}: {e}") from None
        try:
            return cls(tok, eos_token, chat_template)
        except InputError as e:
            raise InputError(f"{path}: {e}") from None

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
        _write_json(os.path.join(directory, CONFIG_FILE), _hf_config(self))


def apply_chat_template(tok, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The prompt text of `messages` ([{"role": ..., "content": ...}]) ending where the assistant speaks, rendered
    from the tokenizer's jinja chat template by transformers' renderer; `tools` (OpenAI function definitions) are
    handed to the template as transformers' `apply_chat_template(tools=...)` hands them."""
    template = getattr(tok, "chat_template", None)
    if not template:
        raise InputError("this tokenizer has no chat template (none in its tokenizer_config.json)")
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
        rendered, _ = render_jinja_template([messages], tools=tools or None, chat_template=template,
                                            add_generation_prompt=True, eos_token=tok.eos_token)
    except ImportError:  # transformers, or the jinja2 it renders with, is missing
        raise InputError("chat templates are rendered by transformers with jinja2: pip install 'hybridlm[hf]' jinja2") \
            from None
    return rendered[0]


def _chat_template(directory: str, cfg: dict) -> str | None:
    """tokenizer_config.json's chat_template (the default one of a named list), else chat_template.jinja's text."""
    template = cfg.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    jinja = os.path.join(directory, "chat_template.jinja")
    if template is None and os.path.exists(jinja):
        with open(jinja) as f:
            template = f.read()
    return template


def _write_json(path: str, obj: dict):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def tokenizer_from_dir(directory: str):
    """Restore the tokenizer that `save(directory)` wrote, or load a transformers tokenizer directory's tokenizer.json
    (its tokenizer_config.json's `eos_token` is the document separator)."""
    cfg_path, bpe_path = os.path.join(directory, CONFIG_FILE), os.path.join(directory, BPE_FILE)
    cfg = {}
    if os.path.exists(cfg_path):
        try:
            with open(cfg_path) as f:
                cfg = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise InputError(f"{cfg_path}: {e}") from None
    elif not os.path.exists(bpe_path):
        raise InputError(f"no tokenizer in {directory} (missing {CONFIG_FILE} and {BPE_FILE})")
    ours = cfg.get("hybridlm", cfg if "type" in cfg else None)   # checkpoints before the transformers keys: top level
    eos = cfg.get("eos_token") or EOS_TOKEN
    eos = eos["content"] if isinstance(eos, dict) else eos
    if ours is None:                                              # a transformers tokenizer directory
        if not os.path.exists(bpe_path):
            raise InputError(f"{directory}: no {BPE_FILE} (only fast tokenizers saved as tokenizer.json are supported)")
        return BPETokenizer.from_file(bpe_path, eos, _chat_template(directory, cfg))
    kind = ours.get("type")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        return BPETokenizer.from_file(os.path.join(directory, ours.get("file", BPE_FILE)), eos,
                                      _chat_template(directory, cfg))
    raise InputError(f"{cfg_path}: unknown tokenizer type {kind!r}")


def check_fits(tok, vocab_size: int, source: str):
    """One clear error when tokenizer `source` emits ids the model (of `vocab_size` ids) has no embedding for."""
    if tok.vocab_size > vocab_size:
        raise InputError(f"tokenizer {source} has {tok.vocab_size} ids but the model's vocab_size is {vocab_size}")


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
