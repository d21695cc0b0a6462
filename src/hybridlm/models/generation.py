"""Sampling: penalties, temperature, top-k, nucleus (top-p) and min-p filtering; temperature 0 is greedy.

The filters take one parameter per row (tensors [B]), so a server samples a batch of requests with different
settings in one set of tensor ops. Order as transformers' logits processors: repetition penalty, presence /
frequency penalties, temperature, top-k, top-p, min-p.
"""
import torch
from torch import Tensor

from ..errors import InputError


def penalize(logits: Tensor, seen: Tensor, counts: Tensor, repetition: Tensor, presence: Tensor,
             frequency: Tensor) -> Tensor:
    """logits [B, V] -> penalised float logits [B, V].
    seen [B, V] bool: tokens of the prompt or the output (the repetition penalty's set, as transformers and vLLM:
    a positive logit is divided by `repetition` [B], a negative one multiplied); counts [B, V]: how often each
    token is in the output (OpenAI's penalties: minus `frequency` [B] per occurrence, minus `presence` [B] once)."""
    x = logits.float()
    rep = repetition[:, None]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    return x - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def filter_logits(logits: Tensor, temperature: Tensor, top_k: Tensor | None = None, top_p: Tensor | None = None,
                  min_p: Tensor | None = None) -> Tensor:
    """logits [B, V] -> float logits [B, V] to sample from: divided by temperature [B] (> 0); -inf outside each
    row's top_k [B] (long, 0: off), outside its nucleus top_p [B] (the smallest prefix of the sorted distribution
    reaching top_p; 1: off) and below min_p [B] times its most likely token's probability (0: off)."""
    x = logits.float() / temperature[:, None].float()
    V = x.shape[-1]
    if top_k is not None and bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k, V).clamp(max=V)
        kth = x.sort(-1, descending=True).values.gather(1, (k - 1)[:, None])
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None and bool((top_p < 1).any()):
        sorted_x, order = torch.sort(x, descending=True, dim=-1)
        p = torch.softmax(sorted_x, -1)
        drop = (p.cumsum(-1) - p >= top_p[:, None]) & (top_p < 1)[:, None]   # keep the smallest prefix reaching top_p
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    if min_p is not None and bool((min_p > 0).any()):
        p = torch.softmax(x, -1)
        x = x.masked_fill(p < min_p[:, None] * p.max(-1, keepdim=True).values, float("-inf"))
    return x


def sample_next(logits: Tensor, *, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None) -> Tensor:
    """logits [B, V] -> token ids [B] (one setting for every row)."""
    if temperature < 0:
        raise InputError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return logits.argmax(-1)
    if top_k is not None and top_k < 1:
        raise InputError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise InputError(f"top_p must be in (0, 1], got {top_p}")
    B, dev = logits.shape[0], logits.device
    x = filter_logits(logits, torch.full((B,), temperature, device=dev),
                      top_k=torch.full((B,), top_k or 0, dtype=torch.long, device=dev),
                      top_p=torch.full((B,), top_p if top_p is not None else 1.0, device=dev))
    return torch.multinomial(torch.softmax(x, -1), 1, generator=generator).squeeze(-1)
