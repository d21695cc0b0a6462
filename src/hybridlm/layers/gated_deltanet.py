"""Gated DeltaNet as Qwen3-Next uses it (letter G): fused projections, a depthwise causal short conv over q, k, v,
then the gated delta rule (ops/delta_rule.py) with a scalar decay per value head.

    q, k, v, z = in_proj_qkvz(x)      per key head: [q (dk), k (dk), v (r·dv), z (r·dv)], r = value heads / key heads
    b, a       = in_proj_ba(x)        per key head: [b (r), a (r)]
    q, k, v    = silu(ShortConv([q; k; v]))                     one depthwise conv over all q, then k, then v channels
    q, k       = l2_norm(q), l2_norm(k), each shared by its group of r value heads
    g = -exp(A_log) · softplus(a + dt_bias),  β = sigmoid(b)    [B, T, value heads], float32
    o = delta_rule(q, k, v, β, g)                               scale 1/√dk, state [value heads, dk, dv] float32
    y = out_proj(weight ⊙ RMSNorm(o) ⊙ silu(z))                 the norm per value head

The projection layouts are Qwen3-Next's (grouped per key head), so its checkpoints convert without copies.
Padding: zero conv input, g = 0 and β = 0 at pad positions, so the state passes them unchanged.
"""
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cache import RecurrentCache
from ..context import SeqContext
from ..ops.delta_rule import delta_rule, delta_rule_step, expand_key_heads
from ..ops.flops import delta_rule_flops
from ..ops.norm import gated_rms_norm, l2_norm
from .init import init_A_log_, init_dt_bias_, normal_
from .short_conv import ShortConv


class GatedDeltaNet(nn.Module):
    """x [B, T, d_model] -> [B, T, d_model]. Cache slot: RecurrentCache(conv [B, d_conv-1, 2·Hk·dk + Hv·dv],
    state [B, Hv, dk, dv] float32)."""

    def __init__(self, d_model: int, *, layer_idx: int, k_heads: int, v_heads: int, k_dim: int, v_dim: int,
                 d_conv: int = 4, chunk_size: int = 64, norm_eps: float = 1e-6,
                 dt_min: float = 1e-3, dt_max: float = 0.1, dt_floor: float = 1e-4):
        super().__init__()
        self.layer_idx, self.chunk_size, self.norm_eps = layer_idx, chunk_size, norm_eps
        self.hk, self.hv, self.dk, self.dv = k_heads, v_heads, k_dim, v_dim
        self.r = v_heads // k_heads
        self.in_proj_qkvz = nn.Linear(d_model, k_heads * (2 * k_dim + 2 * self.r * v_dim), bias=False)
        self.in_proj_ba = nn.Linear(d_model, 2 * v_heads, bias=False)
        self.dt_init = (dt_min, dt_max, dt_floor)
        self.conv = ShortConv(2 * k_heads * k_dim + v_heads * v_dim, d_conv, bias=None)
        self.dt_bias = nn.Parameter(torch.empty(v_heads))
        self.A_log = nn.Parameter(torch.empty(v_heads))
        self.norm_weight = nn.Parameter(torch.empty(v_dim))
        self.out_proj = nn.Linear(v_heads * v_dim, d_model, bias=False)

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float):
        """Projections N(0, std) (out_proj: out_std), conv as PyTorch's Conv1d, dt_bias as Mamba-2,
        A_log = log U(1, 16), norm 1."""
        normal_(std, self.in_proj_qkvz, self.in_proj_ba)
        normal_(out_std, self.out_proj)
        self.conv.reset_parameters()
        init_dt_bias_(self.dt_bias, *self.dt_init)
        init_A_log_(self.A_log, 1.0, 16.0)
        self.norm_weight.fill_(1.0)

    def sequence_flops(self) -> float:
        """Forward FLOPs per token of the gated delta rule over the value heads (ops/flops.py)."""
        return delta_rule_flops(self.hv, self.dk, self.dv)

    def forward(self, x: Tensor, *, ctx: SeqContext, cache=None) -> Tensor:
        B, T, _ = x.shape
        hk, hv, dk, dv, r = self.hk, self.hv, self.dk, self.dv, self.r
        slot = cache.layer(self.layer_idx, RecurrentCache) if cache is not None else None
        step = slot is not None and T == 1 and slot.state is not None
        q, k, v, z = self.in_proj_qkvz(x).view(B, T, hk, -1).split((dk, dk, r * dv, r * dv), -1)
        b, a = self.in_proj_ba(x).view(B, T, hk, 2 * r).split((r, r), -1)
        qkv = torch.cat((q.reshape(B, T, hk * dk), k.reshape(B, T, hk * dk), v.reshape(B, T, hv * dv)), -1)
        mask = ctx.pad_mask.unsqueeze(-1) if ctx.pad_mask is not None else None
        qkv = F.silu(self.conv(qkv, ctx, slot))
        q, k, v = qkv.split((hk * dk, hk * dk, hv * dv), -1)
        q, k = l2_norm(q.view(B, T, hk, dk)), l2_norm(k.view(B, T, hk, dk))   # each serves r value heads
        v = v.reshape(B, T, hv, dv)
        beta = torch.sigmoid(b.reshape(B, T, hv).float())
        g = -torch.exp(self.A_log.float()) * F.softplus(a.reshape(B, T, hv).float() + self.dt_bias.float())
        if mask is not None:          # no decay and no write: the state passes padding unchanged
            beta, g = beta * mask, g * mask
        if step:
            q, k = expand_key_heads(q, k, hv)
            o, slot.state = delta_rule_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0], g[:, 0], slot.state)
            o = o.unsqueeze(1)
        else:
            o, final = delta_rule(q, k, v, beta, g, initial_state=slot.state if slot is not None else None,
                                  resets=ctx.resets, chunk_size=self.chunk_size)
            if slot is not None:
                slot.state = final
        return self._output(o, z, x)

    def _output(self, o: Tensor, z: Tensor, x: Tensor) -> Tensor:
        """o [B, T, hv, dv] -> out_proj(RMSNorm(o) · silu(z)) [B, T, d_model]."""
        B, T = x.shape[:2]
        o, z = o.to(x.dtype), z.reshape(B, T, self.hv, self.dv)
        o = gated_rms_norm(o, gate=z, weight=self.norm_weight, eps=self.norm_eps, norm_before_gate=True)
        return self.out_proj(o.reshape(B, T, self.hv * self.dv))
