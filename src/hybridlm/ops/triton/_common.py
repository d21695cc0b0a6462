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


# num_stages that compiled for a kernel and its compile-time arguments: a launch that ran out of shared memory
# (fp32 tiles at n 128 need 337 KB at Triton's default 3 stages; an H100 / H200 has 227 KB, consumer GPUs 99 KB)
# is retried with fewer stages once, then launched with what worked from there on.
_STAGES: dict = {}


def launch(kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs), with pipelining stages lowered (3 -> 2 -> 1) where the default needs more
    shared memory than the GPU has."""
    from triton.runtime.errors import OutOfResources
    key = (kernel.fn.__name__, tuple(sorted((k, v) for k, v in kwargs.items() if not hasattr(v, "data_ptr"))))
    stages = _STAGES.get(key)
    for ns in ((stages,) if stages else (None, 2, 1)):
        try:
            out = kernel[grid](*args, **kwargs, **({"num_stages": ns} if ns else {}))
        except OutOfResources:
            if ns == 1:
                raise
            continue
        _STAGES[key] = ns or 0
        return out
