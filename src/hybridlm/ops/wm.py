"""Ops of the Wonderful Matrices attention (Shi et al., 2024, section 3.2, appendix B.3), each with a
reference form that tests compare it against.

* `inner_function_values`: the heuristic values of eq. 3, V = x ⊙ Σ_{i ∈ top-k(g)} w_i W_V[i] with
  g = (x W_vQ) θ_vKᵀ, per head.
* `topk_key_mask`: the published dynamic mask's key selection: each query keeps only its `k` visible keys
  with the largest per-key bias.
* `key_weighted_attention_ref`: the paper's dynamic mask (eq. 4), M = L ∘ softmax(QKᵀ), y = M V with a learned
  weight per key position and head; the fast form is plain attention on L-scaled values (see the function).
"""
import torch
from torch import Tensor

from .attention import attention_mask


def inner_function_values(x: Tensor, scores: Tensor, table: Tensor, k: int) -> Tensor:
    """V = x ⊙ Σ_i softmax(top-k scores)_i · table[head, i] (eq. 3, multi-head).

    x [B, T, H, D]; scores [B, T, H, n_v] (g = x W_vQ θ_vKᵀ per head); table [H, n_v, D] (W_V, shared rows).
    Eq. 3 weights the retrieved rows by their scores; the selected scores are normalised with a softmax (as
    the CDMoE router does) so the value scale does not follow the retrieval logits. k = 1 is the listing's
    plain row lookup. Gathers k rows per token and head; returns [B, T, H, D].
    """
    top, idx = scores.topk(k, dim=-1)                                   # [B, T, H, k]
    w = torch.softmax(top.float(), dim=-1).to(x.dtype)
    heads = torch.arange(table.shape[0], device=x.device).view(1, 1, -1, 1)
    rows = table[heads, idx]                                            # [B, T, H, k, D]
    return x * (w.unsqueeze(-1) * rows).sum(-2)


def inner_function_values_ref(x: Tensor, scores: Tensor, table: Tensor, k: int) -> Tensor:
    """Reference: a dense softmax over all n_v rows with the unselected ones at -inf, then a matmul."""
    kth = scores.topk(k, dim=-1).values[..., -1:]
    w = torch.softmax(scores.float().masked_fill(scores < kth, float("-inf")), dim=-1).to(x.dtype)
    return x * torch.einsum("bthn,hnd->bthd", w, table)


def topk_key_mask(bias: Tensor, visible: Tensor, k: int) -> Tensor:
    """Which keys each query keeps: its `k` visible keys with the largest bias.

    bias [B, H, S] (one value per key and head); visible [B|1, H|1, T, S] bool. Returns keep [B, H, T, S]
    (a subset of `visible`; all of it where a row sees <= k keys). Ties at the k-th value go to the later
    keys, so the choice is a function of the visible keys alone and decoding with a cache selects exactly
    what the full forward selects (a plain top-k breaks ties by memory layout).
    """
    score = bias[:, :, None, :].float().masked_fill(~visible, float("-inf"))    # [B, H, T, S]
    if k >= score.shape[-1]:
        return visible.expand(score.shape)
    kth = score.topk(k, dim=-1).values[..., -1:]                                 # k-th largest, per row
    above = score > kth
    tie = (score == kth) & visible
    need = k - above.sum(-1, keepdim=True)
    from_end = tie.flip(-1).cumsum(-1).flip(-1)                                  # ties at or after s
    return above | (tie & (from_end <= need))


def topk_key_mask_ref(bias: Tensor, visible: Tensor, k: int) -> Tensor:
    """Reference: per query, sort the visible keys by (bias, position) descending and keep the first k."""
    B, H, S = bias.shape
    T = visible.shape[-2]
    vis = visible.expand(B, H, T, S)
    keep = torch.zeros(B, H, T, S, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                keys = [s for s in range(S) if vis[b, h, t, s]]
                keys.sort(key=lambda s: (bias[b, h, s].item(), s), reverse=True)
                keep[b, h, t, keys[:k]] = True
    return keep


def key_weighted_attention_ref(q: Tensor, k: Tensor, v: Tensor, key_weight: Tensor, *,
                               key_mask: Tensor | None = None, window: int | None = None,
                               segment_ids: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Reference for the paper's dynamic mask: y = (L ∘ softmax(QKᵀ/√d)) V, L[b, h, t, s] = key_weight[b, s, h]
    on the causal (and padding / window / segment) mask, 0 elsewhere (the Wonderful Matrices paper, eq. 4).

    q [B, T, Hq, D]; k, v [B, S, Hk, D]; key_weight [B, S, Hk] (the learned l[h, position of key s]).
    As L only depends on the key, (L ∘ A) V = A (L ⊙ V): the fast form is `attention(q, k, v * L)`.
    """
    B, T, Hq, D = q.shape
    S, Hk = k.shape[1], k.shape[2]
    rep = Hq // Hk
    kf, vf = k.float().repeat_interleave(rep, 2), v.float().repeat_interleave(rep, 2)
    scores = torch.einsum("bthd,bshd->bhts", q.float(), kf) * D ** -0.5
    mask = attention_mask(T, S, causal=True, window=window, key_mask=key_mask, segment_ids=segment_ids,
                          device=q.device)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
    L = key_weight.float().repeat_interleave(rep, 2).permute(0, 2, 1)[:, :, None, :]   # [B, Hq, 1, S]
    return torch.einsum("bhts,bshd->bthd", probs * L, vf).to(q.dtype)
