"""LFM2's gated short convolution (the `C` letter): an input-gated depthwise causal conv, gated again on the way out.

    b, c, h = in_proj(x) split in three        (each [B, T, d])
    y = out_proj(c ⊙ conv(b ⊙ h))              conv: depthwise, causal, `kernel` taps
Its cache slot is the conv tail (the last kernel-1 values of b ⊙ h), so decoding costs O(1) per token.
"""
import math

import torch
from torch import Tensor, nn

from ..cache import RecurrentCache
from ..context import SeqContext
from .short_conv import cached_short_conv


class GatedShortConv(nn.Module):
    """x [B, T, d_model] -> [B, T, d_model]."""

    def __init__(self, d_model: int, *, layer_idx: int, kernel: int = 3, bias: bool = False):
        super().__init__()
        self.layer_idx, self.d_model = layer_idx, d_model
        self.in_proj = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.conv_weight = nn.Parameter(torch.empty(d_model, kernel))
        self.conv_bias = nn.Parameter(torch.zeros(d_model)) if bias else None
        bound = 1 / math.sqrt(kernel)  # PyTorch's default Conv1d init for a depthwise kernel
        nn.init.uniform_(self.conv_weight, -bound, bound)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        self.out_proj._is_residual_out = True

    def forward(self, x: Tensor, *, ctx: SeqContext, cache=None) -> Tensor:
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        u = b * h
        if ctx.pad_mask is not None:  # padded positions must not reach the conv taps of real ones
            u = u * ctx.pad_mask.unsqueeze(-1).to(u.dtype)
        slot = cache.layer(self.layer_idx, RecurrentCache) if cache is not None else None
        u = cached_short_conv(u, self.conv_weight, self.conv_bias, slot, ctx.resets)
        return self.out_proj(c * u)
