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
from .init import init_dt_bias_, normal_
from .short_conv import ShortConv


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
        self.dt_init = (dt_min, dt_max, dt_floor)
        self.in_proj = nn.Linear(d_model, 2 * self.d_inner, bias=bias)
        self.conv = ShortConv(self.d_inner, d_conv, "uniform" if conv_bias else None)
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(self.d_inner, d_state))
        self.D = nn.Parameter(torch.empty(self.d_inner))
        self.bcdt_norm = bcdt_norm
        if bcdt_norm == "weight":
            self.dt_norm = nn.Parameter(torch.empty(self.dt_rank))
            self.b_norm = nn.Parameter(torch.empty(d_state))
            self.c_norm = nn.Parameter(torch.empty(d_state))
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias)

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float):
        """Mamba-1's rules: dt_proj U(±dt_rank^-0.5) with the dt bias of Mamba-2, S4D-real A[c, i] = -(i+1), D = 1;
        the other projections N(0, std) (out_proj: out_std), the conv as PyTorch's Conv1d, the norms 1."""
        normal_(std, self.in_proj, self.x_proj)
        normal_(out_std, self.out_proj)
        self.conv.reset_parameters()
        nn.init.uniform_(self.dt_proj.weight, -self.dt_rank ** -0.5, self.dt_rank ** -0.5)
        init_dt_bias_(self.dt_proj.bias, *self.dt_init)
        self.A_log.copy_(torch.arange(1, self.d_state + 1, dtype=self.A_log.dtype, device=self.A_log.device).log())
        self.D.fill_(1.0)
        if self.bcdt_norm == "weight":
            for w in (self.dt_norm, self.b_norm, self.c_norm):
                w.fill_(1.0)

    def forward(self, x: Tensor, *, ctx: SeqContext, cache=None) -> Tensor:
        B, T, _ = x.shape
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        mask = ctx.pad_mask.unsqueeze(-1).to(x.dtype) if ctx.pad_mask is not None else None
        slot = cache.layer(self.layer_idx, RecurrentCache) if cache is not None else None
        xs = F.silu(self.conv(xs, ctx, slot))
        if mask is not None:  # padded positions must not reach the state
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
