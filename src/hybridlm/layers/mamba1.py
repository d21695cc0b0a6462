"""The Mamba-1 block (Gu & Dao 2023) around the selective scan, as Mamba, Falcon-Mamba and Jamba use it.

in_proj(x) -> [x, z]; causal depthwise conv + SiLU on x; x_proj(x) -> [dt (low rank), B, C], optionally each
RMS-normed (Jamba: with weights; Falcon-Mamba: without); dt = softplus(dt_proj(dt)); y = scan(x, dt, A, B, C) + D·x;
out_proj(y · silu(z)). A is [d_inner, d_state] (S4D-real init A[c, i] = -(i+1)).
"""
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cache import RecurrentCache
from ..context import SeqContext
from ..ops.selective_scan import selective_scan_chunked, selective_scan_step
from .mamba2 import init_dt_bias
from .short_conv import cached_short_conv


def _rms(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm in float32 over the last dim (transformers' order: normalise, cast back, then scale)."""
    y = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y * weight if weight is not None else y


class Mamba1(nn.Module):
    """x [B, T, d_model] -> [B, T, d_model]; d_inner = expand · d_model channels of `d_state` states each.
    `bcdt_norm`: "none" | "weight" (RMSNorm with a learned weight on dt, B, C) | "plain" (without)."""

    def __init__(self, d_model: int, *, layer_idx: int, d_state: int = 16, d_conv: int = 4, expand: int = 2,
                 dt_rank: int | None = None, conv_bias: bool = True, bias: bool = False, bcdt_norm: str = "none",
                 norm_eps: float = 1e-6, chunk_size: int = 64, dt_min: float = 1e-3, dt_max: float = 0.1,
                 dt_floor: float = 1e-4):
        super().__init__()
        self.layer_idx, self.d_state, self.chunk_size, self.norm_eps = layer_idx, d_state, chunk_size, norm_eps
        self.d_inner = expand * d_model
        self.dt_rank = dt_rank or math.ceil(d_model / 16)
        self.in_proj = nn.Linear(d_model, 2 * self.d_inner, bias=bias)
        self.conv_weight = nn.Parameter(torch.empty(self.d_inner, d_conv))
        self.conv_bias = nn.Parameter(torch.zeros(self.d_inner)) if conv_bias else None
        bound = 1 / math.sqrt(d_conv)  # PyTorch's default Conv1d init for a depthwise kernel
        nn.init.uniform_(self.conv_weight, -bound, bound)
        if self.conv_bias is not None:
            nn.init.uniform_(self.conv_bias, -bound, bound)
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True)
        nn.init.uniform_(self.dt_proj.weight, -self.dt_rank ** -0.5, self.dt_rank ** -0.5)
        with torch.no_grad():
            self.dt_proj.bias.copy_(init_dt_bias(self.d_inner, dt_min, dt_max, dt_floor))
        self.dt_proj._keep_init = True
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1, dtype=torch.float32)).repeat(self.d_inner, 1))
        self.D = nn.Parameter(torch.ones(self.d_inner))
        for p in (self.A_log, self.D, self.dt_proj.bias):
            p._no_weight_decay = True
            p._keep_init = True
        self.bcdt_norm = bcdt_norm
        if bcdt_norm == "weight":
            self.dt_norm = nn.Parameter(torch.ones(self.dt_rank))
            self.b_norm = nn.Parameter(torch.ones(d_state))
            self.c_norm = nn.Parameter(torch.ones(d_state))
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias)
        self.out_proj._is_residual_out = True

    def forward(self, x: Tensor, *, ctx: SeqContext, cache=None) -> Tensor:
        B, T, _ = x.shape
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        mask = ctx.pad_mask.unsqueeze(-1).to(x.dtype) if ctx.pad_mask is not None else None
        if mask is not None:  # padded positions must not reach the conv taps or the state
            xs = xs * mask
        slot = cache.layer(self.layer_idx, RecurrentCache) if cache is not None else None
        xs = F.silu(cached_short_conv(xs, self.conv_weight, self.conv_bias, slot, ctx.resets))
        if mask is not None:
            xs = xs * mask
        dt, Bm, Cm = self.x_proj(xs).split((self.dt_rank, self.d_state, self.d_state), dim=-1)
        if self.bcdt_norm != "none":
            w = (self.dt_norm, self.b_norm, self.c_norm) if self.bcdt_norm == "weight" else (None,) * 3
            dt, Bm, Cm = (_rms(t, wt, self.norm_eps) for t, wt in zip((dt, Bm, Cm), w))
        dt = F.softplus(F.linear(dt, self.dt_proj.weight).float() + self.dt_proj.bias.float())
        if mask is not None:
            dt = dt * mask.float()  # dt = 0: the state passes a padded position unchanged
        A = -torch.exp(self.A_log.float())
        if slot is not None and T == 1 and slot.state is not None:
            y, slot.state = selective_scan_step(xs[:, 0], dt[:, 0], A, Bm[:, 0], Cm[:, 0], slot.state, self.D,
                                                inplace=not torch.is_grad_enabled())
            y = y.unsqueeze(1)
        else:
            y, final = selective_scan_chunked(xs, dt, A, Bm, Cm, self.D, chunk_size=self.chunk_size,
                                              initial_state=slot.state if slot is not None else None,
                                              resets=ctx.resets)
            if slot is not None:
                slot.state = final
        return self.out_proj(y * F.silu(z))
