"""Autograd wrapper of the Triton GLA kernels (gla_kernels.py): same contract as ops.gla.gla_chunked."""
import torch
from torch import Tensor

import triton

from ...errors import InputError
from ..gla import LOG_DECAY_MIN, _check
from ._common import launch
from .gla_kernels import gla_bwd_kernel, gla_fwd_kernel


# Compiled for sm_90 without a GPU (K = V = 128, bf16), ptxas reports these spills per thread (forward /
# backward): chunk 64 at 4 warps 10 / 19 KB, at 8 warps 1.7 / 9 KB; chunk 32 at 8 warps 0.5 / 2.8 KB. Hence
# chunks of at most 32 tokens and 8 warps; untuned on a GPU so far.
NUM_WARPS = 8
MAX_CHUNK = 32


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))     # tl.dot needs every dimension >= 16


class _GLA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, w, h0, resets, scale, Q, save):
        # save: whether a backward can follow (the states entering each chunk are kept for it)
        B, T, H, K = q.shape
        V = v.shape[-1]
        q, k, v, w = (t.contiguous() for t in (q, k, v, w))
        r = resets.contiguous().to(torch.int8) if resets is not None else None
        h0c = h0.contiguous().float() if h0 is not None else None
        NC = triton.cdiv(T, Q)
        o = q.new_empty(B, T, H, V)
        final = q.new_empty(B, H, K, V, dtype=torch.float32)
        states = q.new_empty(B, H, NC, K, V, dtype=torch.float32) if save else final
        if T:
            launch(gla_fwd_kernel, (B * H,), q, k, v, w, r if r is not None else q, h0c if h0c is not None else q,
                   o, states, final, T, H, K, V, NC, scale, LOG_DECAY_MIN,
                   Q=Q, BK=_block(K), BV=_block(V), HAS_H0=h0 is not None,
                   HAS_RESETS=r is not None, SAVE_STATES=save, LOWP=q.dtype != torch.float32,
                   num_warps=NUM_WARPS)
        else:
            final.copy_(h0c if h0c is not None else torch.zeros_like(final))
        if save:
            ctx.save_for_backward(q, k, v, w, r, states)
        ctx.scale, ctx.Q, ctx.has_h0 = scale, Q, h0 is not None
        return o, final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dfinal):
        q, k, v, w, r, states = ctx.saved_tensors
        B, T, H, K = q.shape
        V = v.shape[-1]
        do = torch.zeros(B, T, H, V, dtype=q.dtype, device=q.device) if do is None else do.contiguous()
        dfinal = q.new_zeros(B, H, K, V, dtype=torch.float32) if dfinal is None else dfinal.float().contiguous()
        dq, dk, dv, dw = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(w)
        dh0 = q.new_empty(B, H, K, V, dtype=torch.float32) if ctx.has_h0 else None
        if T:
            launch(gla_bwd_kernel, (B * H,), q, k, v, w, r if r is not None else q, states, do, dfinal,
                   dq, dk, dv, dw, dh0 if dh0 is not None else q,
                   T, H, K, V, states.shape[2], ctx.scale, LOG_DECAY_MIN,
                   Q=ctx.Q, BK=_block(K), BV=_block(V), HAS_H0=ctx.has_h0,
                   HAS_RESETS=r is not None, LOWP=q.dtype != torch.float32, num_warps=NUM_WARPS)
        elif ctx.has_h0:
            dh0.copy_(dfinal)
        return dq, dk, dv, dw, dh0, None, None, None, None


def gla_chunked_triton(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, *, scale: float | None = None,
                       initial_state: Tensor | None = None, resets: Tensor | None = None,
                       chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """ops.gla.gla_chunked on Triton kernels. q, k, log_decay [B, T, H, K]; v [B, T, H, V];
    initial_state [B, H, K, V] or None; resets [B, T] bool or None. Returns (o [B, T, H, V] in q's dtype,
    final_state [B, H, K, V] float32), differentiable in q, k, v, log_decay and initial_state.
    log_decay is clamped to [LOG_DECAY_MIN, 0] as in gla_chunked. chunk_size is a speed knob (a power of
    two in [16, MAX_CHUNK] is used). CUDA tensors, or CPU tensors under TRITON_INTERPRET=1."""
    _check(q, k, v, log_decay, initial_state, resets)
    if chunk_size < 1:
        raise InputError(f"gla: chunk_size must be >= 1, got {chunk_size}")
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        raise InputError(f"gla: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    Q = min(MAX_CHUNK, _block(min(chunk_size, max(q.shape[1], 1))))
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (q, k, v, log_decay, initial_state))
    return _GLA.apply(q, k, v, log_decay, initial_state, resets, scale, Q, save)
