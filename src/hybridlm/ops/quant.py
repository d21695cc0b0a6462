"""Weight-only quantization of a linear layer's weight W [N, K] (N outputs, K inputs), as pure functions.

Schemes (activations stay in the model's dtype; only W is stored quantized):
  int8   symmetric per output channel: W[n] ≈ scale[n] · q[n],  q int8 in [-127, 127], scale [N].
  int4   asymmetric per group of `group_size` inputs (the convention of PyTorch's int4 CPU kernel); K is padded with
         zero columns to a multiple of the group (Rodimus's FFN width, 4/3 d rounded to 8, is no multiple of 32):
         W[n, k] ≈ (q[n, k] - 8) · scale[n, g] + zero[n, g],  g = k // group_size, q in [0, 15],
         zero = min + 8 · scale and scale = (max - min) / 15 over the group; scale, zero [N, K / group_size].
         Stored two values a byte, q[n, 2j] in the low nibble of byte [n, j] and q[n, 2j + 1] in the high one: a
         portable form, repacked for the kernel in memory (`int4_kernel_weight`), never re-quantized.

Each scheme has a reference form (`linear_reference`: dequantize to float32, then F.linear) and the fast form
(`int8_linear`, `int4_linear`: PyTorch's CPU kernels `_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu`, which
read the quantized weight directly); tests hold them together within a bound per scheme.
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import InputError

SCHEMES = ("int8", "int4")
INT4_GROUPS = (32, 64, 128)


def check_shape(scheme: str, out_features: int, in_features: int, group_size: int | None = None) -> str | None:
    """Why `scheme` cannot serve a [out_features, in_features] weight, or None if it can."""
    if scheme not in SCHEMES:
        return f"unknown quantization scheme {scheme!r} (one of {', '.join(SCHEMES)})"
    if scheme == "int4" and group_size not in INT4_GROUPS:
        return f"int4 group size must be one of {INT4_GROUPS}, got {group_size}"
    return None


# --- int8, per output channel --------------------------------------------------------------------------------
def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [N, K] -> (q int8 [N, K], scale float32 [N])."""
    w = w.float()
    scale = (w.abs().amax(1) / 127).clamp(min=1e-12)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def dequantize_int8(q: Tensor, scale: Tensor) -> Tensor:
    """(q [N, K], scale [N]) -> W [N, K] float32."""
    return q.float() * scale.float()[:, None]


def int8_linear(x: Tensor, q: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ Wᵀ (+ bias) -> [..., N] in x's dtype, reading the int8 weight directly (CPU kernel)."""
    y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), q, scale.to(x.dtype))
    y = y.reshape(*x.shape[:-1], q.shape[0])
    return y if bias is None else y + bias.to(y.dtype)


# --- int4, group-wise asymmetric -----------------------------------------------------------------------------
def quantize_int4(w: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """w [N, K] -> (q uint8 [N, K' / 2] two values a byte, scale float32 [N, K' / g], zero float32 [N, K' / g]),
    K' = K rounded up to a multiple of the group size g (zero columns)."""
    N, K = w.shape
    why = check_shape("int4", N, K, group_size)
    if why:
        raise InputError(why)
    K += -K % group_size
    g = F.pad(w.float(), (0, K - w.shape[1])).reshape(N, K // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).reshape(N, K)
    return q[:, 0::2] | (q[:, 1::2] << 4), scale, lo + 8 * scale


def unpack_int4(q: Tensor) -> Tensor:
    """uint8 [N, K / 2] -> the 4-bit values [N, K] (uint8, 0..15)."""
    return torch.stack((q & 15, q >> 4), -1).reshape(q.shape[0], -1)


def dequantize_int4(q: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    """(q [N, K / 2], scale [N, G], zero [N, G]) -> W [N, K] float32 (group size K / G)."""
    v = unpack_int4(q).float().reshape(q.shape[0], scale.shape[1], -1)
    return ((v - 8) * scale.float()[..., None] + zero.float()[..., None]).reshape(q.shape[0], -1)


def _pad_rows(t: Tensor) -> Tensor:
    """t [N, ...] with zero rows up to a multiple of 16 (the int4 kernel's block of outputs)."""
    return F.pad(t, (0, 0) * (t.dim() - 1) + (0, -t.shape[0] % 16))


def int4_kernel_weight(q: Tensor) -> Tensor:
    """The stored int4 weight [N, K / 2] repacked as PyTorch's CPU int4 kernel reads it (a layout change only;
    rows padded to a multiple of 16, which `int4_linear` drops again)."""
    return torch._convert_weight_to_int4pack_for_cpu(_pad_rows(unpack_int4(q).to(torch.int32)), 1)


def int4_scales_and_zeros(scale: Tensor, zero: Tensor, dtype: torch.dtype) -> Tensor:
    """scale, zero [N, G] -> [G, N', 2] in `dtype`, the kernel's layout (N' = N padded as in int4_kernel_weight)."""
    return _pad_rows(torch.stack((scale, zero), -1)).transpose(0, 1).contiguous().to(dtype)


def int4_linear(x: Tensor, packed: Tensor, scales_zeros: Tensor, group_size: int, out_features: int,
                bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ Wᵀ (+ bias) -> [..., out_features] in x's dtype, from the kernel form of the weight
    (`int4_kernel_weight`, `int4_scales_and_zeros` in x's dtype)."""
    x2 = x.reshape(-1, x.shape[-1])
    x2 = F.pad(x2, (0, scales_zeros.shape[0] * group_size - x2.shape[1]))     # the weight's zero columns, if any
    y = torch._weight_int4pack_mm_for_cpu(x2, packed, group_size, scales_zeros)
    y = y[:, :out_features].reshape(*x.shape[:-1], out_features)
    return y if bias is None else y + bias.to(y.dtype)


def int4_q8_reference(x: Tensor, q: Tensor, scale: Tensor, zero: Tensor, bias: Tensor | None = None) -> Tensor:
    """The math of the CPU kernel's int4 product (ops/cpu_kernels.int4_linear; llama.cpp's Q4 x Q8_0), in float32:
    x [..., K] rounded per block of 32 columns to int8 (d = max |x| / 127, xq = round(x / d)), the weight as
    v · scale + min (min = zero - 8 scale) with scale and min rounded to float16, so
    y = sum over blocks of scale · d · (v · xq summed) + sum over groups of min · (x summed over the group)."""
    N, G = scale.shape
    Kp = q.shape[1] * 2
    x2 = F.pad(x.reshape(-1, x.shape[-1]).float(), (0, Kp - x.shape[-1]))
    xb = x2.reshape(-1, Kp // 32, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    xq = torch.where(d > 0, torch.round(xb / d), 0.0)
    s16, mn16 = scale.float().half().float(), (zero.float() - 8 * scale.float()).half().float()
    v = unpack_int4(q).float().reshape(N, Kp // 32, 32)
    dots = torch.einsum("mbk,nbk->mnb", xq, v)                                  # exact integers
    sb = s16.repeat_interleave(Kp // G // 32, 1)                                # [N, blocks]
    y = (dots * (sb[None] * d[..., 0][:, None])).sum(-1)
    y = y + x2.reshape(-1, G, Kp // G).sum(-1) @ mn16.T
    y = y.reshape(*x.shape[:-1], N)
    return (y if bias is None else y + bias.float()).to(x.dtype)


# --- both ----------------------------------------------------------------------------------------------------
def quantize(w: Tensor, scheme: str, group_size: int | None = None) -> tuple[Tensor, ...]:
    """w [N, K] -> the stored tensors of `scheme`: (q, scale) for int8, (q, scale, zero) for int4."""
    why = check_shape(scheme, *w.shape, group_size)
    if why:
        raise InputError(why)
    return quantize_int8(w) if scheme == "int8" else quantize_int4(w, group_size)


def dequantize(scheme: str, tensors: tuple[Tensor, ...]) -> Tensor:
    """The float32 weight [N, K] that `tensors` (as `quantize` returned them) stand for."""
    return dequantize_int8(*tensors) if scheme == "int8" else dequantize_int4(*tensors)


def linear_reference(x: Tensor, scheme: str, tensors: tuple[Tensor, ...], bias: Tensor | None = None) -> Tensor:
    """Reference form: x [..., K] @ dequantize(...)ᵀ in float32 (+ bias) -> [..., N] in x's dtype."""
    w = dequantize(scheme, tensors)[:, :x.shape[-1]]                   # (int4's padding columns dropped)
    y = F.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)
