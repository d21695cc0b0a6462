"""The lightning indexer's training loss (DeepSeek-V3.2-Exp report; layers/indexer.py):

    p[t, :]  = the main attention's probabilities summed over heads, L1-normalised over keys (= their head mean)
    loss     = mean over queries t of KL(p[t, :] || softmax(I[t, :]))

over the keys a query may see: all of them in the dense warm-up, the indexer's top-k in the sparse stage (there
the main attention itself only sees those, so p is zero elsewhere). A mean over queries, not the report's sum,
so the loss does not grow with the batch or the context.

attention_target     p from the attention's own q [B, T, Hq, D] and k [B, S, Hk, D] under `ops.attention`'s mask
                     vocabulary, without gradient, a chunk of queries at a time: only [B, Hq, chunk, S] scores exist
                     at once (the layer already holds [B, T, S] index scores).  Reference: attention_target_ref.
indexer_kl           the KL, with keys outside the selection (-inf index scores) left out.  Reference: indexer_kl_ref.
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import attention_mask

CHUNK_ELEMENTS = 1 << 22     # scores per query chunk of attention_target: 16 MiB of float32


def _masked_scores(q: Tensor, k: Tensor, mask: Tensor | None, bias: Tensor | None, scale: float | None) -> Tensor:
    """softmax logits [B, Hq, T, S] in float32 with -inf where hidden; kv head g serves query heads g·rep ... ."""
    B, T, Hq, D = q.shape
    Hk = k.shape[2]
    qg = q.float().reshape(B, T, Hk, Hq // Hk, D)
    s = torch.einsum("btgrd,bsgd->bgrts", qg, k.float()).flatten(1, 2) * (scale if scale is not None else D ** -0.5)
    if bias is not None:
        s = s + bias.float()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _head_mean(s: Tensor) -> Tensor:
    """[B, H, t, S] logits -> head-mean probabilities [B, t, S]; rows with no visible key -> 0."""
    return torch.softmax(s, dim=-1).nan_to_num(0.0).mean(1)


def attention_target_ref(q: Tensor, k: Tensor, *, causal: bool = True, key_mask: Tensor | None = None,
                         window: int | None = None, bias: Tensor | None = None, scale: float | None = None,
                         segment_ids: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """The indexer's target [B, T, S] float32: attention probabilities averaged over heads, all at once."""
    T, S = q.shape[1], k.shape[1]
    mask = attention_mask(T, S, causal=causal, window=window, key_mask=key_mask, segment_ids=segment_ids,
                          device=q.device)
    return _head_mean(_masked_scores(q, k, mask, bias, scale))


@torch.no_grad()
def attention_target(q: Tensor, k: Tensor, *, causal: bool = True, key_mask: Tensor | None = None,
                     window: int | None = None, bias: Tensor | None = None, scale: float | None = None,
                     segment_ids: tuple[Tensor, Tensor] | None = None, chunk: int | None = None) -> Tensor:
    """Same as `attention_target_ref` (and detached), `chunk` queries at a time (default: ~4M scores a chunk)."""
    B, T, Hq, _ = q.shape
    S = k.shape[1]
    chunk = chunk or max(1, CHUNK_ELEMENTS // (B * Hq * S))
    mask = attention_mask(T, S, causal=causal, window=window, key_mask=key_mask, segment_ids=segment_ids,
                          device=q.device)
    out = torch.empty(B, T, S, dtype=torch.float32, device=q.device)
    for t0 in range(0, T, chunk):
        rows = slice(t0, min(T, t0 + chunk))
        m = mask[:, :, rows] if mask is not None and mask.shape[2] > 1 else mask
        b = bias[:, :, rows] if bias is not None and bias.shape[2] > 1 else bias
        out[:, rows] = _head_mean(_masked_scores(q[:, rows], k, m, b, scale))
    return out


def indexer_kl_ref(target: Tensor, scores: Tensor) -> Tensor:
    """Σ_s p log(p / q) per query, q = softmax of the finite index scores, written out; mean over the queries that
    have a finite score. target, scores [B, T, S] (target zero where scores are -inf)."""
    sel = torch.isfinite(scores)
    e = torch.where(sel, torch.exp(scores - scores.masked_fill(~sel, -1e30).amax(-1, keepdim=True)), 0.0)
    q = e / e.sum(-1, keepdim=True).clamp_min(1e-30)
    terms = torch.where(target > 0, target * (target.clamp_min(1e-30).log() - q.clamp_min(1e-30).log()), 0.0)
    rows = sel.any(-1)
    return terms.sum(-1)[rows].mean() if rows.any() else scores.new_zeros(())


def indexer_kl(target: Tensor, scores: Tensor) -> Tensor:
    """Mean over queries of KL(target || softmax(scores)) [] float32; -inf scores mark keys outside the selection.
    target [B, T, S] (no gradient), scores [B, T, S] (the index scores: the gradient goes there)."""
    sel = torch.isfinite(scores)
    # a finite floor, not -inf: a query with no selected key must not turn log_softmax (and its gradient) into NaN
    logq = F.log_softmax(scores.float().masked_fill(~sel, torch.finfo(torch.float32).min), dim=-1)
    p = target.float()
    kl = (torch.xlogy(p, p) - torch.where(p > 0, p * logq, 0.0)).sum(-1)          # [B, T]
    rows = sel.any(-1)
    return (kl * rows).sum() / rows.sum().clamp_min(1)
