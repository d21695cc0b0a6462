"""Held-out loss: the one validation figure that training logs and `hybridlm eval` prints.

    validate(model, val_ids, tokenizer, seq_len=256) -> {"loss", "ppl", "tokens", "whole", "bpb"}
    perplexity(model, "some text", tokenizer, seq_len=256, batch_size=8) -> same keys

The stream is cut into windows of `seq_len` that overlap by one token, so every token after the first is
predicted exactly once with its window's preceding tokens as context; an eos id in the stream starts a new
document (the model's state resets there) unless `doc_mask=False`. A stream predicting at most `max_tokens`
tokens (1M by default) is evaluated whole; a longer one by a fixed, seeded sample of its windows, and the
figure always carries its token count. `bpb` (bits per byte of the text behind the predicted tokens) makes
runs with different tokenizers comparable.

Under data parallelism (`rank`, `world`) each rank evaluates every world-th window and the sums are all-reduced,
so N ranks give the one-rank figure in 1/N of the time. Every rank runs the same number of forwards (a rank short
of windows repeats one, uncounted): a sharded (FSDP) model gathers its parameters in each forward on all ranks.
"""
import contextlib
import itertools
import math

import torch.distributed as dist

import numpy as np
import torch

from ..data.loader import eval_starts, windows_at
from ..errors import InputError

DEFAULT_VAL_TOKENS = 1_000_000


@torch.no_grad()
def evaluate_loss(model, batches, autocast=None, byte_lengths: np.ndarray | None = None) -> dict:
    """Next-token cross-entropy (no auxiliary losses) over (input_ids [B, T], resets [B, T] | None) batches
    -> {"loss": nats per predicted token, "tokens": predicted tokens, "bytes": bytes of their text or None}."""
    total, count, nbytes = _loss_sums(model, ((ids, resets, True) for ids, resets in batches), autocast,
                                      byte_lengths)
    return {"loss": total / max(count, 1), "tokens": count, "bytes": nbytes if byte_lengths is not None else None}


def _loss_sums(model, batches, autocast, byte_lengths) -> tuple[float, int, int]:
    """(summed nats, predicted tokens, their bytes) over (input_ids, resets, counted) batches."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count, nbytes = 0.0, 0, 0
    lengths = None if byte_lengths is None else torch.as_tensor(byte_lengths, dtype=torch.long)
    try:
        for ids, resets, counted in batches:
            with autocast or contextlib.nullcontext():
                loss = model(ids.to(device), labels=ids.to(device), aux_loss_weight=0.0,
                             resets=None if resets is None else resets.to(device)).loss
            if counted:
                n = ids[:, 1:].numel()
                total += loss.item() * n
                count += n
                if lengths is not None:
                    nbytes += int(lengths[ids[:, 1:]].sum())
    finally:
        model.train(was_training)
    return total, count, nbytes


def _num_batches(starts: np.ndarray, n_tokens: int, batch_size: int, seq_len: int) -> int:
    """How many batches `windows_at` makes of these windows: the full ones batched, each cut one alone."""
    full = int((starts + seq_len <= n_tokens).sum())
    cut = int(((starts + seq_len > n_tokens) & (n_tokens - starts >= 2)).sum())
    return -(-full // batch_size) + cut


def validate(model, ids, tokenizer, seq_len: int = 256, batch_size: int = 8,
             max_tokens: int | None = DEFAULT_VAL_TOKENS, seed: int = 0, doc_mask: bool = True,
             autocast=None, rank: int = 0, world: int = 1) -> dict:
    """Validation loss of token ids (1-D array) -> {"loss", "ppl", "tokens", "whole", "bpb"}; see the module doc.
    `max_tokens` None (or 0) evaluates the whole stream whatever its size. With `world` > 1 every rank of the
    default process group calls this with its `rank` and gets the same figure (each evaluates its share)."""
    if len(ids) < 2:
        raise InputError(f"validation needs at least 2 tokens, got {len(ids)}")
    seq_len = min(seq_len, model.config.max_seq_len)
    starts, whole = eval_starts(len(ids), seq_len, max_tokens or None, seed)
    eos = tokenizer.eos_id if doc_mask else None
    lengths = byte_lengths(tokenizer)
    mine = starts[rank::world]
    batches = ((x, r, True) for x, r in windows_at(ids, mine, batch_size, seq_len, eos))
    if world > 1:
        most = max(_num_batches(starts[r::world], len(ids), batch_size, seq_len) for r in range(world))
        idle = next(windows_at(ids, starts[:1], 1, seq_len, eos))        # repeated, uncounted, to keep in step
        pad = most - _num_batches(mine, len(ids), batch_size, seq_len)
        batches = itertools.chain(batches, itertools.repeat((*idle, False), pad))
    total, count, nbytes = _loss_sums(model, batches, autocast, lengths)
    if world > 1:
        sums = torch.tensor([total, count, nbytes], dtype=torch.float64, device=next(model.parameters()).device)
        dist.all_reduce(sums)
        total, count, nbytes = sums[0].item(), int(sums[1].item()), int(sums[2].item())
    loss = total / max(count, 1)
    bpb = loss * count / (math.log(2) * nbytes) if lengths is not None and nbytes else None
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": count, "whole": whole, "bpb": bpb}


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
