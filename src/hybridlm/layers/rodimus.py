"""The Rodimus block (the Rodimus* paper, section 3.1, figure 2b): a GLU whose value path runs gated
linear attention with data-dependent tempered selection (DDTS), with the released code's conventions.

    x, z = fc(h)                                  GLU halves, width m = expand · d_model
    x' = silu(ShortConv(x))
    q, k = proj(x')                               n each; k L2-normalised, q scaled by 1/√n in the op
    g = softplus(proj(x')), τ = sigmoid(proj(x'))   n each (eq. 9)
    log α = -g ⊙ τ,  α̂ = g^τ                      decay of the key (state) dim; input gate on k
    β̂ = sigmoid(x W1 W2 + b)                      rank ℓ, on the pre-conv x (eq. 10); value u = β̂ ⊙ x
    S_t = diag(α_t) S_{t-1} + (α̂_t ⊙ k_t)ᵀ u_t,  o_t = q_t S_t / √n + d ⊙ x'_t         (eq. 11)
    y = out_proj(RMSNorm(o ⊙ silu(z)))

One head: the state is n × m, float32. The input gate is g^τ exactly, floored only at float32's smallest normal
to keep log g finite (a decay near 1 means g ~ 1e-9). Ablations: use_g=False makes g a learned constant softplus(b_g)
(no selection by the input), use_tau=False sets τ = 1, use_beta_hat=False sets β̂ = 1 (table 11);
product_decay=True also decays the value dim by β_t = 1 - β̂_t (eq. 7, table 12; the paper leaves β_t's
form open, 1 - β̂ makes it the negative correlate of β̂ as α is of α̂).
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cache import RecurrentCache
from ..context import SeqContext
from ..ops.flops import gla_flops
from ..ops.gla import gla_chunked, gla_step
from ..ops.gla_product import gla_product_chunked, gla_product_step
from ..ops.norm import gated_rms_norm
from .init import init_dt_bias_, normal_
from .short_conv import ShortConv


@torch.no_grad()
def _gate_init_(lin: nn.Linear | None):
    """Released-code init for the q/k, gate and β̂ projections: xavier-uniform with gain 2^-2.5, zero bias."""
    if lin is not None:
        nn.init.xavier_uniform_(lin.weight, gain=2 ** -2.5)
        if lin.bias is not None:
            nn.init.zeros_(lin.bias)


class Rodimus(nn.Module):
    """x [B, T, d_model] -> [B, T, d_model]. Cache slot: RecurrentCache(conv [B, d_conv-1, m], state [B, 1, n, m])."""

    def __init__(self, d_model: int, *, layer_idx: int, d_state: int = 64, expand: int = 2,
                 d_inner: int | None = None, d_conv: int = 4,
                 rank: int | None = None, chunk_size: int = 64, use_g: bool = True, use_tau: bool = True,
                 use_beta_hat: bool = True, product_decay: bool = False, norm_eps: float = 1e-5,
                 dt_min: float = 1e-3, dt_max: float = 0.1, dt_floor: float = 1e-4):
        super().__init__()
        m, n = d_inner or expand * d_model, d_state
        self.layer_idx, self.d_inner, self.d_state, self.chunk_size = layer_idx, m, n, chunk_size
        self.use_g, self.use_tau, self.use_beta_hat, self.product_decay = use_g, use_tau, use_beta_hat, product_decay
        self.norm_eps, self.dt_init = norm_eps, (dt_min, dt_max, dt_floor)
        self.fc = nn.Linear(d_model, 2 * m, bias=False)
        self.conv = ShortConv(m, d_conv, "uniform")
        self.qk_proj = nn.Linear(m, 2 * n, bias=False)
        self.gate_proj = nn.Linear(m, n * (use_g + use_tau), bias=False) if use_g or use_tau else None
        self.g_bias = nn.Parameter(torch.empty(n))
        self.tau_bias = nn.Parameter(torch.empty(n)) if use_tau else None
        if use_beta_hat:
            self.rank = rank or min(max(d_model // 64, 16), m)
            self.beta_down = nn.Linear(m, self.rank, bias=False)
            self.beta_up = nn.Linear(self.rank, m, bias=True)
        self.residual_weight = nn.Parameter(torch.empty(m))             # feed-through d
        self.norm_weight = nn.Parameter(torch.empty(m))
        self.out_proj = nn.Linear(m, d_model, bias=False)

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float):
        """fc N(0, std), out_proj N(0, out_std); the gate projections as released (`_gate_init_`); g's bias:
        softplus⁻¹ of dt log-uniform in [dt_min, dt_max]; τ's bias: logit of U(1/16, 0.9); d and the norm 1."""
        normal_(std, self.fc)
        normal_(out_std, self.out_proj)
        self.conv.reset_parameters()
        for lin in (self.qk_proj, self.gate_proj, getattr(self, "beta_down", None), getattr(self, "beta_up", None)):
            _gate_init_(lin)
        init_dt_bias_(self.g_bias, *self.dt_init)
        if self.tau_bias is not None:
            self.tau_bias.uniform_(1 / 16, 0.9).logit_()
        self.residual_weight.fill_(1.0)
        self.norm_weight.fill_(1.0)

    def _gates(self, xc: Tensor) -> tuple[Tensor, Tensor]:
        """log α (≤ 0) and α̂ = g^τ, both [B, T, n] float32, from the post-conv x' [B, T, m]."""
        n, f32 = self.d_state, torch.promote_types(xc.dtype, torch.float32)
        raw = self.gate_proj(xc).to(f32) if self.gate_proj is not None else None
        if self.use_g:
            g = F.softplus(raw[..., :n] + self.g_bias.to(f32))
        else:
            g = F.softplus(self.g_bias.to(f32)).expand(*xc.shape[:-1], n)
        if not self.use_tau:
            return -g, g
        tau = torch.sigmoid(raw[..., -n:] + self.tau_bias.to(f32))
        # g^τ exactly (decay near 1 means g ~ 1e-9 and below: a coarse floor such as 1e-6 changes the logits); the
        # floor at the smallest normal only keeps log g, hence the gradient in τ, finite where softplus underflows
        return -g * tau, torch.pow(g.clamp(min=torch.finfo(g.dtype).tiny), tau)

    def sequence_flops(self) -> float:
        """Forward FLOPs per token of the one-head GLA (ops/flops.py): key dim d_state, value dim d_inner."""
        return gla_flops(1, self.d_state, self.d_inner)

    def forward(self, x: Tensor, *, ctx: SeqContext, cache=None) -> Tensor:
        B, T, _ = x.shape
        n = self.d_state
        slot = cache.layer(self.layer_idx, RecurrentCache) if cache is not None else None
        step = slot is not None and T == 1 and slot.state is not None
        xi, z = self.fc(x).chunk(2, dim=-1)
        mask = ctx.pad_mask.unsqueeze(-1) if ctx.pad_mask is not None else None
        if mask is not None:  # padded positions must not reach the state through u = β̂ ⊙ x (nor the conv taps)
            xi = xi * mask.to(xi.dtype)
        xc = F.silu(self.conv(xi, ctx, slot))

        q, k = self.qk_proj(xc).split(n, dim=-1)
        log_a, in_gate = self._gates(xc)
        k = F.normalize(k.to(in_gate.dtype), dim=-1, eps=1e-12) * in_gate
        u, log_b = xi, None
        if self.use_beta_hat:
            logit = self.beta_up(self.beta_down(xi))
            u = torch.sigmoid(logit) * xi
            if self.product_decay:
                log_b = F.logsigmoid(-logit.to(log_a.dtype))            # log β = log(1 - β̂)
        if mask is not None:  # zero decay (α = β = 1) and zero input: the state passes padding unchanged
            log_a = log_a * mask
            log_b = log_b * mask if log_b is not None else None

        q, k, u, log_a = (t.unsqueeze(2) for t in (q, k, u, log_a))    # one head: [B, T, 1, ·]
        log_b = log_b.unsqueeze(2) if log_b is not None else None
        scale = n ** -0.5
        if step:
            if log_b is None:
                o, slot.state = gla_step(q[:, 0], k[:, 0], u[:, 0], log_a[:, 0], slot.state, scale=scale)
            else:
                o, slot.state = gla_product_step(q[:, 0], k[:, 0], u[:, 0], log_a[:, 0], log_b[:, 0], slot.state,
                                                 scale=scale)
            o = o.unsqueeze(1)
        else:
            init = slot.state if slot is not None else None
            if log_b is None:
                o, final = gla_chunked(q, k, u, log_a, scale=scale, initial_state=init, resets=ctx.resets,
                                       chunk_size=self.chunk_size)
            else:
                o, final = gla_product_chunked(q, k, u, log_a, log_b, scale=scale, initial_state=init,
                                               resets=ctx.resets)
            if slot is not None:
                slot.state = final
        o = o.squeeze(2) + xc * self.residual_weight.to(xc.dtype)
        y = gated_rms_norm(o, gate=z, weight=self.norm_weight, eps=self.norm_eps)
        return self.out_proj(y)
