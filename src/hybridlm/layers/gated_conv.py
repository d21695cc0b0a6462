"""LFM2's gated short convolution (the `C` letter): an input-gated depthwise causal conv, gated again on the way out.

    b, c, h = in_proj(x) split in three        (each [B, T, d])
    y = out_proj(c ⊙ conv(b ⊙ h))              conv: depthwise, causal, `kernel` taps
Its cache slot is the conv tail (the last kernel-1 values of b ⊙ h), so decoding costs O(1) per token.
Padding: b ⊙ h is zeroed at pad positions before the conv (transformers zeroes the layer input instead: the same
without biases).
"""
import torch
from torch import Tensor, nn

from ..cache import RecurrentCache
from ..context import SeqContext
from .init import normal_
from .short_conv import ShortConv


class GatedShortConv(nn.Module):
    """x [B, T, d_model] -> [B, T, d_model]."""

    def __init__(self, d_model: int, *, layer_idx: int, kernel: int = 3, bias: bool = False):
        super().__init__()
        self.layer_idx, self.d_model = layer_idx, d_model
        self.in_proj = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.conv = ShortConv(d_model, kernel, "zeros" if bias else None)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float):
        """in_proj N(0, std), out_proj N(0, out_std), zero biases; the conv weight as PyTorch's Conv1d, its bias 0."""
        normal_(std, self.in_proj)
        normal_(out_std, self.out_proj)
        self.conv.reset_parameters()

    def forward(self, x: Tensor, *, ctx: SeqContext, cache=None) -> Tensor:
        slot = cache.layer(self.layer_idx, RecurrentCache) if cache is not None else None
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        return self.out_proj(c * self.conv(b * h, ctx, slot))
