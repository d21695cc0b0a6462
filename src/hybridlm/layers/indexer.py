"""DeepSeek-V3.2's lightning indexer and the sparse attention it drives
(002_2cec91cb83945854.txt section 3.5, eq. 70).

The indexer scores every (query t, key s) pair cheaply,
    I[t, s] = sum_h w[t, h] · relu(q[t, h] · k[s]) / sqrt(D)      with w = W_w x / sqrt(H),
using H small index heads and ONE shared key (LayerNorm-ed, half-split RoPE on its first rope dims), and the
main attention of that query then only sees the `topk` keys with the highest I among those it may see
(causal, padding, document masks). With topk >= the number of keys the layer is exactly dense attention.
The selection is discrete: the indexer gets no gradient from the language-model loss (DeepSeek trains it with
a separate distillation loss, not implemented here).
"""
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cache import IndexerCache
from ..context import SeqContext
from ..ops.attention import attention_mask
from ..ops.rope import apply_rope
from .init import normal_, reset_


class LightningIndexer(nn.Module):
    """Top-k key selection. `q_dim` is the width of its query input (the MLA query latent, or d_model)."""

    def __init__(self, d_model: int, q_dim: int, n_heads: int, head_dim: int, rope_dim: int, topk: int, *,
                 rope_base: float = 10000.0):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim, self.topk, self.rope_base = \
            n_heads, head_dim, rope_dim, topk, rope_base
        self.wq = nn.Linear(q_dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(d_model, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.w = nn.Linear(d_model, n_heads, bias=False)

    def init_weights(self, std: float, out_std: float):
        normal_(std, self.wq, self.wk, self.w)
        reset_(self.k_norm)

    def scores(self, x: Tensor, q_in: Tensor, ctx: SeqContext, slot: IndexerCache | None = None) -> Tensor:
        """Index scores [B, T, S] in float32, -inf where the query may not see the key.
        x [B, T, d_model], q_in [B, T, q_dim]; with a cache slot the new keys are appended to it."""
        B, T, _ = x.shape
        q = self.wq(q_in).view(B, T, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x)).unsqueeze(2)                                  # [B, T, 1, D]
        if self.rope_dim:
            cos, sin = ctx.rope(self.rope_dim, self.rope_base)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)               # half-split convention
        k = k.squeeze(2)
        if slot is not None:
            n = ctx.key_mask.shape[1] if ctx.cache_pos is not None else 0
            k = slot.update_keys(k, ctx.cache_pos, n)                             # [B, S, D]
        s = F.relu(torch.einsum("bthd,bsd->bths", q.float(), k.float())) * self.head_dim ** -0.5
        w = self.w(x).float() * self.n_heads ** -0.5
        idx = torch.einsum("bth,bths->bts", w, s)
        visible = attention_mask(T, k.shape[1], causal=True, key_mask=ctx.key_mask, segment_ids=ctx.segment_ids,
                                 device=x.device)
        return idx.masked_fill(~visible[:, 0], float("-inf"))

    @torch.no_grad()
    def forward(self, x: Tensor, q_in: Tensor, ctx: SeqContext, slot: IndexerCache | None = None) -> Tensor | None:
        """Selected keys [B, T, S] bool, or None when every key is kept (topk >= S)."""
        idx = self.scores(x, q_in, ctx, slot)
        if self.topk >= idx.shape[-1]:
            return None
        # a stable sort breaks ties (relu zeros) by key position, so prefill and decode pick the same keys
        top = torch.sort(idx, dim=-1, descending=True, stable=True).indices[..., : self.topk]
        return torch.zeros_like(idx, dtype=torch.bool).scatter_(-1, top, True)


class IndexedAttention(nn.Module):
    """Token mixer `I`: an attention module (MLA or plain attention, taking `bias=`) restricted to the keys its
    lightning indexer selects. x [B, T, d_model] -> [B, T, d_model]."""

    def __init__(self, attn: nn.Module, indexer: LightningIndexer, *, layer_idx: int):
        super().__init__()
        self.attn, self.indexer, self.layer_idx = attn, indexer, layer_idx

    def init_weights(self, std: float, out_std: float):
        self.attn.init_weights(std, out_std)
        self.indexer.init_weights(std, out_std)

    def forward(self, x: Tensor, *, ctx: SeqContext, cache=None) -> Tensor:
        slot = cache.layer(self.layer_idx, IndexerCache) if cache is not None else None
        q_lat = self.attn.query_latent(x) if hasattr(self.attn, "query_latent") else None
        keep = self.indexer(x, q_lat if q_lat is not None else x, ctx, slot)
        bias = None
        if keep is not None:
            bias = torch.zeros(keep.shape, dtype=x.dtype, device=x.device).masked_fill_(~keep, float("-inf"))
            bias = bias.unsqueeze(1)                                               # [B, 1, T, S]
        extra = {"q_latent": q_lat} if q_lat is not None else {}
        return self.attn(x, ctx=ctx, cache=slot, bias=bias, **extra)
