"""`QuantizedLinear`: a linear layer whose weight is stored quantized (ops/quant.py), the drop-in that
`models/quantize.py` swaps for an `nn.Linear` from outside the model.

Buffers (what the state dict and a checkpoint hold): int8: `weight_q` int8 [N, K], `scale` [N]; int4: `weight_q`
uint8 [N, K' / 2], `scale`, `zero` [N, K' / group_size] (K' = K padded to a multiple of the group); `bias` [N] if any. The float buffers follow `model.to(dtype)`
like any parameter. On a CPU the forward reads the quantized weight with PyTorch's int8 / int4 kernels; int4's kernel
layout is derived from `weight_q` on first use and kept (not saved: the stored form is portable); other devices run
the reference form (dequantize, then F.linear).
"""
import torch
from torch import Tensor, nn

from ..ops import quant


class QuantizedLinear(nn.Module):
    """x [..., in_features] -> [..., out_features], weight quantized by `scheme` ("int8" or "int4")."""

    def __init__(self, in_features: int, out_features: int, scheme: str, group_size: int | None = None,
                 bias: bool = False, device=None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.group_size = group_size if scheme == "int4" else None
        if scheme == "int8":
            self.register_buffer("weight_q", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
            self.register_buffer("scale", torch.empty(out_features, dtype=dtype, device=device))
        else:
            G = -(-in_features // group_size)
            self.register_buffer("weight_q", torch.empty(out_features, G * group_size // 2, dtype=torch.uint8,
                                                         device=device))
            self.register_buffer("scale", torch.empty(out_features, G, dtype=dtype, device=device))
            self.register_buffer("zero", torch.empty(out_features, G, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None
        self._kernel = None    # int4: (key, packed weight, scales and zeros) in the kernel's layout

    @classmethod
    @torch.no_grad()
    def from_linear(cls, lin: nn.Linear, scheme: str, group_size: int | None = None) -> "QuantizedLinear":
        """Quantize `lin`'s weight; the scales keep the weight's floating dtype."""
        w = lin.weight
        q = cls(lin.in_features, lin.out_features, scheme, group_size, lin.bias is not None, device=w.device,
                dtype=w.dtype)
        for buf, t in zip(q.stored(), quant.quantize(w, scheme, group_size)):
            buf.data = t.to(buf.dtype)          # meta in, meta out: `load_checkpoint` builds the skeleton this way
        if lin.bias is not None:
            q.bias.data = lin.bias.detach().clone()
        return q

    def stored(self) -> tuple[Tensor, ...]:
        """The tensors `ops.quant.dequantize` takes: (weight_q, scale) or (weight_q, scale, zero)."""
        return (self.weight_q, self.scale) if self.scheme == "int8" else (self.weight_q, self.scale, self.zero)

    def dequantized(self) -> Tensor:
        """The float32 weight [N, K] the quantized one stands for."""
        return quant.dequantize(self.scheme, self.stored())[:, :self.in_features]

    def _int4_kernel(self, dtype: torch.dtype):
        key = (self.weight_q.data_ptr(), self.scale.data_ptr(), self.zero.data_ptr(), dtype)
        if self._kernel is None or self._kernel[0] != key:
            self._kernel = (key, quant.int4_kernel_weight(self.weight_q),
                            quant.int4_scales_and_zeros(self.scale, self.zero, dtype))
        return self._kernel[1:]

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type != "cpu":
            return quant.linear_reference(x, self.scheme, self.stored(), self.bias)
        if x.dtype != self.scale.dtype:     # the kernels compute in the scales' dtype (autocast leaves them alone)
            x = x.to(self.scale.dtype)
        if self.scheme == "int8":
            return quant.int8_linear(x, self.weight_q, self.scale, self.bias)
        return quant.int4_linear(x, *self._int4_kernel(x.dtype), self.group_size, self.out_features, self.bias)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}{group}, "
                f"bias={self.bias is not None}")
