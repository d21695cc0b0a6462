"""Mixed precision inside the chunked sequence ops (SSD, GLA, the delta rule): which dtype their big matmuls read.

As mamba_ssm's and FLA's kernels do on GPUs, only the operands of the in-chunk matmuls drop to bf16 (or fp16); the
decays, cumulative sums, exps, the triangular solve and the state passed between chunks stay float32. A bf16 matmul
(oneDNN/AMX on CPU, tensor cores on GPU) accumulates in float32 and rounds its result once; results that feed the
carried state are widened back to float32 before they are added to it.

The low-precision path is taken when the op's input is bf16/fp16 (bf16 weights: inference at release size) or when
autocast to bf16/fp16 is on for its device (mixed-precision training). The op then runs with autocast off and casts
explicitly, so autocast never rounds a float32 state or decay behind its back. float32 and float64 inputs without
autocast take the exact float32 (float64) path unchanged.
"""
import contextlib

import torch
from torch import Tensor

LOW = (torch.bfloat16, torch.float16)


def matmul_dtype(x: Tensor) -> torch.dtype | None:
    """bf16/fp16 when x is in that dtype or autocast to it is on for x's device; None for the exact path."""
    if x.dtype in LOW:
        return x.dtype
    dev = x.device.type
    if x.dtype == torch.float32 and torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) in LOW:
        return torch.get_autocast_dtype(dev)
    return None


def no_autocast(x: Tensor):
    """Autocast off for x's device inside the op (its dtypes are chosen explicitly), a no-op context otherwise."""
    dev = x.device.type
    return torch.autocast(dev, enabled=False) if torch.is_autocast_enabled(dev) else contextlib.nullcontext()


def caster(dtype: torch.dtype | None):
    """t -> t in `dtype` (the identity for None, so the exact path runs the very same operations)."""
    if dtype is None:
        return lambda t: t
    return lambda t: t.to(dtype)
