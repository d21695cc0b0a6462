"""Held-out loss: the one validation figure that training logs and `hybridlm eval` prints.

    validate(model, val_ids, tokenizer, seq_len=256) -> {"loss", "ppl", "tokens", "whole", "bpb"}
    perplexity(model, "some text", tokenizer, seq_len=256, batch_size=8) -> same keys

The stream is cut into windows of `seq_len` that overlap by one token, so every token after the first is
predicted exactly once with its window's preceding tokens as context; an eos id in the stream starts a new
document (the model's state resets there) unless `doc_mask=False`. A stream predicting at most `max_tokens`
tokens (1M by default) is evaluated whole; a longer one by a fixed, seeded sample of its windows, and the
figure always carries its token count. `bpb` (bits per byte of the text behind the predicted tokens) makes
runs with different tokenizers comparable.
"""
import contextlib
import math

import numpy as np
import torch

from ..data.loader import eval_starts, windows_at
from ..errors import InputError

DEFAULT_VAL_TOKENS = 1_000_000


@torch.no_grad()
def evaluate_loss(model, batches, autocast=None, byte_lengths: np.ndarray | None = None) -> dict:
    """Next-token cross-entropy (no auxiliary losses) over (input_ids [B, T], resets [B, T] | None) batches
    -> {"loss": nats per predicted token, "tokens": predicted tokens, "bytes": bytes of their text or None}."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count, nbytes = 0.0, 0, 0
    lengths = None if byte_lengths is None else torch.as_tensor(byte_lengths, dtype=torch.long)
    try:
        for ids, resets in batches:
            n = ids[:, 1:].numel()
            with autocast or contextlib.nullcontext():
                loss = model(ids.to(device), labels=ids.to(device), aux_loss_weight=0.0,
                             resets=None if resets is None else resets.to(device)).loss
            total += loss.item() * n
            count += n
            if lengths is not None:
                nbytes += int(lengths[ids[:, 1:]].sum())
    finally:
        model.train(was_training)
    return {"loss": total / max(count, 1), "tokens": count, "bytes": nbytes if lengths is not None else None}


def validate(model, ids, tokenizer, seq_len: int = 256, batch_size: int = 8,
             max_tokens: int | None = DEFAULT_VAL_TOKENS, seed: int = 0, doc_mask: bool = True,
             autocast=None) -> dict:
    """Validation loss of token ids (1-D array) -> {"loss", "ppl", "tokens", "whole", "bpb"}; see the module doc.
    `max_tokens` None (or 0) evaluates the whole stream whatever its size."""
    if len(ids) < 2:
        raise InputError(f"validation needs at least 2 tokens, got {len(ids)}")
    seq_len = min(seq_len, model.config.max_seq_len)
    starts, whole = eval_starts(len(ids), seq_len, max_tokens or None, seed)
    eos = tokenizer.eos_id if doc_mask else None
    lengths = byte_lengths(tokenizer)
    r = evaluate_loss(model, windows_at(ids, starts, batch_size, seq_len, eos), autocast, lengths)
    bpb = r["loss"] * r["tokens"] / (math.log(2) * r["bytes"]) if r["bytes"] else None
    return {"loss": r["loss"], "ppl": math.exp(min(r["loss"], 50.0)), "tokens": r["tokens"], "whole": whole,
            "bpb": bpb}


def byte_lengths(tokenizer) -> np.ndarray | None:
    """UTF-8 bytes of text behind each token id [vocab] (special tokens 0), or None if the tokenizer cannot say."""
    fn = getattr(tokenizer, "byte_lengths", None)
    return fn() if fn is not None else None


def describe(r: dict) -> str:
    """'val loss 1.6870 (ppl 5.40, 1.21 bits/byte) on 321,914 tokens (whole split)'."""
    bpb = f", {r['bpb']:.3f} bits/byte" if r.get("bpb") is not None else ""
    cover = "whole split" if r["whole"] else "fixed sample"
    return f"val loss {r['loss']:.4f} (ppl {r['ppl']:.2f}{bpb}) on {r['tokens']:,} tokens ({cover})"


def perplexity(model, ids_or_text, tokenizer, seq_len: int = 256, batch_size: int = 8,
               max_tokens: int | None = None) -> dict:
    """ids_or_text: a str, a list of str (documents), or token ids (list / 1-D array / 1-D tensor); the whole
    stream (or its first `max_tokens` tokens) is evaluated."""
    if isinstance(ids_or_text, str):
        ids_or_text = [ids_or_text]
    if isinstance(ids_or_text, list) and ids_or_text and isinstance(ids_or_text[0], str):
        from ..data.loader import encode_documents
        arr = encode_documents(ids_or_text, tokenizer)
    else:
        arr = np.asarray(ids_or_text.cpu() if isinstance(ids_or_text, torch.Tensor) else ids_or_text, dtype=np.int64)
    if arr.ndim != 1:
        raise InputError(f"expected 1-D token ids, got shape {arr.shape}")
    if max_tokens:
        arr = arr[:max_tokens]
    if len(arr) < 2:
        raise InputError("perplexity needs at least 2 tokens")
    return validate(model, arr, tokenizer, seq_len, batch_size, max_tokens=None)
