import torch
from torch import Tensor, nn

from ..ops import cpu_decode
from ..ops.norm import rms_norm


class RMSNorm(nn.Module):
    """RMSNorm with a learned gain. x [..., d] -> [..., d]."""

    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(d))
        self.reset_parameters()     # a leaf module, as nn.LayerNorm: initialised when built (a no-op on meta)

    @torch.no_grad()
    def reset_parameters(self):
        self.weight.fill_(1.0)

    def forward(self, x: Tensor) -> Tensor:
        if cpu_decode.one_token(x) and cpu_decode.serves(x, self.weight):      # decode: one C++ call
            return cpu_decode.rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


def make_norm(kind: str, d: int, eps: float) -> nn.Module:
    """`rms` (Llama, Mamba) or `layer` (GPT: LayerNorm with bias)."""
    return RMSNorm(d, eps) if kind == "rms" else nn.LayerNorm(d, eps=eps)
