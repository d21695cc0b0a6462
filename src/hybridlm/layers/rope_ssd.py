"""Cheems' SSD mixer: RoPE on C and B as the position source (000_4348bfb066d62081.txt, section 3.1,
appendix A and listing 4), instead of Mamba-2's causal conv + D skip.

X, B, C and dt come from their own projections of x (one fused matmul here, the same function); C and B
are rotated with the attention's rotary tables, so C_t · B_s depends only on t - s (appendix A); there is
no conv, no gate, no norm and no D. x [B, T, d_model] -> [B, T, d_model].
"""
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cache import RecurrentCache
from ..context import SeqContext
from ..ops.rope import apply_rope
from ..ops.ssd import ssd_chunked, ssd_step
from .init import init_A_log_, init_dt_bias_, normal_


class RopeSSD(nn.Module):
    def __init__(self, d_model: int, *, layer_idx: int, d_state: int = 128, expand: int = 1, headdim: int = 64,
                 ngroups: int = 1, chunk_size: int = 64, bias: bool = False, dt_min: float = 1e-3,
                 dt_max: float = 0.1, dt_floor: float = 1e-4, A_init_range: tuple[float, float] = (1.0, 16.0),
                 rope_base: float = 10000.0, rope_interleaved: bool = False):
        super().__init__()
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

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float):
        """in_proj N(0, std), out_proj N(0, out_std), dt_bias and A_log as Mamba-2."""
        normal_(std, self.in_proj)
        normal_(out_std, self.out_proj)
        init_dt_bias_(self.dt_bias, *self.dt_init)
        init_A_log_(self.A_log, *self.A_init_range)

    def forward(self, x: Tensor, *, ctx: SeqContext, cache=None) -> Tensor:
        Bsz, T, _ = x.shape
        h, p, g, n = self.nheads, self.headdim, self.ngroups, self.d_state
        xs, Bm, Cm, dt = self.in_proj(x).split(self.split, dim=-1)
        cos, sin = ctx.rope(n, self.rope_base)                        # the attention's tables (same dim/base)
        Bm = apply_rope(Bm.view(Bsz, T, g, n), cos, sin, interleaved=self.rope_interleaved)
        Cm = apply_rope(Cm.view(Bsz, T, g, n), cos, sin, interleaved=self.rope_interleaved)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        if ctx.pad_mask is not None:
            dt = dt * ctx.pad_mask.unsqueeze(-1)                      # dt = 0: padding neither writes nor decays
        A = -torch.exp(self.A_log.float())
        xs = xs.view(Bsz, T, h, p)
        slot = cache.layer(self.layer_idx, RecurrentCache) if cache is not None else None
        if slot is not None and T == 1 and slot.state is not None:
            y, slot.state = ssd_step(xs[:, 0], dt[:, 0], A, Bm[:, 0], Cm[:, 0], slot.state,
                                     inplace=not torch.is_grad_enabled())
            y = y.unsqueeze(1)
        else:
            y, final = ssd_chunked(xs, dt, A, Bm, Cm, chunk_size=self.chunk_size,
                                   initial_state=slot.state if slot is not None else None, resets=ctx.resets)
            if slot is not None:
                slot.state = final
        return self.out_proj(y.reshape(Bsz, T, self.d_inner))
