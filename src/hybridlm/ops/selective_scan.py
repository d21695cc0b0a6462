"""Mamba-1's selective scan: a diagonal SSM per channel with input-dependent step, input and output matrices.

    h_t = exp(dt_t ⊙ A) ⊙ h_{t-1} + (dt_t ⊙ x_t) ⊗ B_t          (state h: [channels, d_state] per row)
    y_t = h_t · C_t + D ⊙ x_t

Shapes: x, dt [b, t, d] (dt already softplus'd, >= 0); A [d, n] (negative); B, C [b, t, g, n] with d % g == 0
(channel c reads group c // (d/g)) or [b, t, n] (one group); D [d] or None. State [b, d, n] is float32 (float64 for
float64 inputs). `resets` [b, t] bool marks document starts: the decay is 0 there, so no state crosses documents.

Unlike SSD the decay differs per (channel, state) entry, so the chunked form of ssd.py would need a [b, d, L, L, n]
mask. Instead each chunk of L tokens runs a log-depth (Hillis-Steele) scan on [b, L, d, n] tensors: only products
of decays, never the ratios exp(-cumsum) that overflow under strong decay, so it is exact. Chunks run in turn, each
starting from the previous chunk's final state. A chunk's backward is the reverse scan, written by hand
(`_ChunkScan`); under autograd each chunk is also recomputed in the backward (activation checkpointing), so training
keeps one chunk's [b, L, d, n] tensors at a time, not the sequence's.

bf16 inputs (or autocast): the scan has no large matmul, so, as mamba_ssm's selective_scan kernel, it reads bf16 and
computes in float32 (autocast is switched off inside: it would round the float32 states to bf16 for the `H @ C`
readout).
"""
import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from .precision import no_autocast


def _dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _groups(t: Tensor) -> Tensor:
    """B or C as [b, t, g, n] (a [b, t, n] input is one group)."""
    return t.unsqueeze(2) if t.dim() == 3 else t


def _inputs(x, dt, A, B, resets):
    """Decay a [b, t, g, d/g, n] and input u = (dt·x) ⊗ B of the same shape, in the state's dtype."""
    b, T, d = x.shape
    g, n = B.shape[2], B.shape[3]
    f = _dtype(x)
    dtf = dt.to(f)
    a = torch.exp(dtf.unsqueeze(-1) * A.to(f))                            # [b, t, d, n]
    if resets is not None:
        a = a.masked_fill(resets[:, :, None, None], 0.0)
    u = (dtf * x.to(f)).view(b, T, g, d // g, 1) * B.to(f).view(b, T, g, 1, n)
    return a.view(b, T, g, d // g, n), u


def selective_scan_recurrent(x, dt, A, B, C, D=None, *, initial_state=None, resets=None):
    """Reference: the token recurrence. Returns (y [b, t, d] in x's dtype, final_state [b, d, n])."""
    b, T, d = x.shape
    B, C = _groups(B), _groups(C)
    g, n = B.shape[2], B.shape[3]
    a, u = _inputs(x, dt, A, B, resets)
    h = x.new_zeros(b, g, d // g, n, dtype=_dtype(x)) if initial_state is None \
        else initial_state.to(_dtype(x)).view(b, g, d // g, n)
    ys = []
    for t in range(T):
        h = a[:, t] * h + u[:, t]
        ys.append(torch.einsum("bgcn,bgn->bgc", h, C[:, t].to(h.dtype)).reshape(b, d))
    y = torch.stack(ys, 1)
    if D is not None:
        y = y + x.to(y.dtype) * D.to(y.dtype)
    return y.to(x.dtype), h.reshape(b, d, n)


def _scan(a: Tensor, u: Tensor) -> Tensor:
    """All states of h_t = a_t h_{t-1} + u_t (h_{-1} = 0) along dim 1, by Hillis-Steele: after the step with
    offset k, (a_t, u_t) summarise tokens (t-2k, t]; log2(L) steps of products, never ratios."""
    L, k = u.shape[1], 1
    while k < L:
        u = torch.cat((u[:, :k], torch.addcmul(u[:, k:], a[:, k:], u[:, :-k])), 1)
        if 2 * k < L:
            a = torch.cat((a[:, :k], a[:, k:] * a[:, :-k]), 1)
        k *= 2
    return u


class _ChunkScan(torch.autograd.Function):
    """One chunk: a, u [b, L, g, c, n]; C [b, L, g, n]; h0 [b, g, c, n] -> (y [b, L, g, c], h_L [b, g, c, n]).
    The backward is the reverse scan G_t = a_{t+1} G_{t+1} + gy_t ⊗ C_t (G = dloss/dh_t), written by hand: autograd
    through the forward's slices would zero-fill a full-size gradient per slice and step."""

    @staticmethod
    def forward(ctx, a, u, C, h0):
        u = torch.cat((torch.addcmul(u[:, :1], a[:, :1], h0.unsqueeze(1)), u[:, 1:]), 1)   # fold h0 into token 0
        H = _scan(a, u)                                                      # h_t for every t
        ctx.save_for_backward(a, H, C, h0)
        return (H @ C.unsqueeze(-1)).squeeze(-1), H[:, -1]

    @staticmethod
    def backward(ctx, gy, gh):
        a, H, C, h0 = ctx.saved_tensors
        v = gy.unsqueeze(-1) * C.unsqueeze(-2)                               # gy_t ⊗ C_t: [b, L, g, c, n]
        if gh is not None:
            v[:, -1] += gh
        a_next = torch.cat((a[:, 1:], torch.zeros_like(a[:, :1])), 1)        # a_{t+1}
        G = _scan(a_next.flip(1), v.flip(1)).flip(1)
        prev = torch.cat((h0.unsqueeze(1), H[:, :-1]), 1)                    # h_{t-1}
        gC = (gy.unsqueeze(-2) @ H).squeeze(-2) if ctx.needs_input_grad[2] else None
        return G * prev, G, gC, a[:, 0] * G[:, 0]


def _chunk(a: Tensor, u: Tensor, C: Tensor, h0: Tensor) -> tuple[Tensor, Tensor]:
    return _ChunkScan.apply(a, u, C, h0)


def _chunk_from_inputs(x, dt, A, B, C, h0, resets):
    a, u = _inputs(x, dt, A, B, resets)
    return _chunk(a, u, C.to(u.dtype), h0)


def selective_scan_chunked(x, dt, A, B, C, D=None, *, chunk_size: int = 64, initial_state=None, resets=None):
    """Fast form: log-depth scans inside chunks of `chunk_size`, the state passed from chunk to chunk (see the
    module docstring). Returns (y [b, t, d] in x's dtype, final_state [b, d, n] float32/float64)."""
    with no_autocast(x):
        return _selective_scan_chunked(x, dt, A, B, C, D, chunk_size, initial_state, resets)


def _selective_scan_chunked(x, dt, A, B, C, D, chunk_size, initial_state, resets):
    b, T, d = x.shape
    B, C = _groups(B), _groups(C)
    g, n = B.shape[2], B.shape[3]
    f = _dtype(x)
    h = x.new_zeros(b, g, d // g, n, dtype=f) if initial_state is None \
        else initial_state.to(f).reshape(b, g, d // g, n)
    Q = max(1, min(chunk_size, T))
    recompute = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, dt, A, B, C, initial_state))
    ys = []
    for s in range(0, T, Q):
        e = min(T, s + Q)
        args = (x[:, s:e], dt[:, s:e], A, B[:, s:e], C[:, s:e], h, None if resets is None else resets[:, s:e])
        y, h = checkpoint(_chunk_from_inputs, *args, use_reentrant=False) if recompute \
            else _chunk_from_inputs(*args)
        ys.append(y)
    y = torch.cat(ys, 1).reshape(b, T, d)
    if D is not None:
        y = y + x.to(f) * D.to(f)
    return y.to(x.dtype), h.reshape(b, d, n)


def selective_scan_step(x, dt, A, B, C, state, D=None, *, inplace: bool = False):
    """One decode step. x, dt [b, d]; B, C [b, g, n] or [b, n]; state [b, d, n] (float32). Returns
    (y [b, d], new_state). `inplace` updates `state` itself (a decode cache owns it) and returns it."""
    b, d = x.shape
    B, C = (t.unsqueeze(1) if t.dim() == 2 else t for t in (B, C))
    g, n = B.shape[1], B.shape[2]
    f = state.dtype
    dtf = dt.to(f)
    decay = torch.exp(dtf.unsqueeze(-1) * A.to(f))                       # [b, d, n]
    u = (dtf * x.to(f)).view(b, g, d // g, 1) * B.to(f).view(b, g, 1, n)
    if inplace:
        new = state.mul_(decay).view(b, g, d // g, n).add_(u)
    else:
        new = torch.addcmul(u, state.view(b, g, d // g, n), decay.view(b, g, d // g, n))
    y = (new @ C.to(f).view(b, g, n, 1)).view(b, d)
    if D is not None:
        y = y + x.to(f) * D.to(f)
    return y.to(x.dtype), new.view(b, d, n)
