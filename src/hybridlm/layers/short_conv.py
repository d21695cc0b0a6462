"""The causal depthwise short conv in front of the recurrent mixers (Mamba-2, Mamba-1, Rodimus, KDA, Gated DeltaNet,
LFM2's gated conv): one weight per channel and tap, padding masked out, its last K-1 inputs carried in the cache."""
import math

import torch
from torch import Tensor, nn

from ..ops import cpu_decode
from ..ops.conv import causal_conv1d, causal_conv1d_step


class ShortConv(nn.Module):
    """x [B, T, C] -> [B, T, C]: y[t] = sum_j weight[:, j] x[t - K + 1 + j] (+ bias). `bias`: "uniform" (PyTorch's
    Conv1d init, as Mamba and Rodimus), "zeros" (LFM2) or None. The weight is [C, K] (Conv1d's [C, 1, K] squeezed)."""

    def __init__(self, channels: int, kernel: int, bias: str | None = "uniform"):
        super().__init__()
        self.kernel, self.bias_init = kernel, bias
        self.weight = nn.Parameter(torch.empty(channels, kernel))
        self.bias = nn.Parameter(torch.empty(channels)) if bias is not None else None
        self.reset_parameters()     # a leaf module, as nn.Conv1d: initialised when built (a no-op on meta)

    @torch.no_grad()
    def reset_parameters(self):
        bound = 1 / math.sqrt(self.kernel)           # PyTorch's default Conv1d init for a depthwise kernel
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound) if self.bias_init == "uniform" else nn.init.zeros_(self.bias)

    def forward(self, x: Tensor, ctx, slot=None) -> Tensor:
        """x [B, T, C]; padded positions (ctx.pad_mask) are zeroed first so they never reach a real token's taps.
        With a cache slot, reads and updates `slot.conv` (the last K-1 inputs), one-token step on decode."""
        if ctx.pad_mask is not None:
            x = x * ctx.pad_mask.unsqueeze(-1).to(x.dtype)
        if slot is not None and x.shape[1] == 1 and slot.conv is not None:
            args = (x[:, 0], slot.conv, self.weight, self.bias)
            y, slot.conv = (cpu_decode.conv_step if cpu_decode.serves(*args) else causal_conv1d_step)(*args)
            return y.unsqueeze(1)
        y, tail = causal_conv1d(x, self.weight, self.bias, initial_state=slot.conv if slot is not None else None,
                                resets=ctx.resets)
        if slot is not None:
            slot.conv = tail
        return y


def old_conv_names(state_dict: dict, prefix: str, *args):
    """A load_state_dict pre-hook for a model holding ShortConvs: checkpoints written before this module existed name
    its tensors `<mixer>.conv_weight` / `<mixer>.conv_bias`; renamed in place to `<mixer>.conv.weight` / `.bias`.
    (It must run at the root: a mixer would count the old names as unexpected before its conv saw them.)"""
    for key in [k for k in state_dict if k.startswith(prefix) and k.endswith((".conv_weight", ".conv_bias"))]:
        state_dict[key[: -len("_weight") if key.endswith("_weight") else -len("_bias")] + "." +
                   key.rsplit("_", 1)[1]] = state_dict.pop(key)
