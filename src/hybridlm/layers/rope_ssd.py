"""Cheems' SSD mixer: RoPE on C and B as the position source (the Wonderful Matrices paper, section 3.1,
appendix A and listing 4), instead of Mamba-2's causal conv + D skip.

X, B, C and dt come from their own projections of x (one fused matmul here, the same function); C and B
are rotated with the attention's rotary tables, so C_t · B_s depends only on t - s (appendix A); there is
no conv, no gate, no norm and no D. x [B, T, d_model] -> [B, T, d_model].

`position="conv"` swaps the position source back to Mamba-2's (causal depthwise conv + SiLU on X, B, C and the D
skip) and changes nothing else: the isolated pairing of the paper's table 1 claim, whose own comparison (Cheems' SSD
against the Mamba-2 block) also drops the gate and the norm.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cache import RecurrentCache
from ..context import SeqContext
from ..ops.flops import gla_flops
from ..ops.rope import apply_rope
from ..ops.ssd import ssd_chunked, ssd_step
from .init import init_A_log_, init_dt_bias_, normal_
from .short_conv import ShortConv


class RopeSSD(nn.Module):
    def __init__(self, d_model: int, *, layer_idx: int, d_state: int = 128, expand: int = 1, headdim: int = 64,
                 ngroups: int = 1, chunk_size: int = 64, bias: bool = False, dt_min: float = 1e-3,
                 dt_max: float = 0.1, dt_floor: float = 1e-4, A_init_range: tuple[float, float] = (1.0, 16.0),
                 rope_base: float = 10000.0, rope_interleaved: bool = False, position: str = "rope",
                 d_conv: int = 4):
        super().__init__()
        if position not in ("rope", "conv"):
            raise ValueError(f"position must be rope or conv, got {position!r}")
        self.position = position
        self.layer_idx, self.d_state, self.ngroups, self.headdim, self.chunk_size = \
            layer_idx, d_state, ngroups, headdim, chunk_size
        self.rope_base, self.rope_interleaved = rope_base, rope_interleaved
        self.d_inner = expand * d_model
        self.nheads = self.d_inner // headdim
        self.split = (self.d_inner, ngroups * d_state, ngroups * d_state, self.nheads)   # X, B, C, dt
        self.in_proj = nn.Linear(d_model, sum(self.split), bias=bias)
        self.dt_init, self.A_init_range = (dt_min, dt_max, dt_floor), A_init_range
        self.dt_bias = nn.Parameter(torch.empty(self.nheads))
        # A = -exp(A_log) < 0: the published Cheems code passes A = ones (a decay above 1 that makes the state
        # grow); we implement the paper's intent, a learned decay as in Mamba-2.
        self.A_log = nn.Parameter(torch.empty(self.nheads))
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias)
        if position == "conv":   # Mamba-2's position source: conv over X, B, C + D skip
            self.conv = ShortConv(sum(self.split[:3]), d_conv)
            self.D = nn.Parameter(torch.empty(self.nheads))

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float):
        """in_proj N(0, std), out_proj N(0, out_std), dt_bias and A_log as Mamba-2 (conv and D too, as Mamba-2)."""
        normal_(std, self.in_proj)
        normal_(out_std, self.out_proj)
        init_dt_bias_(self.dt_bias, *self.dt_init)
        init_A_log_(self.A_log, *self.A_init_range)
        if self.position == "conv":
            self.conv.reset_parameters()
            self.D.fill_(1.0)

    def sequence_flops(self) -> float:
        """Forward FLOPs per token of the SSD recurrence (ops/flops.py): B/C scores per group, outputs and state per
        head."""
        return gla_flops(self.nheads, self.d_state, self.headdim, score_heads=self.ngroups)

    def forward(self, x: Tensor, *, ctx: SeqContext, cache=None) -> Tensor:
        Bsz, T, _ = x.shape
        h, p, g, n = self.nheads, self.headdim, self.ngroups, self.d_state
        xBC, dt = self.in_proj(x).split((sum(self.split[:3]), h), dim=-1)
        slot = cache.layer(self.layer_idx, RecurrentCache) if cache is not None else None
        if self.position == "conv":
            xBC = F.silu(self.conv(xBC, ctx, slot))
        xs, Bm, Cm = xBC.split(self.split[:3], dim=-1)
        Bm, Cm = Bm.view(Bsz, T, g, n), Cm.view(Bsz, T, g, n)
        if self.position == "rope":
            cos, sin = ctx.rope(n, self.rope_base)                    # the attention's tables (same dim/base)
            Bm = apply_rope(Bm, cos, sin, interleaved=self.rope_interleaved)
            Cm = apply_rope(Cm, cos, sin, interleaved=self.rope_interleaved)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        if ctx.pad_mask is not None:
            dt = dt * ctx.pad_mask.unsqueeze(-1)                      # dt = 0: padding neither writes nor decays
        A = -torch.exp(self.A_log.float())
        xs = xs.reshape(Bsz, T, h, p)
        if slot is not None and T == 1 and slot.state is not None:
            y, slot.state = ssd_step(xs[:, 0], dt[:, 0], A, Bm[:, 0], Cm[:, 0], slot.state,
                                     inplace=not torch.is_grad_enabled())
            y = y.unsqueeze(1)
        else:
            y, final = ssd_chunked(xs, dt, A, Bm, Cm, chunk_size=self.chunk_size,
                                   initial_state=slot.state if slot is not None else None, resets=ctx.resets)
            if slot is not None:
                slot.state = final
        if self.position == "conv":
            y = torch.addcmul(y, xs, self.D.to(y.dtype).unsqueeze(-1))
        return self.out_proj(y.reshape(Bsz, T, self.d_inner))
