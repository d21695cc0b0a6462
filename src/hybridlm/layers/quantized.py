"""`QuantizedLinear`: a linear layer whose weight is stored quantized (ops/quant.py), the drop-in that
`models/quantize.py` swaps for an `nn.Linear` from outside the model; `QuantizedExperts`, the same for a stack of
routed experts' weights; `KernelLinear`, an `nn.Linear` whose decode calls run the project's CPU kernel.

Buffers (what the state dict and a checkpoint hold): int8: `weight_q` int8 [N, K], `scale` [N]; int4: `weight_q`
uint8 [N, K' / 2], `scale`, `zero` [N, K' / group_size] (K' = K padded to a multiple of the group); `bias` [N] if
any. The float buffers follow `model.to(dtype)` like any parameter. On a CPU every call (decode, a serving batch,
a prompt: `cpu_kernels.ROWS`) reads the weight with the project's GEMM (ops/cpu_kernels.py): int8 as stored, int4
repacked once in memory on first use (`int4_kernel`: the one packed copy, which the CPU decode steps of
layers/cpu_steps.py read too; the buffers stay the checkpoint's form). Without
the kernels, decode-sized inputs run PyTorch's int8 / int4 kernels and longer ones dequantize the weight once into
the activations' dtype for one matmul. Other devices run the reference form (dequantize, then F.linear).
"""
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops import cpu_kernels, quant


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
        self._packed = None    # int4 without our kernel: (key, weight, scales and zeros) in PyTorch's layout
        self._q4 = None        # int4 with our kernel: (key, the packed weight)

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

    def _key(self, *extra):
        """What a packed copy of the stored weight depends on: the buffers' storage and in-place versions."""
        return tuple((t.data_ptr(), t._version) for t in self.stored()) + extra

    def int4_kernel(self) -> tuple:
        """(packed, N, K', G): the stored int4 weight in our kernel's layout (packed at `kernel_layout_` or first
        use, kept; repacked when a buffer changes; under torch.compile the packed copy as it is). The one packed
        copy: this layer's products and its mixer's whole decode step (layers/cpu_steps.py) both read it."""
        if not torch.compiler.is_compiling():
            key = self._key()
            if self._q4 is None or self._q4[0] != key:
                self._q4 = (key, cpu_kernels.int4_pack(*self.stored()))
        return self._q4[1], self.out_features, self.weight_q.shape[1] * 2, self.scale.shape[1]

    def kernel_layout_(self, enable: bool = True):
        """Pack an int4 weight for the CPU kernel now (`models.quantize.use_cpu_kernels_`: at load), or drop it."""
        if not enable or self.scheme != "int4":
            self._q4 = None
        elif self.weight_q.device.type == "cpu" and cpu_kernels.available():
            self.int4_kernel()

    def _int4_packed(self, dtype: torch.dtype):
        """PyTorch's int4 kernel layout of the stored weight (built on first use, kept; only without our kernel)."""
        key = self._key(dtype)
        if self._packed is None or self._packed[0] != key:
            self._packed = (key, quant.int4_kernel_weight(self.weight_q),
                            quant.int4_scales_and_zeros(self.scale, self.zero, dtype))
        return self._packed[1:]

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type != "cpu":
            return quant.linear_reference(x, self.scheme, self.stored(), self.bias)
        if cpu_kernels.serves(x, self.scheme) and (self._q4 is not None or not torch.compiler.is_compiling()
                                                   or self.scheme == "int8"):     # our GEMM reads the weight
            if self.scheme == "int8":
                return cpu_kernels.int8_linear(x, self.weight_q, self.scale, self.bias)
            return cpu_kernels.int4_linear(x, *self.int4_kernel(), self.bias)
        if cpu_kernels.decode_sized(x):     # decode without a compiler: PyTorch's kernels
            xs = x.to(self.scale.dtype)
            if self.scheme == "int8":
                return quant.int8_linear(xs, self.weight_q, self.scale, self.bias).to(x.dtype)
            return quant.int4_linear(xs, *self._int4_packed(xs.dtype), self.group_size, self.out_features,
                                     self.bias).to(x.dtype)
        # many rows (past cpu_kernels.ROWS, or no kernels): the weight dequantized once into x's dtype, one matmul
        if cpu_kernels.available() and not torch.compiler.is_compiling():
            w = cpu_kernels.dequantize(self.scheme, self.stored(), x.dtype)[:, :self.in_features]
        else:
            w = self.dequantized().to(x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}{group}, "
                f"bias={self.bias is not None}")


class QuantizedExperts(nn.Module):
    """A stack of E expert weights [E, d_in, d_out] (layers.routed_moe's w_gate / w_up / w_down) stored quantized
    per expert, each expert as a QuantizedLinear stores its [d_out, d_in] matrix: int8: `weight_q` int8 [E, N, K],
    `scale` [E, N]; int4: `weight_q` uint8 [E, N, K' / 2], `scale`, `zero` [E, N, K' / group_size] (N = d_out,
    K = d_in). `expert(e, rows)` is expert e's product (ops.moe's ExpertProduct): decode-sized CPU rows read the stored
    expert with the project's kernels (a contiguous slice, no copy); other rows, and other devices, the expert
    dequantized (one expert at a time: the stack is never dequantized whole)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, scheme: str,
                 group_size: int | None = None, device=None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_experts, self.in_features, self.out_features, self.scheme = (num_experts, in_features,
                                                                              out_features, scheme)
        self.group_size = group_size if scheme == "int4" else None
        E, N = num_experts, out_features
        if scheme == "int8":
            self.register_buffer("weight_q", torch.empty(E, N, in_features, dtype=torch.int8, device=device))
            self.register_buffer("scale", torch.empty(E, N, dtype=dtype, device=device))
        else:
            G = -(-in_features // group_size)
            self.register_buffer("weight_q", torch.empty(E, N, G * group_size // 2, dtype=torch.uint8, device=device))
            self.register_buffer("scale", torch.empty(E, N, G, dtype=dtype, device=device))
            self.register_buffer("zero", torch.empty(E, N, G, dtype=dtype, device=device))
        self._q4 = None        # int4 with our kernel: (key, every expert's packed weight [E, bytes]), on first use

    @classmethod
    @torch.no_grad()
    def from_weight(cls, w: Tensor, scheme: str, group_size: int | None = None) -> "QuantizedExperts":
        """Quantize the experts of w [E, d_in, d_out], one at a time; the scales keep w's floating dtype."""
        q = cls(w.shape[0], w.shape[1], w.shape[2], scheme, group_size, device=w.device, dtype=w.dtype)
        per_expert = [quant.quantize(we.mT, scheme, group_size) for we in w.unbind()]
        for i, buf in enumerate(q.stored()):
            buf.data = torch.stack([t[i] for t in per_expert]).to(buf.dtype)
        return q

    def stored(self) -> tuple[Tensor, ...]:
        return (self.weight_q, self.scale) if self.scheme == "int8" else (self.weight_q, self.scale, self.zero)

    def dequantized(self) -> Tensor:
        """The float32 weights [E, d_in, d_out] the quantized ones stand for."""
        return torch.stack([quant.dequantize(self.scheme, tuple(t[e] for t in self.stored()))[:, :self.in_features].T
                            for e in range(self.num_experts)])

    def int4_kernel(self) -> tuple:
        """(packed [E, bytes], N, K', G): every expert's stored int4 weight in our kernel's layout, packed on first
        use and kept (repacked when a buffer changes). The one packed copy: `expert` and the routed experts' whole
        decode step (layers/cpu_steps.py) both read it."""
        key = tuple((t.data_ptr(), t._version) for t in self.stored())
        if self._q4 is None or self._q4[0] != key:
            self._q4 = (key, torch.stack([cpu_kernels.int4_pack(*(t[e] for t in self.stored()))
                                          for e in range(self.num_experts)]))
        return self._q4[1], self.out_features, self.weight_q.shape[2] * 2, self.scale.shape[2]

    def expert(self, e: int, rows: Tensor) -> Tensor:
        """rows [n, d_in] -> [n, d_out] through expert e."""
        stored = tuple(t[e] for t in self.stored())
        if cpu_kernels.serves(rows, self.scheme) and (self.scheme == "int8" or not torch.compiler.is_compiling()):
            if self.scheme == "int8":
                return cpu_kernels.int8_linear(rows, *stored)
            packed, N, Kp, G = self.int4_kernel()
            return cpu_kernels.int4_linear(rows, packed[e], N, Kp, G)
        if rows.device.type == "cpu" and cpu_kernels.decode_sized(rows) and self.scheme == "int8":
            return quant.int8_linear(rows.to(self.scale.dtype), *stored).to(rows.dtype)   # no compiler: PyTorch's
        return F.linear(rows, quant.dequantize(self.scheme, stored)[:, :self.in_features].to(rows.dtype))

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, out_features={self.out_features}, "
                f"scheme={self.scheme}{group}")


class KernelLinear(nn.Linear):
    """An `nn.Linear` whose CPU calls without gradient run the project's GEMM (ops/cpu_kernels.py) on the float32 /
    bfloat16 weight as stored, for the row counts where it is the faster (`cpu_kernels.ROWS`); every other call is
    nn.Linear's. Set by
    `models.quantize.use_cpu_kernels_` as a class swap: the same parameters, the same state dict."""

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if (w.dtype in (torch.float32, torch.bfloat16) and w.is_contiguous() and x.device.type == "cpu"
                and not (torch.is_grad_enabled() and w.requires_grad) and cpu_kernels.serves(x, w.dtype)):
            return cpu_kernels.linear(x, w, self.bias)
        return super().forward(x)
