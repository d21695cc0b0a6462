"""The Mamba-2 block (the Mamba-2 paper, section 7.1) around the SSD operator.

in_proj(x) -> [z (gate), xBC, dt]; causal depthwise conv + SiLU on xBC; SSD over heads with D skip;
y = out_proj(gated_rms_norm(y, z)) with the norm grouped per SSD group. `norm` picks where the gate goes (Falcon-H1's
mamba_rms_norm / mamba_norm_before_gate): "gated" RMSNorm(y·silu(z)), "norm_gate" RMSNorm(y)·silu(z), "gate"
y·silu(z) with no norm.
"""
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cache import RecurrentCache
from ..context import SeqContext
from ..ops.flops import gla_flops
from ..ops.norm import gated_rms_norm
from ..ops.ssd import ssd_chunked, ssd_step
from .init import init_A_log_, init_dt_bias_, normal_
from .short_conv import ShortConv


class Mamba2(nn.Module):
    """x [B, T, d_model] -> [B, T, d_model]; heads of `headdim`, `ngroups` groups of B/C of `d_state`. The SSD
    width is `d_inner` (default expand · d_model); `dt_limit` (lo, hi) clamps dt after the softplus, in prefill and
    decode alike."""

    def __init__(self, d_model: int, *, layer_idx: int, d_state: int = 128, d_conv: int = 4, expand: int = 2,
                 headdim: int = 64, ngroups: int = 1, chunk_size: int = 64, bias: bool = False,
                 conv_bias: bool = True, dt_min: float = 1e-3, dt_max: float = 0.1, dt_floor: float = 1e-4,
                 A_init_range: tuple[float, float] = (1.0, 16.0), norm_eps: float = 1e-5,
                 d_inner: int | None = None, dt_limit: tuple[float, float] | None = None, norm: str = "gated"):
        super().__init__()
        self.layer_idx, self.d_state, self.ngroups, self.headdim, self.chunk_size = \
            layer_idx, d_state, ngroups, headdim, chunk_size
        self.d_inner = d_inner or expand * d_model   # Nemotron-H / Falcon-H1: set directly, not a multiple of d_model
        self.dt_limit = dt_limit                     # clamp of dt (transformers' time_step_limit), None = none
        self.norm = norm                             # gated | norm_gate | gate (see ModelConfig.ssd_norm)
        self.nheads = self.d_inner // headdim
        self.norm_eps = norm_eps
        self.dt_init, self.A_init_range = (dt_min, dt_max, dt_floor), A_init_range
        conv_dim = self.d_inner + 2 * ngroups * d_state
        self.in_proj = nn.Linear(d_model, 2 * self.d_inner + 2 * ngroups * d_state + self.nheads, bias=bias)
        self.conv = ShortConv(conv_dim, d_conv, "uniform" if conv_bias else None)
        self.dt_bias = nn.Parameter(torch.empty(self.nheads))
        self.A_log = nn.Parameter(torch.empty(self.nheads))
        self.D = nn.Parameter(torch.empty(self.nheads))
        self.norm_weight = nn.Parameter(torch.empty(self.d_inner)) if norm != "gate" else None
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias)

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float):
        """Projections N(0, std) (out_proj: out_std, it writes to the residual stream), the conv as PyTorch's Conv1d,
        dt_bias / A_log as Mamba-2, D and the norm 1."""
        normal_(std, self.in_proj)
        normal_(out_std, self.out_proj)
        self.conv.reset_parameters()
        init_dt_bias_(self.dt_bias, *self.dt_init)
        init_A_log_(self.A_log, *self.A_init_range)
        self.D.fill_(1.0)
        if self.norm_weight is not None:
            self.norm_weight.fill_(1.0)

    def sequence_flops(self) -> float:
        """Forward FLOPs per token of the SSD recurrence (ops/flops.py): B/C scores per group, outputs and state per
        head."""
        return gla_flops(self.nheads, self.d_state, self.headdim, score_heads=self.ngroups)

    def forward(self, x: Tensor, *, ctx: SeqContext, cache=None) -> Tensor:
        B, T, _ = x.shape
        h, p, g, n = self.nheads, self.headdim, self.ngroups, self.d_state
        slot = cache.layer(self.layer_idx, RecurrentCache) if cache is not None else None
        z, xBC, dt = self.in_proj(x).split((self.d_inner, self.d_inner + 2 * g * n, h), dim=-1)
        mask = ctx.pad_mask.unsqueeze(-1).to(x.dtype) if ctx.pad_mask is not None else None
        xBC = F.silu(self.conv(xBC, ctx, slot))
        if mask is not None:  # padded positions must not reach the state
            xBC = xBC * mask
        xs, Bm, Cm = xBC.split((self.d_inner, g * n, g * n), dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        if self.dt_limit is not None:
            dt = dt.clamp(*self.dt_limit)
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
        return self._output(y.reshape(B, T, self.d_inner), z)

    def _output(self, y: Tensor, z: Tensor) -> Tensor:
        """y [B, T, d_inner] (after the D skip) -> out_proj(the gated norm of y by z)."""
        T, g = y.shape[1], self.ngroups
        if self.norm_weight is None:
            y = (y.float() * F.silu(z.float())).to(y.dtype)
        else:
            y = gated_rms_norm(y, gate=z, weight=self.norm_weight, group_size=self.d_inner // g, eps=self.norm_eps,
                     norm_before_gate=self.norm == "norm_gate")
        return self.out_proj(y)
