"""Multi-head latent attention (MLA) with decoupled RoPE, as in DeepSeek-V2/V3
(the Transformer tutorial sections 3.2 and 3.4, eq. 38-46 and 62-69).

Keys and values of every head come from one shared latent c = RMSNorm(W_dkv x) [kv_lora_rank]; position
enters only through a small decoupled part: a per-head rope query and ONE roped key shared by all heads.
A head's score is q_nope·k_nope + q_rope·k_rope, scaled by 1/sqrt(qk_nope_dim + rope_dim).

Two exact execution paths:
  expanded  up-project the latent to per-head keys/values, then ordinary attention (training, prefill);
  absorbed  fold W_uk into the query (eq. 41) and W_uv into the output (eq. 44-46): attention runs in latent
            space with a single shared key/value head [c, k_rope] / c (decode: nothing is re-expanded).
Either way the cache holds only c and k_rope: (kv_lora_rank + rope_dim) values per token.
"""
import math

import torch
from torch import Tensor, nn

from ..cache import LatentCache
from ..context import SeqContext
from ..ops.attention import attention
from ..ops.indexer_loss import attention_target
from ..ops.rope import apply_rope
from .init import normal_, reset_
from .norm import RMSNorm


class MLA(nn.Module):
    """x [B, T, d_model] -> [B, T, d_model].

    q_lora_rank 0 = direct query projection (DeepSeek-V2-Lite); otherwise q = W_uq RMSNorm(W_dq x).
    rotate=False (NoPE, Kimi-Linear's MLA): the decoupled query/key parts are not rotated.
    `mode`: "auto" (absorbed for cached decoding of up to `absorb_max_tokens` tokens, expanded otherwise),
    "expanded" or "absorbed". `bias` (DeepSeek's attention_bias) applies to the down projections and the
    output, never to the up projections (absorption needs them linear).
    """

    def __init__(self, d_model: int, n_heads: int, *, layer_idx: int, kv_lora_rank: int, q_lora_rank: int,
                 qk_nope_dim: int, rope_dim: int, v_dim: int, rope_base: float = 10000.0,
                 rope_interleaved: bool = True, bias: bool = False, absorb: bool = True, dropout: float = 0.0,
                 latent_eps: float = 1e-6, rotate: bool = True):
        super().__init__()
        self.layer_idx, self.n_heads = layer_idx, n_heads
        self.kv_lora_rank, self.nope, self.rope, self.v_dim = kv_lora_rank, qk_nope_dim, rope_dim, v_dim
        self.rope_base, self.rope_interleaved = rope_base, rope_interleaved
        self.rotate = rotate          # False: NoPE (Kimi-Linear), the shared key part is used unrotated
        self.mode = "auto" if absorb else "expanded"
        self.absorb_max_tokens = 1
        self.scale = 1.0 / math.sqrt(qk_nope_dim + rope_dim)
        q_out = n_heads * (qk_nope_dim + rope_dim)
        if q_lora_rank:
            self.q_a = nn.Linear(d_model, q_lora_rank, bias=bias)
            self.q_norm = RMSNorm(q_lora_rank, latent_eps)   # DeepSeek's latent norms use eps 1e-6 throughout
            self.q_b = nn.Linear(q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = nn.Linear(d_model, q_out, bias=False)
        self.kv_a = nn.Linear(d_model, kv_lora_rank + rope_dim, bias=bias)
        self.kv_norm = RMSNorm(kv_lora_rank, latent_eps)
        self.kv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_dim + v_dim), bias=False)  # per head [k_nope, v]
        self.out = nn.Linear(n_heads * v_dim, d_model, bias=bias)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()

    def init_weights(self, std: float, out_std: float):
        """Projections N(0, std), out N(0, out_std), zero biases, latent norms 1."""
        normal_(std, getattr(self, "q_a", None), getattr(self, "q_b", None), getattr(self, "q_proj", None),
                self.kv_a, self.kv_b)
        normal_(out_std, self.out)
        reset_(getattr(self, "q_norm", None), self.kv_norm)

    def query_latent(self, x: Tensor) -> Tensor | None:
        """The normalised query latent [B, T, q_lora_rank] (also the lightning indexer's input), or None."""
        return self.q_norm(self.q_a(x)) if hasattr(self, "q_a") else None

    def project(self, x: Tensor, ctx: SeqContext, q_latent: Tensor | None = None):
        """x [B, T, d] -> the query's q_nope [B, T, H, nope] and roped q_rope [B, T, H, rope], the normalised KV latent
        c [B, T, R] and the shared roped key k_rope [B, T, rope] (what the cache keeps; the vLLM plugin reads it too)."""
        B, T, _ = x.shape
        if hasattr(self, "q_a"):
            q = self.q_b(q_latent if q_latent is not None else self.query_latent(x))
        else:
            q = self.q_proj(x)
        q_nope, q_rope = q.view(B, T, self.n_heads, self.nope + self.rope).split((self.nope, self.rope), dim=-1)
        c, k_rope = self.kv_a(x).split((self.kv_lora_rank, self.rope), dim=-1)
        c = self.kv_norm(c)
        if self.rotate:
            cos, sin = ctx.rope(self.rope, self.rope_base)
            q_rope = apply_rope(q_rope, cos, sin, interleaved=self.rope_interleaved)
            k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin, interleaved=self.rope_interleaved).squeeze(2)
        return q_nope, q_rope, c, k_rope

    def forward(self, x: Tensor, *, ctx: SeqContext, cache=None, bias: Tensor | None = None,
                q_latent: Tensor | None = None, need_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """`bias` [B|1, 1|H, T, S]: extra additive scores (-inf hides a key; the lightning indexer's top-k);
        `q_latent`: a precomputed `query_latent(x)`. need_weights: also return the attention probabilities
        averaged over heads [B, T, S] (float32, no gradient: the lightning indexer's training target)."""
        B, T, _ = x.shape
        H, R = self.n_heads, self.kv_lora_rank
        q_nope, q_rope, c, k_rope = self.project(x, ctx, q_latent)
        if cache is not None:   # ck = [latent | roped key] of every token so far [B, S, R + rope]
            n = ctx.key_mask.shape[1] if ctx.cache_pos is not None else 0
            ck = cache.layer(self.layer_idx, LatentCache).update(c, k_rope, ctx.cache_pos, n)
        else:
            ck = torch.cat((c, k_rope), -1)
        c, k_rope = ck[..., :R], ck[..., R:]
        absorbed = self.mode == "absorbed" or (self.mode == "auto" and cache is not None
                                               and T <= self.absorb_max_tokens)
        masks = dict(causal=True, key_mask=ctx.key_mask, segment_ids=ctx.segment_ids, bias=bias, scale=self.scale)
        weights = None
        w_kv = self.kv_b.weight.view(H, self.nope + self.v_dim, R)
        if absorbed:
            w_uk, w_uv = w_kv[:, : self.nope], w_kv[:, self.nope:]                  # [H, nope, R], [H, v, R]
            q_lat = torch.einsum("bthn,hnr->bthr", q_nope, w_uk)                   # W_uk folded into the query
            q_full = torch.cat((q_lat, q_rope), -1)                               # [B, T, H, R+rope]
            k = ck.unsqueeze(2)                                                   # one shared head [B, S, 1, R+rope]
            if need_weights:
                weights = attention_target(q_full, k, **masks)
            if T == 1 and ctx.segment_ids is None:
                # one query sees every cached key: treat the H heads as H queries of the single shared head
                # (no causal mask needed, and the latent is never repeated per head)
                masks.update(causal=False, bias=bias.transpose(1, 2) if bias is not None else None)
                o_lat = attention(q_full.transpose(1, 2), k, c.unsqueeze(2), **masks).transpose(1, 2)
            else:
                o_lat = attention(q_full, k, c.unsqueeze(2), **masks)             # [B, T, H, R]
            o = torch.einsum("bthr,hvr->bthv", o_lat, w_uv)                        # W_uv folded into the output
        else:
            S = c.shape[1]
            k_nope, v = self.kv_b(c).view(B, S, H, self.nope + self.v_dim).split((self.nope, self.v_dim), dim=-1)
            k = torch.cat((k_nope, k_rope.unsqueeze(2).expand(B, S, H, self.rope)), -1)
            q = torch.cat((q_nope, q_rope), -1)
            o = attention(q, k, v, **masks)
            if need_weights:
                weights = attention_target(q, k, **masks)
        y = self.drop(self.out(o.reshape(B, T, H * self.v_dim)))
        return (y, weights) if need_weights else y
