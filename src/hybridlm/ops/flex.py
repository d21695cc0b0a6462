"""Softmax attention through `torch.nn.attention.flex_attention`: the masks of `ops.attention` (and the two top-k
selections of the Wonderful Matrices dynamic mask and the lightning indexer) as mask_mods / score_mods, so no
[T, S] mask or bias tensor is built. On CUDA both the block mask and the kernel are compiled (`create_block_mask
(_compile=True)`, `torch.compile(flex_attention)`): the mask is evaluated block by block and fully masked blocks
are skipped. Eager flex_attention (the CPU tests) runs an unfused reference that does materialise the scores.

Same contract as `ops.attention.attention`: q [B, T, Hq, D], k [B, S, Hk, D], v [B, S, Hk, Dv], Hq % Hk == 0,
the T queries are the last T of the S keys (bottom-right aligned causal mask), rows with no visible key return 0.
Extra inputs:
  key_bias   [B, S, Hk]  an additive score per key and key head (the WM "dt" dynamic mask, a score_mod).
  keep_topk  int         with key_bias: each query keeps only its `keep_topk` visible keys with the largest
                         key_bias, ties to the later key (exactly `ops.wm.topk_key_mask`). The k-th key of each
                         query is found once (a value and a position per query and head, computed in query
                         chunks), after which the selection is the mask_mod `bias > kth or (bias == kth and
                         s >= kth_pos)`.
  index_topk [B, T, k]   the lightning indexer's selected key indices per query (shared by the heads); packed
                         into a bitset [B, T, ceil(S / 64)] int64, which the mask_mod reads one bit of.
CPU flex_attention has no backward (torch 2.13): there this path serves inference only.
"""
import os

import torch
from torch import Tensor

from ..errors import ConfigError, InputError

try:
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as _flex_attention
except ImportError:  # pragma: no cover - older torch
    create_block_mask = _flex_attention = None

_COMPILED = {}
_CHUNK = 1 << 22          # elements of one [B, Hk, chunk, S] block of the top-k threshold search


def flex_available() -> bool:
    return _flex_attention is not None


def flex_mode() -> str:
    """HYBRIDLM_FLEX: "0" never, "1" also on CPU (inference only: CPU flex has no backward), unset/"auto" CUDA."""
    mode = os.environ.get("HYBRIDLM_FLEX", "auto").strip().lower()
    if mode not in ("0", "1", "auto", ""):
        raise ConfigError(f"HYBRIDLM_FLEX must be 0, 1 or auto, got {mode!r}")
    return mode or "auto"


def use_flex(q: Tensor, k: Tensor, v: Tensor, *extra: Tensor | None) -> bool:
    """Whether attention of q [B, T, Hq, D] over k, v (and `extra` inputs such as biases) goes through
    flex_attention. One query row (T = 1, decoding) keeps SDPA: its mask [B, 1, 1, S] is no larger than a key
    mask, and a per-step block mask would only add launches. Head dims over 256 (MLA's absorbed latent) keep
    SDPA too: flex's Triton kernel holds a head in shared memory."""
    if not flex_available():
        return False
    mode = flex_mode()
    if mode == "0" or q.shape[1] == 1 or max(q.shape[-1], v.shape[-1]) > 256:
        return False
    tensors = (q, k, v, *extra)
    dev = q.device.type
    if dev == "cuda":
        return True
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    return mode == "1" and dev == "cpu" and not grad


def _visible_rows(t0: int, t1: int, T: int, S: int, *, causal: bool, window: int | None,
                  key_mask: Tensor | None, segment_ids: tuple[Tensor, Tensor] | None, device) -> Tensor:
    """Visibility of query rows t0..t1-1 (of T): bool [B|1, 1, t1 - t0, S] (`ops.attention.attention_mask` rows)."""
    qi = torch.arange(S - T + t0, S - T + t1, device=device)[:, None]
    ki = torch.arange(S, device=device)[None, :]
    vis = ki <= qi if causal else torch.ones(t1 - t0, S, dtype=torch.bool, device=device)
    if window is not None:
        vis = vis & (ki > qi - window)
    vis = vis[None, None]
    if key_mask is not None:
        vis = vis & key_mask[:, None, None, :].bool()
    if segment_ids is not None:
        q_seg, k_seg = segment_ids
        vis = vis & (q_seg[:, None, t0:t1, None] == k_seg[:, None, None, :])
    return vis


def topk_threshold(key_bias: Tensor, T: int, keep: int, **masks) -> tuple[Tensor, Tensor]:
    """The `keep`-th key of every query in (bias, position) descending order among its visible keys.

    key_bias [B, S, Hk]; `masks` as `_visible_rows` (causal, window, key_mask, segment_ids). Returns (value
    [B, Hk, T] float32, position [B, Hk, T] long): a query keeps key s iff bias > value or (bias == value and
    s >= position), which is `ops.wm.topk_key_mask`. Rows seeing <= keep keys get (-inf, 0): they keep all.
    Works in query chunks so no [B, Hk, T, S] tensor exists at once.
    """
    B, S, Hk = key_bias.shape
    bias = key_bias.float().transpose(1, 2)                                   # [B, Hk, S]
    vals, poss = [], []
    step = max(1, _CHUNK // max(1, B * Hk * S))
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        vis = _visible_rows(t0, t1, T, S, device=key_bias.device, **masks)
        score = bias[:, :, None, :].masked_fill(~vis, float("-inf"))          # [B, Hk, c, S]
        if keep >= S:
            vals.append(torch.full(score.shape[:-1], float("-inf"), device=score.device))
            poss.append(torch.zeros(score.shape[:-1], dtype=torch.long, device=score.device))
            continue
        kth = score.topk(keep, dim=-1).values[..., -1:]
        above = (score > kth).sum(-1, keepdim=True)
        tie = (score == kth) & vis
        from_end = tie.flip(-1).cumsum(-1).flip(-1)                           # ties at or after s
        pos = (tie & (from_end == keep - above)).int().argmax(-1)             # the first tie still kept
        few = vis.sum(-1).expand(score.shape[:-1]) <= keep
        vals.append(kth[..., 0].masked_fill(few, float("-inf")))
        poss.append(pos.masked_fill(few, 0))
    return torch.cat(vals, -1), torch.cat(poss, -1)


def index_bitset(index: Tensor, S: int) -> Tensor:
    """Key indices [B, T, k] (values in [0, S), distinct per row) -> bitset [B, T, ceil(S / 64)] int64, bit s % 64
    of word s // 64 set for every selected s. Distinct bits never carry, so a scatter-add is a bitwise or."""
    B, T, _ = index.shape
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= S):
        raise InputError(f"index_topk holds key indices outside [0, {S})")
    words = torch.zeros(B, T, (S + 63) // 64, dtype=torch.long, device=index.device)
    bit = torch.ones_like(index) << (index % 64)
    return words.scatter_add_(-1, index // 64, bit)


def _flex_call(compiled: bool):
    if not compiled:
        return _flex_attention
    if "flex" not in _COMPILED:
        _COMPILED["flex"] = torch.compile(_flex_attention)
    return _COMPILED["flex"]


def flex_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, key_mask: Tensor | None = None,
                   window: int | None = None, bias: Tensor | None = None, scale: float | None = None,
                   segment_ids: tuple[Tensor, Tensor] | None = None, key_bias: Tensor | None = None,
                   keep_topk: int | None = None, index_topk: Tensor | None = None,
                   compiled: bool | None = None) -> Tensor:
    """`ops.attention.attention` through flex_attention (see the module docstring). Returns [B, T, Hq, Dv].
    `bias` (dense, broadcastable to [B, Hq, T, S]) is read by the score_mod through an expanded view: supported
    for the contract, but a caller that can say key_bias / index_topk instead never builds it. `compiled`
    (default: on CUDA) compiles the block mask and the kernel."""
    if not flex_available():
        raise ConfigError("flex_attention needs torch >= 2.5")
    B, T, Hq, D = q.shape
    S, Hk = k.shape[1], k.shape[2]
    if Hq % Hk or v.shape[2] != Hk or v.shape[1] != S:
        raise InputError(f"flex_attention: q heads {Hq} must be a multiple of k/v heads {Hk}, {v.shape[2]} "
                         f"and k, v must share their length ({S}, {v.shape[1]})")
    if keep_topk is not None and key_bias is None:
        raise InputError("keep_topk selects keys by key_bias: pass key_bias too")
    if compiled is None:
        compiled = q.device.type == "cuda"
    rep = Hq // Hk
    off = S - T
    masks = dict(causal=causal, window=window, key_mask=key_mask, segment_ids=segment_ids)

    conds, per_batch, per_head = [], False, False
    if causal:
        conds.append(lambda b, h, qi, kv: kv <= qi + off)
    if window is not None:
        conds.append(lambda b, h, qi, kv: kv > qi + off - window)
    if key_mask is not None:
        km = key_mask.bool()
        conds.append(lambda b, h, qi, kv: km[b, kv])
        per_batch = True
    if segment_ids is not None:
        q_seg, k_seg = segment_ids
        conds.append(lambda b, h, qi, kv: q_seg[b, qi] == k_seg[b, kv])
        per_batch = True
    kb = None
    if key_bias is not None:
        kb = key_bias.float().transpose(1, 2)                                  # [B, Hk, S]
        if keep_topk is not None:
            with torch.no_grad():
                kth, kth_pos = topk_threshold(key_bias.detach(), T, keep_topk, **masks)
            kbd = kb.detach()
            conds.append(lambda b, h, qi, kv: (kbd[b, h // rep, kv] > kth[b, h // rep, qi])
                         | ((kbd[b, h // rep, kv] == kth[b, h // rep, qi]) & (kv >= kth_pos[b, h // rep, qi])))
            per_batch, per_head = True, per_head or Hk > 1
    if index_topk is not None:
        bits = index_bitset(index_topk, S)
        conds.append(lambda b, h, qi, kv: ((bits[b, qi, kv // 64] >> (kv % 64)) & 1) == 1)
        per_batch = True

    block_mask = None
    if conds:
        def mask_mod(b, h, qi, kv):
            ok = conds[0](b, h, qi, kv)
            for c in conds[1:]:
                ok = ok & c(b, h, qi, kv)
            return ok
        block_mask = create_block_mask(mask_mod, B if per_batch else None, Hq if per_head else None, T, S,
                                       device=q.device, _compile=compiled)

    score_mod = None
    if bias is not None or kb is not None:
        dense = bias.expand(B, Hq, T, S) if bias is not None else None         # a view: stride 0 where broadcast

        def score_mod(score, b, h, qi, kv):
            if kb is not None:
                score = score + kb[b, h // rep, kv].to(score.dtype)
            if dense is not None:
                score = score + dense[b, h, qi, kv].to(score.dtype)
            return score

    out = _flex_call(compiled)(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=score_mod,
                               block_mask=block_mask, scale=scale, enable_gqa=rep > 1)
    return out.transpose(1, 2)
