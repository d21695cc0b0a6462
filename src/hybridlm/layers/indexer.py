"""DeepSeek-V3.2's lightning indexer and the sparse attention it drives
(the Transformer tutorial section 3.5, eq. 70).

The indexer scores every (query t, key s) pair cheaply,
    I[t, s] = sum_h w[t, h] · relu(q[t, h] · k[s]) / sqrt(D)      with w = W_w x / sqrt(H),
using H small index heads and ONE shared key (LayerNorm-ed, half-split RoPE on its first rope dims), and the
main attention of that query then only sees the `topk` keys with the highest I among those it may see
(causal, padding, document masks). With topk >= the number of keys the layer is exactly dense attention.
The selection is discrete, so the language-model loss gives the indexer no gradient. In training it learns as
DeepSeek-V3.2 trains it: from the KL divergence between the main attention's distribution (summed over heads,
L1-normalised) and softmax(I) (ops/indexer_loss.py), left in `indexer_kl` for the model to add to its loss.
The indexer reads detached inputs, so that KL trains only the indexer and the LM loss only the rest. Two stages:
`dense` (the warm-up: main attention over all keys, KL over all keys; train/stages.py freezes all but the
indexers) and sparse (main attention over the top-k, KL over the selected keys only).
DeepSeek's Hadamard rotation of the index q/k is not applied: it leaves the scores unchanged and serves FP8
quantisation of q/k, which hybridlm does not do (index scores are float32).
"""
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cache import IndexerCache
from ..context import SeqContext
from ..ops.attention import attention_mask
from ..ops.indexer_loss import indexer_kl
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

    fsdp_unit = True   # sharded on its own (train/parallel.py): FSDP2 gathers it for the backward of its output,
                       # the only path of its KL's gradient (the warm-up's frozen block output carries none)

    def init_weights(self, std: float, out_std: float):
        normal_(std, self.wq, self.wk, self.w)
        reset_(self.k_norm)

    def forward(self, x: Tensor, q_in: Tensor, ctx: SeqContext, slot: IndexerCache | None = None) -> Tensor:
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

    @staticmethod
    def select(idx: Tensor, topk: int) -> Tensor | None:
        """Selected keys [B, T, S] bool from scores [B, T, S], or None when every key is kept (topk >= S)."""
        if topk >= idx.shape[-1]:
            return None
        # a stable sort breaks ties (relu zeros) by key position, so prefill and decode pick the same keys
        top = torch.sort(idx, dim=-1, descending=True, stable=True).indices[..., :topk]
        return torch.zeros_like(idx, dtype=torch.bool).scatter_(-1, top, True)

    @torch.no_grad()
    def selection(self, x: Tensor, q_in: Tensor, ctx: SeqContext, slot: IndexerCache | None = None) -> Tensor | None:
        """Selected keys [B, T, S] bool, or None when every key is kept (topk >= S)."""
        return self.select(self(x, q_in, ctx, slot), self.topk)


def _hide(keep: Tensor | None, dtype) -> Tensor | None:
    """Selected keys [B, T, S] bool -> additive attention bias [B, 1, T, S] (-inf on the rest)."""
    if keep is None:
        return None
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf")).unsqueeze(1)


class IndexedAttention(nn.Module):
    """Token mixer `I`: an attention module (MLA or plain attention, taking `bias=` and `need_weights=`) restricted
    to the keys its lightning indexer selects. x [B, T, d_model] -> [B, T, d_model].

    distill: in training (no cache) compute the indexer's KL into `indexer_kl` (a [] tensor, None otherwise).
    dense: the warm-up stage: the main attention sees every key and the KL covers them all."""

    def __init__(self, attn: nn.Module, indexer: LightningIndexer, *, layer_idx: int, distill: bool = True):
        super().__init__()
        self.attn, self.indexer, self.layer_idx = attn, indexer, layer_idx
        self.distill, self.dense = distill, False
        self.indexer_kl: Tensor | None = None

    def init_weights(self, std: float, out_std: float):
        self.attn.init_weights(std, out_std)
        self.indexer.init_weights(std, out_std)

    def forward(self, x: Tensor, *, ctx: SeqContext, cache=None) -> Tensor:
        slot = cache.layer(self.layer_idx, IndexerCache) if cache is not None else None
        q_lat = self.attn.query_latent(x) if hasattr(self.attn, "query_latent") else None
        q_in = q_lat if q_lat is not None else x
        extra = {"q_latent": q_lat} if q_lat is not None else {}
        self.indexer_kl = None
        if not (self.distill and self.training and cache is None):
            keep = self.indexer.selection(x, q_in, ctx, slot)            # (which also fills its key cache)
            keep = None if self.dense else keep
            return self.attn(x, ctx=ctx, cache=slot, bias=_hide(keep, x.dtype), **extra)
        idx = self.indexer(x.detach(), q_in.detach(), ctx)               # the KL's gradient stops at the indexer
        keep = None if self.dense else self.indexer.select(idx.detach(), self.indexer.topk)
        y, target = self.attn(x, ctx=ctx, bias=_hide(keep, x.dtype), need_weights=True, **extra)
        if keep is not None:
            idx = idx.masked_fill(~keep, float("-inf"))                  # sparse stage: the KL over S_t only
        self.indexer_kl = indexer_kl(target, idx)
        return y
