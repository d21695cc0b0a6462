"""Cross-domain mixture of experts, CDMoE (the Wonderful Matrices paper, section 3.3, eq. 5, listing 8; and the
published Doge form). A shared MLP φ holds the common knowledge; `num_experts` single-neuron private
experts (a down row and an up row each) are retrieved per token with product keys over √N × √N key pairs.

forms
  "sum"      eq. 5 left:  y = Σ_i e_i(x) + φ(x)            experts and their queries read x
  "compose"  eq. 5 right: y = Σ_i e_i(φ(x)) + φ(x)         experts and their queries read φ(x); the
             trailing + φ(x) is the paper's own algorithm (section 3.3, last equation) and listing 8
  "doge"     the published form: a router over the key pairs (2·√N logits per head), softmax weights over
             the top `top_k`, private experts on x plus a shared *gated* MLP.
The paper forms use φ(x) = σ(x W) V (not gated, section 3.3), a query projection of d_ret per head against
learned keys [heads, √N, 2, d_ret/2], and expert scores σ(⟨z, down_i⟩ · s_i) (listing 8).

Routing is per token: transformers' DogeCDMoE views the router logits as (2, tokens, √N), which mixes
tokens; here each token's two score vectors come from its own logits, so a token's output depends on that
token only. x [B, T, d] -> [B, T, d].
"""
import math

import torch
from torch import Tensor, nn

from ..ops.moe import expert_neurons, product_key_topk
from .init import normal_
from .mlp import ACTIVATIONS, MLP


class CDMoE(nn.Module):
    def __init__(self, d_model: int, hidden: int, *, num_experts: int, top_k: int, heads: int = 1,
                 d_ret: int = 128, form: str = "doge", act: str = "silu", bias: bool = False):
        super().__init__()
        self.form, self.top_k, self.heads, self.d_ret = form, top_k, heads, d_ret
        self.n_keys = math.isqrt(num_experts)
        self.act = ACTIVATIONS[act]
        self.shared = MLP(d_model, hidden, act=act, gated=form == "doge", bias=bias)
        if form == "doge":
            self.router = nn.Linear(d_model, heads * 2 * self.n_keys, bias=False)
        else:
            self.queries = nn.Linear(d_model, heads * d_ret, bias=False)
            self.keys = nn.Parameter(torch.empty(heads, self.n_keys, 2, d_ret // 2))
        self.down_embed = nn.Embedding(num_experts, d_model)    # private experts: one neuron each
        self.up_embed = nn.Embedding(num_experts, d_model)

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float):
        """The shared MLP by its rules, router / queries and the expert rows N(0, std), product keys N(0, 2/d_ret)."""
        self.shared.init_weights(std, out_std)
        normal_(std, getattr(self, "router", None), getattr(self, "queries", None), self.down_embed, self.up_embed)
        if hasattr(self, "keys"):
            nn.init.normal_(self.keys, 0.0, self.keys.shape[-1] ** -0.5)

    def retrieve(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """Product-key top-k per head. z [N, d] -> (scores [N, heads, k], expert ids [N, heads, k])."""
        N = z.shape[0]
        if self.form == "doge":
            sx, sy = self.router(z).view(N, 2, self.heads, self.n_keys).unbind(1)
        else:
            q = self.queries(z).view(N, 2, self.heads, self.d_ret // 2)
            sx, sy = torch.einsum("nphr,hkpr->pnhk", q, self.keys).unbind(0)
        return product_key_topk(sx, sy, self.top_k)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        phi = self.shared(x)
        if self.form == "doge":
            scores, ids = self.retrieve(x)
            gates = torch.softmax(scores.float(), dim=-1).to(x.dtype)
            y = expert_neurons(x, self.down_embed.weight, self.up_embed.weight, ids.flatten(1), gates.flatten(1),
                               act=self.act)
        else:
            z = x if self.form == "sum" else phi
            scores, ids = self.retrieve(z)                  # expert i: act(<z, down_i> · score_i) · up_i
            y = expert_neurons(z, self.down_embed.weight, self.up_embed.weight, ids.flatten(1), act=self.act,
                               scale=scores.flatten(1))
        return y.add_(phi).view(shape)                     # in place: y is a fresh buffer no one saved
