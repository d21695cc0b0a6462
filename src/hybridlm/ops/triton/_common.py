"""Helpers shared by the Triton kernels."""
import os

import triton
import triton.language as tl

# Triton's interpreter (the CPU tests) multiplies bf16 tiles wrongly in tl.dot; there the operands are rounded
# to bf16 and multiplied in fp32 instead, which is the same arithmetic as the GPU's bf16 x bf16 -> fp32 product.
# Triton reads TRITON_INTERPRET when a kernel is decorated, so this is read at import as well.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"))


@triton.jit
def dot(a, b, LOWP: tl.constexpr):
    """a [M, K] @ b [K, N] in fp32. LOWP (bf16/fp16 inputs): bf16 products with fp32 accumulation on tensor
    cores, as mamba_ssm and FLA do; otherwise exact fp32 (no tf32), so fp32 inputs match the PyTorch ops."""
    if LOWP:
        if INTERPRETED:
            return tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32))
        else:
            return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        return tl.dot(a, b, input_precision="ieee")
