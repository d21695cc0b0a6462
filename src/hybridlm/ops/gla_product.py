"""Gated linear attention whose decay acts on both state dims: the product decay β_t of
the Rodimus* paper (eq. 7 and 14-17, the ablation of table 12).

    S_t = (α_tᵀ β_t) ⊙ S_{t-1} + k_tᵀ v_t        α_t = exp(log_decay_t) [K], β_t = exp(log_value_decay_t) [V]
    o_t = (scale · q_t) S_t

Rodimus itself sets β_t = 1 (section 3.1.1) and uses `ops.gla`; this op exists for the ablation.
Shapes as ops.gla: q, k, log_decay [B, T, H, K]; v, log_value_decay [B, T, H, V]; state [B, H, K, V]
(float32, float64 for float64 inputs); resets [B, T] bool zeroes the state carried into a document start.

The fast form moves β onto the values inside short blocks (eq. 16-17 with a block-local cumulative product
P_t = ∏_{j=block start..t} β_j): S_t = S'_t diag(P_t) where S' is plain GLA over the values v / P_t, so
`gla_chunked` does all the α work for every block at once; the carried state passes between blocks in a
loop over blocks. 1/P stays below exp(BLOCK · -VALUE_LOG_DECAY_MIN) = e^64, far from float32 overflow.
"""
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .gla import LOG_DECAY_MIN, gla_chunked

BLOCK = 8
# β_t below e^-8 ≈ 3e-4 is raised to it (the state is then forgotten to 3e-4 instead of less)
VALUE_LOG_DECAY_MIN = -8.0


def _dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def gla_product_step(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, log_value_decay: Tensor, state: Tensor,
                     *, scale: float | None = None) -> tuple[Tensor, Tensor]:
    """One decode token. q, k, log_decay [B, H, K]; v, log_value_decay [B, H, V]; state [B, H, K, V].
    Returns (o [B, H, V] in q's dtype, new_state)."""
    dt = _dtype(q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    decay = torch.exp(log_decay.to(dt)).unsqueeze(-1) * torch.exp(log_value_decay.to(dt)).unsqueeze(-2)
    state = decay * state.to(dt) + k.to(dt).unsqueeze(-1) * v.to(dt).unsqueeze(-2)
    o = ((q.to(dt) * scale).unsqueeze(-2) @ state).squeeze(-2)
    return o.to(q.dtype), state


def gla_product_recurrent(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, log_value_decay: Tensor, *,
                          scale: float | None = None, initial_state: Tensor | None = None,
                          resets: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Reference: the recurrence token by token. Returns (o [B, T, H, V], final_state [B, H, K, V])."""
    B, T, H, K = q.shape
    dt = _dtype(q)
    S = q.new_zeros(B, H, K, v.shape[-1], dtype=dt) if initial_state is None else initial_state.to(dt)
    outs = []
    for t in range(T):
        if resets is not None:
            S = S * (~resets[:, t]).to(dt)[:, None, None, None]
        o, S = gla_product_step(q[:, t], k[:, t], v[:, t], log_decay[:, t], log_value_decay[:, t], S, scale=scale)
        outs.append(o)
    return torch.stack(outs, 1), S


def gla_product_chunked(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, log_value_decay: Tensor, *,
                        scale: float | None = None, initial_state: Tensor | None = None,
                        resets: Tensor | None = None, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """Fast form (see the module docstring). Returns (o [B, T, H, V], final_state [B, H, K, V])."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = _dtype(q)
    scale = K ** -0.5 if scale is None else scale
    C = block
    N = max(1, math.ceil(T / C))
    pad = N * C - T

    def blocks(x: Tensor) -> Tensor:  # [B, T, H, D] -> [B, N, C, H, D], zero padded (no input, no decay)
        return F.pad(x.to(dt), (0, 0, 0, 0, 0, pad)).view(B, N, C, H, x.shape[-1])

    wa = blocks(log_decay.clamp(min=LOG_DECAY_MIN))
    wb = blocks(log_value_decay.clamp(min=VALUE_LOG_DECAY_MIN))
    Lb = wb.cumsum(2)                                              # [B, N, C, H, V] log β product from block start
    P = torch.exp(Lb)
    A = torch.exp(wa.cumsum(2))                                    # [B, N, C, H, K] α product from block start
    qb, kb, vb = blocks(q), blocks(k), blocks(v)
    r = None
    if resets is not None:
        r = F.pad(resets, (0, pad)).view(B * N, C)

    # every block on its own (zero initial state): plain GLA over v / P, then rescaled by P
    # v · exp(-Lb) rather than v / P: the gradient of a division would square 1/P (e^128 overflows float32)
    o_loc, S_loc = gla_chunked(qb.flatten(0, 1), kb.flatten(0, 1), (vb * torch.exp(-Lb)).flatten(0, 1),
                               wa.flatten(0, 1),
                               scale=scale, resets=r, chunk_size=C)
    o = o_loc.view(B, N, C, H, V) * P
    P_end = P[:, :, -1]                                            # [B, N, H, V]
    S_loc = S_loc.view(B, N, H, K, V) * P_end.unsqueeze(-2)
    carry_decay = A[:, :, -1].unsqueeze(-1) * P_end.unsqueeze(-2)  # [B, N, H, K, V]
    sees_carry = None
    if r is not None:
        doc = r.view(B, N, C).long().cumsum(-1)
        sees_carry = (doc == 0)[..., None, None].to(dt)            # [B, N, C, 1, 1] no reset yet in the block
        carry_decay = carry_decay * (doc[..., -1] == 0)[..., None, None, None].to(dt)

    # pass the state between blocks (a loop over blocks, not tokens)
    S = q.new_zeros(B, H, K, V, dtype=dt) if initial_state is None else initial_state.to(dt)
    carried = []
    for n in range(N):
        carried.append(S)
        S = carry_decay[:, n] * S + S_loc[:, n]
    carried = torch.stack(carried, 1)                              # [B, N, H, K, V] state entering each block

    # the carried state read by every query of its block: (q ⊙ A_t) S_in ⊙ P_t
    inter = torch.einsum("bnchk,bnhkv->bnchv", qb * scale * A, carried) * P
    if sees_carry is not None:
        inter = inter * sees_carry
    o = (o + inter).reshape(B, N * C, H, V)[:, :T]
    return o.to(q.dtype), S
