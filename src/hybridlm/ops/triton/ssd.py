"""Autograd wrapper of the Triton SSD kernels (ssd_kernels.py): same contract as ops.ssd.ssd_chunked."""
import torch
from torch import Tensor

import triton

from ...errors import InputError
from ._common import launch
from .ssd_kernels import ssd_bwd_kernel, ssd_fwd_kernel


# Compiled for sm_90 without a GPU (p 64, n 128, chunk 64, bf16), ptxas reports these spills per thread
# (forward / backward): 4 warps 1.5 / 9 KB, 8 warps 0.4 / 2.5 KB, 16 warps - / 3 KB. Untuned on a GPU so far.
NUM_WARPS = 8


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))     # tl.dot needs every dimension >= 16


def _chunk(chunk_size: int, T: int) -> int:
    # chunk_size is a speed knob (the result does not depend on it): the kernels keep [Q, Q] tiles in
    # registers, so Q is a power of two in [16, 64]
    return min(64, _block(min(chunk_size, T)))


def _check(x, dt, A, B, C, initial_state, resets):
    if x.dim() != 4:
        raise InputError(f"ssd: x must be [b, t, h, p], got {tuple(x.shape)}")
    b, T, h, p = x.shape
    if dt.shape != (b, T, h) or A.shape != (h,):
        raise InputError(f"ssd: dt must be [b, t, h] = {(b, T, h)} and A [h] = {(h,)}, got "
                         f"{tuple(dt.shape)}, {tuple(A.shape)}")
    if B.dim() != 4 or B.shape[:2] != (b, T) or C.shape != B.shape or h % B.shape[2]:
        raise InputError(f"ssd: B and C must be [b, t, g, n] with h % g == 0, got {tuple(B.shape)}, "
                         f"{tuple(C.shape)} for h = {h}")
    n = B.shape[3]
    if initial_state is not None and initial_state.shape != (b, h, p, n):
        raise InputError(f"ssd: initial_state must be [b, h, p, n] = {(b, h, p, n)}, got "
                         f"{tuple(initial_state.shape)}")
    if resets is not None and resets.shape != (b, T):
        raise InputError(f"ssd: resets must be [b, t] = {(b, T)}, got {tuple(resets.shape)}")


class _SSD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt, A, B, C, h0, resets, Q, save):
        # save: whether a backward can follow (the states entering each chunk are kept for it)
        b, T, h, p = x.shape
        g, n = B.shape[2], B.shape[3]
        x, dt, A, B, C = (t.contiguous() for t in (x, dt, A, B, C))
        r = resets.contiguous().to(torch.int8) if resets is not None else None
        h0c = h0.contiguous().float() if h0 is not None else None
        NC = triton.cdiv(T, Q)
        y = torch.empty_like(x)
        final = x.new_empty(b, h, p, n, dtype=torch.float32)
        states = x.new_empty(b, h, NC, p, n, dtype=torch.float32) if save else final
        lowp = x.dtype != torch.float32
        if T:
            launch(ssd_fwd_kernel, (b * h,), x, dt, A, B, C, r if r is not None else x, h0c if h0c is not None else x,
                   y, states, final, T, h, g, p, n, NC, Q=Q, BP=_block(p), BN=_block(n),
                   HAS_H0=h0 is not None, HAS_RESETS=r is not None, SAVE_STATES=save, LOWP=lowp,
                   num_warps=NUM_WARPS)
        else:
            final.copy_(h0c if h0c is not None else torch.zeros_like(final))
        if save:
            ctx.save_for_backward(x, dt, A, B, C, r, states)
        ctx.Q, ctx.has_h0 = Q, h0 is not None
        return y, final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, dfinal):
        x, dt, A, B, C, r, states = ctx.saved_tensors
        b, T, h, p = x.shape
        g, n = B.shape[2], B.shape[3]
        NC = states.shape[2]
        dy = torch.zeros_like(x) if dy is None else dy.contiguous()
        dfinal = x.new_zeros(b, h, p, n, dtype=torch.float32) if dfinal is None else dfinal.float().contiguous()
        dx = torch.empty_like(x)
        ddt = x.new_empty(b, T, h, dtype=torch.float32)
        dAt = torch.empty_like(ddt)
        dBg = x.new_zeros(b, T, g, n, dtype=torch.float32)
        dCg = torch.zeros_like(dBg)
        dh0 = x.new_empty(b, h, p, n, dtype=torch.float32) if ctx.has_h0 else None
        if T:
            launch(ssd_bwd_kernel, (b * h,), x, dt, A, B, C, r if r is not None else x, states, dy, dfinal,
                   dx, ddt, dAt, dBg, dCg, dh0 if dh0 is not None else x,
                   T, h, g, p, n, NC, Q=ctx.Q, BP=_block(p), BN=_block(n),
                   HAS_H0=ctx.has_h0, HAS_RESETS=r is not None, LOWP=x.dtype != torch.float32,
                   num_warps=NUM_WARPS)
        elif ctx.has_h0:
            dh0.copy_(dfinal)
        dB, dC = dBg.to(B.dtype), dCg.to(C.dtype)
        dA = dAt.sum((0, 1)).to(A.dtype)
        return dx, ddt.to(dt.dtype), dA, dB, dC, dh0, None, None, None


def ssd_chunked_triton(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *, chunk_size: int = 64,
                       initial_state: Tensor | None = None, resets: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """ops.ssd.ssd_chunked on Triton kernels. x [b, t, h, p]; dt [b, t, h] (softplus'd); A [h] (negative);
    B, C [b, t, g, n] with h % g == 0; initial_state [b, h, p, n] or None; resets [b, t] bool or None.
    Returns (y [b, t, h, p] in x's dtype, final_state [b, h, p, n] float32), differentiable in x, dt, A, B,
    C and initial_state. CUDA tensors, or CPU tensors under TRITON_INTERPRET=1."""
    _check(x, dt, A, B, C, initial_state, resets)
    if chunk_size < 1:
        raise InputError(f"ssd: chunk_size must be >= 1, got {chunk_size}")
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (x, dt, A, B, C, initial_state))
    return _SSD.apply(x, dt, A, B, C, initial_state, resets, _chunk(chunk_size, max(x.shape[1], 1)), save)
