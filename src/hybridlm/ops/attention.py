"""Softmax attention: an explicit reference and the fast SDPA path, with one mask vocabulary.

q [B, T, Hq, D], k [B, S, Hk, D], v [B, S, Hk, Dv], Hq % Hk == 0 (grouped / multi-query heads).
S >= T and the queries are the *last* T positions of the key sequence (bottom-right aligned causal mask),
which is what a KV cache produces. Masks: `key_mask` [B, S] (True = real token), `window` (a query at key
index p sees keys p - window < s <= p), `segment_ids` (q_seg [B, T], k_seg [B, S]: attend only within
the same packed document) and an additive float `bias` broadcastable to [B, Hq, T, S]. `key_mask` may also be
[B, T, S], one row of keys per query (cache rows at their own lengths, several new tokens per row).
Rows with no visible key return 0.

`attention` runs SDPA for the unmasked and the plain causal (T == S) cases, whose flash / memory-efficient kernels
need no mask tensor at all; every other mask over more than one query goes through flex_attention on CUDA
(`ops/flex.py`: block masks, no [T, S] tensor; HYBRIDLM_FLEX=0 turns that off) and through SDPA with an explicit
boolean mask on the CPU (and for one query row, where the mask is [B, 1, 1, S] anyway). The CPU kernel keeps that
mask, as float32, for the backward: T*S*4 bytes per layer (0.5 GB at 8K queries over 16K keys, a context-parallel
rank's share), so the plain bottom-right causal case avoids it. With 2T >= S, zero queries stand in for the first
S - T positions and the square causal kernel runs (S²/2 scores: no more than the masked kernel's T*S); with
2T < S, or a sliding window, and a mask over MASK_BYTES, the online-softmax form of ops/flash.py runs (O(block²)
memory; a window's cost is O(T * window), where the masked kernel computes all T*S scores).
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from . import flex
from .flash import flash_attention

MASK_BYTES = 64 << 20   # above this a CPU bottom-right causal mask is not built (see the module docstring)


def attention_mask(T: int, S: int, *, causal: bool = True, window: int | None = None,
                   key_mask: Tensor | None = None, segment_ids: tuple[Tensor, Tensor] | None = None,
                   device=None) -> Tensor | None:
    """Boolean visibility mask [B or 1, 1, T, S] (True = attend), or None when nothing is masked."""
    mask = None
    if causal or window is not None:
        qi = torch.arange(S - T, S, device=device).unsqueeze(1)
        ki = torch.arange(S, device=device).unsqueeze(0)
        mask = ki <= qi if causal else torch.ones(T, S, dtype=torch.bool, device=device)
        if window is not None:
            mask = mask & (ki > qi - window)
        mask = mask[None, None]
    if key_mask is not None:
        km = (key_mask[:, None] if key_mask.dim() == 3 else key_mask[:, None, None, :]).bool()
        mask = km if mask is None else mask & km
    if segment_ids is not None:
        q_seg, k_seg = segment_ids
        sm = q_seg[:, None, :, None] == k_seg[:, None, None, :]
        mask = sm if mask is None else mask & sm
    return mask


def attention_ref(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, key_mask: Tensor | None = None,
                  window: int | None = None, bias: Tensor | None = None, scale: float | None = None,
                  segment_ids: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Explicit masked softmax(q kᵀ · scale + bias) v in float32. Returns [B, T, Hq, Dv]."""
    B, T, Hq, D = q.shape
    S, Hk = k.shape[1], k.shape[2]
    rep = Hq // Hk
    kf = k.float().repeat_interleave(rep, dim=2)
    vf = v.float().repeat_interleave(rep, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q.float(), kf) * (scale if scale is not None else D ** -0.5)
    if bias is not None:
        scores = scores + bias.float()
    mask = attention_mask(T, S, causal=causal, window=window, key_mask=key_mask, segment_ids=segment_ids,
                          device=q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows -> 0
    return torch.einsum("bhts,bshd->bthd", probs, vf).to(q.dtype)


ROW_CALL_KEYS = 256     # keys a row's own pair of matmuls is worth reading (their fixed cost, on a CPU)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None,
                     lengths: Tensor | None = None) -> Tensor:
    """One query per row over its cached keys: q [B, 1, Hq, D], k [B, S, Hk, D], v [B, S, Hv, Dv] with Hk and Hv
    dividing Hq (grouped-query heads; shared keys, Hk = 1 with Hv = Hq) -> [B, 1, Hq, Dv]. `lengths` [B] long: row b
    attends its first lengths[b] keys (cache rows at their own lengths; a row with none gives 0); None: all S. Two
    batched matmuls on views of the cache: every key and value is read once, never expanded to Hq heads (a decode
    step's attention costs what reading its cache costs). With `lengths` all S columns of every row are scored and
    the rest masked, unless (on a CPU) the rows' lengths spread so far that reading each row's own keys with a pair
    of matmuls per row reads fewer (counting ROW_CALL_KEYS per row for the calls); `cpu_decode.decode_attention`
    reads only each row's own keys in one call."""
    if lengths is not None and q.device.type == "cpu" and q.shape[0] > 1:
        n = lengths.tolist()
        if sum(n) + ROW_CALL_KEYS * len(n) < len(n) * k.shape[1]:
            return torch.cat([_decode(q[b:b + 1], k[b:b + 1, :m], v[b:b + 1, :m], scale) if m else
                              q.new_zeros(1, 1, q.shape[2], v.shape[3]) for b, m in enumerate(n)])
    return _decode(q, k, v, scale, lengths)


def _decode(q: Tensor, k: Tensor, v: Tensor, scale: float | None, lengths: Tensor | None = None) -> Tensor:
    B, _, Hq, D = q.shape
    S, Hk, Hv, Dv = k.shape[1], k.shape[2], v.shape[2], v.shape[3]
    qg = q.reshape(B, Hk, Hq // Hk, D)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)) * (scale if scale is not None else D ** -0.5)  # [B, Hk, ., S]
    scores = scores.float()
    if lengths is not None:
        hide = torch.arange(S, device=q.device) >= lengths[:, None]                               # [B, S]
        scores = scores.masked_fill(hide[:, None, None, :], float("-inf"))
        p = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
    else:
        p = torch.softmax(scores, dim=-1)
    p = p.to(v.dtype).reshape(B, Hv, Hq // Hv, S)
    return torch.matmul(p, v.transpose(1, 2)).reshape(B, 1, Hq, Dv)


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, key_mask: Tensor | None = None,
              window: int | None = None, bias: Tensor | None = None, scale: float | None = None,
              segment_ids: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Same contract as `attention_ref`, computed by torch's scaled_dot_product_attention (or flex_attention: see
    the module docstring)."""
    B, T, Hq, D = q.shape
    S, Hk = k.shape[1], k.shape[2]
    if causal and T == 1 and window is None:
        causal = False  # a single last query sees every key: skip building a mask (decode hot path)
    plain_causal = causal and window is None and key_mask is None and segment_ids is None and bias is None
    unmasked = not causal and window is None and key_mask is None and segment_ids is None and bias is None
    per_query = key_mask is not None and key_mask.dim() == 3         # flex's mask mods take [B, S] key masks
    if not (unmasked or (plain_causal and T == S) or per_query) and flex.use_flex(q, k, v, bias):
        return flex.flex_attention(q, k, v, causal=causal, key_mask=key_mask, window=window, bias=bias,
                                   scale=scale, segment_ids=segment_ids)
    banded = causal and key_mask is None and segment_ids is None and bias is None    # plain causal or a window
    if banded and q.device.type == "cpu" and T * S * 4 > MASK_BYTES and (window is not None or 2 * T < S):
        # a window's tiles outside the band are skipped; GQA is a broadcast inside (no expanded k/v)
        return flash_attention(q, k, v, causal=True, window=window, scale=scale, block_size=512)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if Hq != Hk:  # SDPA's enable_gqa falls back to the math kernel on CPU; expanding is faster
        kt = kt.repeat_interleave(Hq // Hk, dim=1)
        vt = vt.repeat_interleave(Hq // Hk, dim=1)
    if plain_causal and T == S:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
        return out.transpose(1, 2)
    if plain_causal and q.device.type == "cpu" and 2 * T >= S:    # bottom-right causal as a square one
        qp = torch.cat((qt.new_zeros(B, Hq, S - T, D), qt), dim=2)
        out = F.scaled_dot_product_attention(qp, kt, vt, is_causal=True, scale=scale)[:, :, S - T:]
        return out.transpose(1, 2)
    mask = attention_mask(T, S, causal=causal, window=window, key_mask=key_mask, segment_ids=segment_ids,
                          device=q.device)
    valid = None
    if mask is not None:
        valid = mask.any(-1, keepdim=True)             # [B|1, 1, T, 1]
        mask = mask | ~valid                           # keep SDPA away from all -inf rows (NaN)
    attn_mask = mask
    if bias is not None:
        attn_mask = bias.to(q.dtype) if mask is None else \
            bias.to(q.dtype).masked_fill(~mask, float("-inf"))
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=attn_mask, scale=scale)
    if valid is not None:
        out = out * valid.to(out.dtype)
    return out.transpose(1, 2)
