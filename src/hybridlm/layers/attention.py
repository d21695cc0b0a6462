"""Multi-head / grouped-query / multi-query / shared-key softmax attention with RoPE and a KV cache."""
from functools import partial

import torch
from torch import Tensor, nn

from ..cache import KVCache, WindowKVCache
from ..context import SeqContext
from ..ops.attention import attention, decode_attention
from ..ops.indexer_loss import attention_target
from ..ops.rope import apply_rope
from .init import normal_, reset_
from .norm import RMSNorm


def norm_and_rope(attn: nn.Module, q: Tensor, k: Tensor, ctx: SeqContext) -> tuple[Tensor, Tensor]:
    """q [B, T, H, D], k [B, T, Hk, D] -> the same after the optional per-head RMSNorm (`attn.q_norm`/`k_norm`,
    applied before RoPE as in Doge/Qwen3) and RoPE on the first `attn.rope_dim` channels."""
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    if attn.rope_dim:
        cos, sin = ctx.rope(attn.rope_dim, attn.rope_base)
        q = apply_rope(q, cos, sin, interleaved=attn.rope_interleaved)
        k = apply_rope(k, cos, sin, interleaved=attn.rope_interleaved)
    return q, k


def cache_keys_values(attn: nn.Module, cache, k: Tensor, v: Tensor, ctx: SeqContext, *, ring_step: bool = True):
    """Append k [B, T, Hk, D], v [B, T, Hv, Dv] to layer `attn.layer_idx`'s slot of `cache` (a ring, WindowKVCache,
    when `attn.window` is set) and return what attention needs: (k, v, causal, window, key_mask) over the S keys
    returned. A one-token decode on a ring reads it in slot order without a copy (`ring_step`): one query sees all
    of it, so causal/window masking is dropped and the key mask is permuted into slot order instead. Callers whose
    extra inputs are in chronological key order (a bias over keys) pass ring_step=False."""
    window = attn.window
    if cache is None:
        return k, v, True, window, ctx.key_mask
    slot = cache.layer(attn.layer_idx, KVCache if window is None else partial(WindowKVCache, window))
    if ctx.cache_pos is not None:  # static decode: fixed shapes, the key mask hides what is not (yet) there
        if window is None:
            k, v = slot.write(k, v, ctx.cache_pos, ctx.key_mask.shape[1])
            return k, v, False, None, ctx.key_mask
        k, v, key_mask = slot.write(k, v, ctx.cache_pos, ctx.key_mask)
        return k, v, False, None, key_mask
    if ctx.lengths is not None:    # rows at their own lengths: the slot writes each row at its own columns
        return _own_rows(slot, k, v, ctx, window, ring_step)
    causal, order = True, None
    if window is not None and k.shape[1] == 1 and ring_step:
        k, v, order = slot.step(k, v)
        causal, window = False, None
    else:
        k, v = slot.update(k, v)
    # a window cache returns only the last S keys: the key mask covers every token seen
    key_mask = ctx.key_mask[:, -k.shape[1]:] if ctx.key_mask is not None else None
    if key_mask is not None and order is not None:
        key_mask = key_mask[:, order]                      # into the ring's slot order
    return k, v, causal, window, key_mask


def _own_rows(slot, k: Tensor, v: Tensor, ctx: SeqContext, window: int | None, ring_step: bool):
    """`cache_keys_values` on a cache whose rows hold their own lengths (ctx.lengths: each row's tokens before this
    call). Growing K/V: every row's keys at columns [0, its length), seen through the model's key mask. A ring's
    one-token step: row b sees its first min(lengths[b] + 1, window) slots, in slot order. A ring otherwise: each
    row's last P cached tokens (P the longest row's, entries before a row's first token masked) then its new ones,
    chronological in every row, so causal and window masks hold as they are."""
    T = k.shape[1]
    if window is None:
        k, v = slot.update(k, v)
        return k, v, True, None, ctx.key_mask
    if T == 1 and ring_step:
        k, v, _ = slot.step(k, v)
        seen = (ctx.lengths + 1).clamp(max=window)
        return k, v, False, None, torch.arange(k.shape[1], device=k.device) < seen[:, None]
    k, v = slot.update(k, v)
    P = k.shape[1] - T
    return k, v, True, window, ctx.lengths[:, None] - P + torch.arange(P + T, device=k.device) >= 0


class Attention(nn.Module):
    """x [B, T, d] -> [B, T, d]. n_kv_heads < n_heads gives GQA (1 = MQA). rope_dim=0 disables RoPE
    (for models with learned absolute positions); window limits each query to its last `window` keys and
    then caches only those (WindowKVCache). n_kv_heads counts value heads; n_k_heads (default n_kv_heads)
    key heads: 1 with n_kv_heads = n_heads is shared-key attention (SKA, the Rodimus* paper, 3.2.1).
    output_gate (Qwen3-Next's gated attention): the q rows of `qkv` hold, per head, [query (D) | gate (D)], and the
    attention output is multiplied by sigmoid(gate) before `out`."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, *, layer_idx: int,
                 bias: bool = False, rope_dim: int | None = None, rope_base: float = 10000.0,
                 rope_interleaved: bool = False, window: int | None = None, qk_norm: bool = False,
                 norm_eps: float = 1e-6, dropout: float = 0.0, n_k_heads: int | None = None,
                 output_gate: bool = False):
        super().__init__()
        self.output_gate = output_gate
        self.layer_idx, self.n_heads, self.n_kv_heads, self.head_dim = layer_idx, n_heads, n_kv_heads, head_dim
        self.n_k_heads = n_k_heads or n_kv_heads
        self.rope_dim = head_dim if rope_dim is None else rope_dim
        self.rope_base, self.rope_interleaved, self.window = rope_base, rope_interleaved, window
        self.qkv = nn.Linear(d_model, ((1 + output_gate) * n_heads + self.n_k_heads + n_kv_heads) * head_dim, bias=bias)
        self.out = nn.Linear(n_heads * head_dim, d_model, bias=bias)
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()

    def init_weights(self, std: float, out_std: float):
        """qkv N(0, std), out N(0, out_std) (it writes to the residual stream), zero biases, norms 1."""
        normal_(std, self.qkv)
        normal_(out_std, self.out)
        reset_(self.q_norm, self.k_norm)

    def forward(self, x: Tensor, *, ctx: SeqContext, cache=None, bias: Tensor | None = None,
                need_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """`bias` [B|1, 1|H, T, S]: extra additive scores (-inf hides a key; the lightning indexer's top-k).
        need_weights: also return the attention probabilities averaged over heads [B, T, S] (float32, no
        gradient: the lightning indexer's training target)."""
        B, T, _ = x.shape
        H, Hk, Hv, D = self.n_heads, self.n_k_heads, self.n_kv_heads, self.head_dim
        qkv, gate = self.qkv(x), None
        if self.output_gate:
            qg, k, v = qkv.split((2 * H * D, Hk * D, Hv * D), dim=-1)
            q, gate = qg.view(B, T, H, 2 * D).chunk(2, dim=-1)
            q, k = norm_and_rope(self, q, k.view(B, T, Hk, D), ctx)
            v = v.view(B, T, Hv, D)
        elif self.rope_dim and self.q_norm is None:
            # rotate q and k in one call on their joint [B, T, H + Hk, D] view (half the elementwise ops)
            cos, sin = ctx.rope(self.rope_dim, self.rope_base)
            qk, v = qkv.split(((H + Hk) * D, Hv * D), dim=-1)     # split, not slicing: no zero-filled grads
            qk = apply_rope(qk.view(B, T, H + Hk, D), cos, sin, interleaved=self.rope_interleaved)
            q, k = qk.split((H, Hk), dim=2)
            v = v.view(B, T, Hv, D)
        else:
            q, k, v = qkv.split((H * D, Hk * D, Hv * D), dim=-1)
            q, k = norm_and_rope(self, q.view(B, T, H, D), k.view(B, T, Hk, D), ctx)
            v = v.view(B, T, Hv, D)
        k, v, causal, window, key_mask = cache_keys_values(self, cache, k, v, ctx, ring_step=bias is None)
        masks = dict(causal=causal, key_mask=key_mask, window=window, segment_ids=ctx.segment_ids, bias=bias)
        if T == 1 and cache is not None and window is None and key_mask is None and bias is None \
                and ctx.segment_ids is None and not need_weights:
            y = decode_attention(q, k, v)          # one query sees every cached key: read them once, unexpanded
        elif T == 1 and ctx.lengths is not None and bias is None and ctx.segment_ids is None and not need_weights:
            # rows at their own lengths: each reads its own keys (a ring's first min(length, window) slots)
            n = ctx.lengths + 1
            y = decode_attention(q, k, v, lengths=n if self.window is None else n.clamp(max=self.window))
        else:
            if Hk != Hv:  # shared keys: the cache keeps Hk heads, every value head reads its group's key
                k = k.expand(-1, -1, Hv, -1) if Hk == 1 else k.repeat_interleave(Hv // Hk, dim=2)
            y = attention(q, k, v, **masks)
        if gate is not None:
            y = y * torch.sigmoid(gate)
        y = self.drop(self.out(y.reshape(B, T, H * D)))
        return (y, attention_target(q, k, **masks)) if need_weights else y
