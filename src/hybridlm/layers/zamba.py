"""Zamba2's shared transformer block (the letter `Z`; transformers' Zamba2AttentionDecoderLayer + its linear).

    h = RMSNorm(concat(x, e))                      x [B, T, d] the stream, e [B, T, d] the embeddings (ctx.embeddings)
    a = attn(h)                                    q/k/v from 2·d wide h (+ LoRA adapters), scores scaled 1/√(D/2)
    y = proj(mlp(RMSNorm(a)))                      gate/up (+ a LoRA adapter), act(gate) · up, down; proj d -> d
The output is not added to the stream: `feeds_next` makes CausalLM fold it into the next block's branch input
(layers/residual.py: Fed). Zamba2 shares this block between occurrences (`Z@0`, `Z@1`, ...); the adapters and `proj`
are per occurrence (`_unshared`), as in the released checkpoints.
"""
import torch
from torch import Tensor, nn

from ..context import SeqContext
from ..errors import InputError
from ..ops.attention import attention
from .attention import cache_keys_values, norm_and_rope
from .mlp import ACTIVATIONS
from .init import normal_, reset_
from .norm import RMSNorm


class LoRA(nn.Module):
    """x [..., d_in] -> up(down(x)) [..., d_out]: a rank-`rank` adapter added to a shared projection's output."""

    def __init__(self, d_in: int, rank: int, d_out: int):
        super().__init__()
        self.down = nn.Linear(d_in, rank, bias=False)
        self.up = nn.Linear(rank, d_out, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.up(self.down(x))


class ZambaBlock(nn.Module):
    """x [B, T, d] (+ ctx.embeddings) -> [B, T, d], to be added to the next layer's input. Attention heads of
    `head_dim` over the 2·d input (GQA by n_kv_heads), RoPE if rope_dim, KV cache in slot `layer_idx`."""

    feeds_next = True

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, mlp_hidden: int, *,
                 layer_idx: int, act: str = "gelu", mlp_bias: bool = False, adapter_rank: int = 0,
                 attn_adapter: bool = False, rope_dim: int = 0, rope_base: float = 10000.0, norm_eps: float = 1e-5):
        super().__init__()
        d2 = 2 * d_model
        self.layer_idx, self.n_heads, self.n_kv_heads, self.head_dim = layer_idx, n_heads, n_kv_heads, head_dim
        self.rope_dim, self.rope_base, self.rope_interleaved, self.window = rope_dim, rope_base, False, None
        self.q_norm = self.k_norm = None                 # what norm_and_rope / cache_keys_values read
        self.scale = (head_dim / 2) ** -0.5              # Zamba2 scales by the head size of the d-wide half
        self.norm_in = RMSNorm(d2, norm_eps)
        self.qkv = nn.Linear(d2, (n_heads + 2 * n_kv_heads) * head_dim, bias=False)
        self.out = nn.Linear(n_heads * head_dim, d_model, bias=False)
        self.norm_ff = RMSNorm(d_model, norm_eps)
        self.act = ACTIVATIONS[act]
        self.w_in = nn.Linear(d_model, 2 * mlp_hidden, bias=mlp_bias)       # rows [gate; up]
        self.w_out = nn.Linear(mlp_hidden, d_model, bias=mlp_bias)
        # per occurrence (not tied by `Z@k`): the adapters and the output projection
        self.qkv_adapters = nn.ModuleList(LoRA(d2, adapter_rank, n * head_dim)
                                          for n in (n_heads, n_kv_heads, n_kv_heads)) if attn_adapter else None
        self.mlp_adapter = LoRA(d_model, adapter_rank, 2 * mlp_hidden) if adapter_rank else None
        self.proj = nn.Linear(d_model, d_model, bias=False)
        for m in (self.qkv_adapters, self.mlp_adapter, self.proj):
            if m is not None:
                m._unshared = True

    def init_weights(self, std: float, out_std: float):
        """Every projection N(0, std) but `proj` (it writes to the stream through the next block): N(0, out_std);
        zero biases, norms 1."""
        adapters = [*(self.qkv_adapters or []), self.mlp_adapter]
        normal_(std, self.qkv, self.out, self.w_in, self.w_out,
                *(lin for a in adapters if a is not None for lin in (a.down, a.up)))
        normal_(out_std, self.proj)
        reset_(self.norm_in, self.norm_ff)

    def forward(self, x: Tensor, ctx: SeqContext, cache=None) -> Tensor:
        """Called as a block (`blk(x, ctx, cache)`, by residual.Fed), on the raw stream: it norms its own input."""
        B, T, _ = x.shape
        H, Hk, D = self.n_heads, self.n_kv_heads, self.head_dim
        if ctx.embeddings is None:
            raise InputError("the Z block needs ctx.embeddings (CausalLM sets them)")
        h = self.norm_in(torch.cat((x, ctx.embeddings.to(x.dtype)), dim=-1))
        q, k, v = self.qkv(h).split((H * D, Hk * D, Hk * D), dim=-1)
        if self.qkv_adapters is not None:
            q, k, v = (p + a(h) for p, a in zip((q, k, v), self.qkv_adapters))
        q, k = norm_and_rope(self, q.view(B, T, H, D), k.view(B, T, Hk, D), ctx)
        k, v, causal, window, key_mask = cache_keys_values(self, cache, k, v.view(B, T, Hk, D), ctx)
        y = attention(q, k, v, causal=causal, key_mask=key_mask, window=window, segment_ids=ctx.segment_ids,
                      scale=self.scale)
        a = self.norm_ff(self.out(y.reshape(B, T, H * D)))
        gu = self.w_in(a)
        if self.mlp_adapter is not None:
            gu = gu + self.mlp_adapter(a)
        gate, up = gu.chunk(2, dim=-1)
        return self.proj(self.w_out(self.act(gate) * up))
