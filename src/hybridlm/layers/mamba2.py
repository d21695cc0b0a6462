"""The Mamba-2 block (004_f196d22cc7fe6dbe.txt, section 7.1) around the SSD operator.

in_proj(x) -> [z (gate), xBC, dt]; causal depthwise conv + SiLU on xBC; SSD over heads with D skip;
y = out_proj(gated_rms_norm(y, z)) with the norm grouped per SSD group.
"""
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cache import RecurrentCache
from ..context import SeqContext
from ..ops.norm import gated_rms_norm
from ..ops.ssd import ssd_chunked, ssd_step
from .short_conv import cached_short_conv


def init_dt_bias(n: int, dt_min: float, dt_max: float, floor: float) -> Tensor:
    """softplus⁻¹ of dt drawn log-uniformly in [dt_min, dt_max] (floored), so softplus(dt_bias) = dt."""
    dt = torch.exp(torch.rand(n) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=floor)
    return dt + torch.log(-torch.expm1(-dt))


class Mamba2(nn.Module):
    """x [B, T, d_model] -> [B, T, d_model]; heads of `headdim`, `ngroups` groups of B/C of `d_state`."""

    def __init__(self, d_model: int, *, layer_idx: int, d_state: int = 128, d_conv: int = 4, expand: int = 2,
                 headdim: int = 64, ngroups: int = 1, chunk_size: int = 64, bias: bool = False,
                 conv_bias: bool = True, dt_min: float = 1e-3, dt_max: float = 0.1, dt_floor: float = 1e-4,
                 A_init_range: tuple[float, float] = (1.0, 16.0), norm_eps: float = 1e-5, dt_clamp_min: float = 0.0):
        super().__init__()
        self.layer_idx, self.d_state, self.ngroups, self.headdim, self.chunk_size = \
            layer_idx, d_state, ngroups, headdim, chunk_size
        self.d_inner = expand * d_model
        self.nheads = self.d_inner // headdim
        self.norm_eps, self.dt_clamp_min = norm_eps, dt_clamp_min
        conv_dim = self.d_inner + 2 * ngroups * d_state
        self.in_proj = nn.Linear(d_model, 2 * self.d_inner + 2 * ngroups * d_state + self.nheads, bias=bias)
        self.conv_weight = nn.Parameter(torch.empty(conv_dim, d_conv))
        self.conv_bias = nn.Parameter(torch.zeros(conv_dim)) if conv_bias else None
        bound = 1 / math.sqrt(d_conv)  # PyTorch's default Conv1d init for a depthwise kernel
        nn.init.uniform_(self.conv_weight, -bound, bound)
        if self.conv_bias is not None:
            nn.init.uniform_(self.conv_bias, -bound, bound)
        self.dt_bias = nn.Parameter(init_dt_bias(self.nheads, dt_min, dt_max, dt_floor))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.nheads).uniform_(*A_init_range)))
        self.D = nn.Parameter(torch.ones(self.nheads))
        for p in (self.dt_bias, self.A_log, self.D):
            p._no_weight_decay = True
            p._keep_init = True
        self.norm_weight = nn.Parameter(torch.ones(self.d_inner))
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias)
        self.out_proj._is_residual_out = True

    def forward(self, x: Tensor, *, ctx: SeqContext, cache=None) -> Tensor:
        B, T, _ = x.shape
        h, p, g, n = self.nheads, self.headdim, self.ngroups, self.d_state
        z, xBC, dt = self.in_proj(x).split((self.d_inner, self.d_inner + 2 * g * n, h), dim=-1)
        mask = ctx.pad_mask.unsqueeze(-1).to(x.dtype) if ctx.pad_mask is not None else None
        if mask is not None:  # padded positions must not reach the conv taps or the state
            xBC = xBC * mask
        slot = cache.layer(self.layer_idx, RecurrentCache) if cache is not None else None
        xBC = cached_short_conv(xBC, self.conv_weight, self.conv_bias, slot, ctx.resets)
        xBC = F.silu(xBC)
        if mask is not None:
            xBC = xBC * mask
        xs, Bm, Cm = xBC.split((self.d_inner, g * n, g * n), dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        if self.dt_clamp_min:  # Zamba2's time_step_min: a floor on every step (before padding zeroes dt)
            dt = dt.clamp(min=self.dt_clamp_min)
        if mask is not None:
            dt = dt * mask.float()  # dt = 0: the state passes a padded position unchanged
        A = -torch.exp(self.A_log.float())
        xs = xs.view(B, T, h, p)
        if slot is not None and T == 1 and slot.state is not None:
            y, slot.state = ssd_step(xs[:, 0], dt[:, 0], A, Bm.view(B, g, n), Cm.view(B, g, n), slot.state,
                                     inplace=not torch.is_grad_enabled())
            y = y.unsqueeze(1)
        else:
            y, final = ssd_chunked(xs, dt, A, Bm.view(B, T, g, n), Cm.view(B, T, g, n), chunk_size=self.chunk_size,
                                   initial_state=slot.state if slot is not None else None, resets=ctx.resets)
            if slot is not None:
                slot.state = final
        y = torch.addcmul(y, xs, self.D.to(y.dtype).unsqueeze(-1))          # D skip connection
        y = gated_rms_norm(y.reshape(B, T, self.d_inner), z, self.norm_weight,
                           group_size=self.d_inner // g, eps=self.norm_eps)
        return self.out_proj(y)
