"""Kimi Delta Attention (KDA), the linear-attention layer of Kimi-Linear, as transformers' `kimi_linear` computes it:
the gated delta rule with a per-key-channel forget gate (ops/delta_rule.py).

    q, k, v = silu(ShortConv(W_q x)), silu(ShortConv(W_k x)), silu(ShortConv(W_v x))     [B, T, H, D] each
    q, k    = q / sqrt(|q|² + 1e-6), k / sqrt(|k|² + 1e-6)                                 (FLA's l2norm)
    log α   = -exp(A_log_h) · softplus(f_b(f_a(x)) + dt_bias)                              [B, T, H, D], <= 0
    β       = sigmoid(b(x))                                                                [B, T, H]
    o       = delta_rule(q, k, v, β, log α), scale 1/√D
    y       = o_proj(RMSNorm_D(o) · sigmoid(g_b(g_a(x))))         norm per head, one weight [D] shared by heads

f and g are low-rank (rank = head_dim in the release). Pad positions leave the state unchanged: their conv input,
log α and β are zero. Cache slot: RecurrentCache(conv [B, d_conv-1, 3·H·D], state [B, H, D, D] float32).
"""
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cache import RecurrentCache
from ..context import SeqContext
from ..ops.delta_rule import delta_rule, delta_rule_step
from ..ops.flops import delta_rule_flops
from ..ops.norm import l2_norm
from .init import init_A_log_, init_dt_bias_, normal_
from .short_conv import ShortConv


class KimiDeltaAttention(nn.Module):
    """x [B, T, d_model] -> [B, T, d_model]."""

    def __init__(self, d_model: int, *, layer_idx: int, n_heads: int, head_dim: int, d_conv: int = 4,
                 rank: int | None = None, norm_eps: float = 1e-5, dt_min: float = 1e-3, dt_max: float = 0.1,
                 dt_floor: float = 1e-4):
        super().__init__()
        H, D = n_heads, head_dim
        r = rank or D
        self.layer_idx, self.n_heads, self.head_dim, self.norm_eps = layer_idx, H, D, norm_eps
        self.dt_init = (dt_min, dt_max, dt_floor)
        self.qkv = nn.Linear(d_model, 3 * H * D, bias=False)            # rows [q; k; v]
        # depthwise conv over the 3·H·D channels = separate short convs of q, k and v (no bias, as released)
        self.conv = ShortConv(3 * H * D, d_conv, bias=None)
        self.f_a = nn.Linear(d_model, r, bias=False)
        self.f_b = nn.Linear(r, H * D, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H * D))
        self.b_proj = nn.Linear(d_model, H, bias=False)
        self.g_a = nn.Linear(d_model, r, bias=False)
        self.g_b = nn.Linear(r, H * D, bias=False)
        self.norm_weight = nn.Parameter(torch.empty(D))
        self.o_proj = nn.Linear(H * D, d_model, bias=False)

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float):
        """Projections N(0, std) (o_proj: out_std), conv as PyTorch's Conv1d, A_log = log U(1, 16), dt_bias as
        Mamba-2 (one per key channel), norm 1."""
        normal_(std, self.qkv, self.f_a, self.f_b, self.b_proj, self.g_a, self.g_b)
        normal_(out_std, self.o_proj)
        self.conv.reset_parameters()
        init_A_log_(self.A_log, 1.0, 16.0)
        init_dt_bias_(self.dt_bias, *self.dt_init)
        self.norm_weight.fill_(1.0)

    def sequence_flops(self) -> float:
        """Forward FLOPs per token of the per-channel gated delta rule (ops/flops.py)."""
        return delta_rule_flops(self.n_heads, self.head_dim, self.head_dim)

    def forward(self, x: Tensor, *, ctx: SeqContext, cache=None) -> Tensor:
        B, T, _ = x.shape
        H, D = self.n_heads, self.head_dim
        slot = cache.layer(self.layer_idx, RecurrentCache) if cache is not None else None
        step = slot is not None and T == 1 and slot.state is not None
        qkv = self.qkv(x)
        mask = ctx.pad_mask.unsqueeze(-1) if ctx.pad_mask is not None else None
        qkv = F.silu(self.conv(qkv, ctx, slot))
        q, k, v = qkv.view(B, T, 3, H, D).unbind(2)
        q, k = l2_norm(q), l2_norm(k)                                  # float32 (at least), as FLA

        f32 = torch.promote_types(x.dtype, torch.float32)
        f = self.f_b(self.f_a(x)).to(f32) + self.dt_bias.to(f32)
        log_a = -torch.exp(self.A_log.to(f32))[:, None] * F.softplus(f.view(B, T, H, D))
        beta = torch.sigmoid(self.b_proj(x).to(f32))
        if mask is not None:   # zero decay and zero write: the state passes padding unchanged
            log_a = log_a * mask.unsqueeze(-1)
            beta = beta * mask

        scale = D ** -0.5
        if step:
            o, slot.state = delta_rule_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0], log_a[:, 0], slot.state,
                                            scale=scale)
            o = o.unsqueeze(1)
        else:
            o, final = delta_rule(q, k, v, beta, log_a, scale=scale,
                                  initial_state=slot.state if slot is not None else None, resets=ctx.resets)
            if slot is not None:
                slot.state = final
        return self._output(o, x)

    def _output(self, o: Tensor, x: Tensor) -> Tensor:
        """o [B, T, H, D] -> o_proj(RMSNorm(o) · sigmoid(gate)) [B, T, d_model], the norm per head."""
        B, T = x.shape[:2]
        H, D = self.n_heads, self.head_dim
        f32 = torch.promote_types(x.dtype, torch.float32)
        gate = self.g_b(self.g_a(x)).view(B, T, H, D)
        # gated RMSNorm per head: norm in float32, weight, then sigmoid output gate
        of = o.to(f32)
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.norm_weight.to(f32)
        y = (of * torch.sigmoid(gate.to(f32))).to(x.dtype)
        return self.o_proj(y.reshape(B, T, H * D))
