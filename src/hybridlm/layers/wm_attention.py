"""Wonderful Matrices attention (Shi et al., 2024, section 3.2, appendix B.3): softmax attention whose
values may come from the inner function f(x) (letter F) and whose scores may carry a dynamic mask (A or F).

Dynamic masks:
  "position"  the paper's eq. 4: a learned weight l[head, position] (init 1) multiplied into the causal
              attention matrix, y = (L ∘ A) V. L depends only on the key, so this is A (L ⊙ V): the values
              are scaled before caching and attention itself is unchanged.
  "dt"        the published / Doge form: a per-key bias exp(A · softplus(dt_proj(V))) (A init 0, sized by
              key/value heads) added to QKᵀ/√d; optionally each query keeps only its `keep_window` keys
              with the largest bias. The bias depends only on its key's value, so it is cached with it: it
              rides along as one more value channel, in whatever slot (growing or, with `window`, a ring)
              plain attention would use.
"""
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..context import SeqContext
from ..ops import flex
from ..ops.attention import attention, attention_mask
from ..ops.wm import inner_function_values, topk_key_mask
from .attention import cache_keys_values, norm_and_rope
from .init import normal_, reset_
from .norm import RMSNorm


class WMAttention(nn.Module):
    """x [B, T, d] -> [B, T, d]. GQA via n_kv_heads; RoPE and optional q/k RMSNorm (before RoPE, as Doge).

    inner_values (n_v) switches the values to the inner function (F): per value head, a low-rank query
    x W_vQ (d_ret) scores n_v learned keys θ_vK, the top `inner_topk` rows of the shared table W_V
    (init 1, so f(x) starts as x) are mixed and multiplied into x's channels of that head. It needs
    n_kv_heads · head_dim = d_model (x itself is the value source, eq. 3).
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, *, layer_idx: int,
                 max_seq_len: int, bias: bool = False, rope_dim: int | None = None, rope_base: float = 10000.0,
                 rope_interleaved: bool = False, window: int | None = None, qk_norm: bool = False,
                 norm_eps: float = 1e-6, dropout: float = 0.0, inner_values: int | None = None,
                 inner_topk: int = 2, inner_dret: int = 64, dyn_mask: str = "none",
                 keep_window: int | None = None):
        super().__init__()
        self.layer_idx, self.n_heads, self.n_kv_heads, self.head_dim = layer_idx, n_heads, n_kv_heads, head_dim
        self.rope_dim = head_dim if rope_dim is None else rope_dim
        self.rope_base, self.rope_interleaved, self.window = rope_base, rope_interleaved, window
        self.dyn_mask, self.keep_window, self.inner_topk = dyn_mask, keep_window, inner_topk
        linear_v = inner_values is None
        self.split = (n_heads * head_dim,) + (n_kv_heads * head_dim,) * (2 if linear_v else 1)
        self.qkv = nn.Linear(d_model, sum(self.split), bias=bias)
        self.out = nn.Linear(n_heads * head_dim, d_model, bias=bias)
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        if not linear_v:                                 # inner function f(x), eq. 3
            self.v_query = nn.Linear(d_model, n_kv_heads * inner_dret, bias=False)
            self.v_keys = nn.Parameter(torch.empty(n_kv_heads, inner_values, inner_dret))
            self.v_table = nn.Parameter(torch.empty(n_kv_heads, inner_values, head_dim))
        if dyn_mask == "position":                       # eq. 4: l = ones([heads, max_position_len])
            self.pos_mask = nn.Parameter(torch.empty(n_kv_heads, max_seq_len))   # never decayed (optim.py)
        elif dyn_mask == "dt":
            self.dt_proj = nn.Linear(n_kv_heads * head_dim, n_kv_heads, bias=bias)
            self.A = nn.Parameter(torch.empty(n_kv_heads))
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float):
        """qkv, v_query, dt_proj N(0, std), out N(0, out_std), zero biases, norms 1; the inner function's keys
        N(0, 1/d_ret) and table 1 (f(x) starts as x); the position mask 1 and the dt mask's A 0 (no masking)."""
        normal_(std, self.qkv, getattr(self, "v_query", None), getattr(self, "dt_proj", None))
        normal_(out_std, self.out)
        reset_(self.q_norm, self.k_norm)
        if hasattr(self, "v_keys"):
            nn.init.normal_(self.v_keys, 0.0, self.v_keys.shape[-1] ** -0.5)
            self.v_table.fill_(1.0)
        if hasattr(self, "pos_mask"):
            self.pos_mask.fill_(1.0)
        if hasattr(self, "A"):
            self.A.zero_()

    def values(self, x: Tensor, v: Tensor | None) -> Tensor:
        """The values [B, T, Hk, D]: `v` (the projection's, [B, T, Hk·D]) as heads, or the inner function f(x) (F)."""
        B, T, _ = x.shape
        if v is not None:
            return v.view(B, T, self.n_kv_heads, self.head_dim)
        g = torch.einsum("bthr,hnr->bthn", self.v_query(x).view(B, T, self.n_kv_heads, -1), self.v_keys)
        return inner_function_values(x.view(B, T, self.n_kv_heads, self.head_dim), g, self.v_table, self.inner_topk)

    def _bias(self, b: Tensor, T: int, causal: bool, window: int | None, key_mask: Tensor | None,
              ctx: SeqContext) -> Tensor:
        """Per-key bias b [B, S, Hk] -> additive scores bias [B, Hq, 1 | T, S] (top-k selection applied over the
        keys the attention call will see: same causal/window/key mask)."""
        B, S, Hk = b.shape
        rep = self.n_heads // Hk
        bias = b.transpose(1, 2)                                             # [B, Hk, S]
        if self.keep_window is not None and S > self.keep_window:
            visible = attention_mask(T, S, causal=causal, window=window, key_mask=key_mask,
                                     segment_ids=ctx.segment_ids, device=b.device)
            keep = topk_key_mask(bias, visible, self.keep_window) | ~visible  # leave masked keys to the op
            full = bias[:, :, None, :].masked_fill(~keep, float("-inf"))     # [B, Hk, T, S]
            return full.repeat_interleave(rep, dim=1)
        return bias.repeat_interleave(rep, dim=1)[:, :, None, :]

    def forward(self, x: Tensor, *, ctx: SeqContext, cache=None) -> Tensor:
        B, T, _ = x.shape
        H, Hk, D = self.n_heads, self.n_kv_heads, self.head_dim
        parts = self.qkv(x).split(self.split, dim=-1)
        q, k = parts[0].view(B, T, H, D), parts[1].view(B, T, Hk, D)
        v = self.values(x, parts[2] if len(parts) == 3 else None)
        q, k = norm_and_rope(self, q, k, ctx)
        b = None
        if self.dyn_mask == "position":
            v = v * self.pos_mask.t()[ctx.positions].unsqueeze(-1).to(v.dtype)   # l[h, position of the key]
        elif self.dyn_mask == "dt":
            b = torch.exp(self.A * F.softplus(self.dt_proj(v.reshape(B, T, Hk * D))))   # [B, T, Hk]
        if cache is not None and b is not None:
            v = torch.cat((v, b.unsqueeze(-1).to(v.dtype)), -1)              # the bias as value channel D
        # top-k key selection breaks ties by chronological order: it must not see a ring in slot order
        k, v, causal, window, key_mask = cache_keys_values(self, cache, k, v, ctx,
                                                           ring_step=self.keep_window is None)
        if cache is not None and b is not None:
            v, b = v[..., :D], v[..., D]
        if b is not None and flex.use_flex(q, k, v, b):
            # flex_attention takes the per-key bias and the top-k selection as mask/score mods: no [B, H, T, S] bias
            keep = self.keep_window if self.keep_window is not None and k.shape[1] > self.keep_window else None
            y = flex.flex_attention(q, k, v, causal=causal, key_mask=key_mask, window=window,
                                    segment_ids=ctx.segment_ids, key_bias=b, keep_topk=keep)
            return self.drop(self.out(y.reshape(B, T, H * D)))
        bias = None if b is None else self._bias(b, T, causal, window, key_mask, ctx)
        y = attention(q, k, v, causal=causal, key_mask=key_mask, window=window, segment_ids=ctx.segment_ids,
                      bias=bias)
        return self.drop(self.out(y.reshape(B, T, H * D)))
