"""The gated delta rule: Gated DeltaNet (scalar gate per head, Qwen3-Next) and Kimi Delta Attention (per-key-channel
gate, Kimi-Linear).

    S'_t = diag(exp(g_t)) S_{t-1}                         (g_t [K] per channel, or one scalar per head)
    S_t  = S'_t + β_t k_t (v_t - S'_tᵀ k_t)ᵀ             = (I - β_t k_t k_tᵀ) S'_t + β_t k_t v_tᵀ
    o_t  = scale · S_tᵀ q_t                               (state S: [key dim K, value dim V])

Shapes: q, k [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; log_decay g [B, T, H] (Gated DeltaNet) or [B, T, H, K]
(KDA), values <= 0; state [B, H, K, V]. `resets` [B, T] bool marks document starts in a packed batch (the carried
state is zeroed there). The state is kept in float32 (float64 for float64 inputs); outputs come back in q's dtype.
q and k are used as given: callers L2-normalise them (as both public models do) before calling.

    delta_rule_recurrent  token loop (reference)
    delta_rule_step       one decode token
"""
import torch
from torch import Tensor

from hybridlm.errors import InputError


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def check_delta_inputs(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_decay: Tensor,
                       initial_state: Tensor | None, resets: Tensor | None) -> None:
    if q.dim() != 4 or q.shape != k.shape:
        raise InputError(f"delta rule: q and k must share a [B, T, H, K] shape, got {tuple(q.shape)}, {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise InputError(f"delta rule: v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if beta.shape != (B, T, H):
        raise InputError(f"delta rule: beta must be [B, T, H] = {(B, T, H)}, got {tuple(beta.shape)}")
    if log_decay.shape not in ((B, T, H), (B, T, H, K)):
        raise InputError(f"delta rule: log_decay must be [B, T, H] (scalar gate) or [B, T, H, K] (per channel), "
                         f"got {tuple(log_decay.shape)}")
    if initial_state is not None and initial_state.shape != (B, H, K, v.shape[-1]):
        raise InputError(f"delta rule: initial_state must be [B, H, K, V] = {(B, H, K, v.shape[-1])}, "
                         f"got {tuple(initial_state.shape)}")
    if resets is not None and resets.shape != (B, T):
        raise InputError(f"delta rule: resets must be [B, T] = {(B, T)}, got {tuple(resets.shape)}")


def delta_rule_step(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_decay: Tensor, state: Tensor, *,
                    scale: float | None = None) -> tuple[Tensor, Tensor]:
    """One decode token. q, k [B, H, K]; v [B, H, V]; beta [B, H]; log_decay [B, H] or [B, H, K];
    state [B, H, K, V]. Returns (o [B, H, V] in q's dtype, new state [B, H, K, V] float32)."""
    dt = _compute_dtype(q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    a = torch.exp(log_decay.to(dt))
    a = a[..., None, None] if a.dim() == 2 else a[..., None]
    S = a * state.to(dt)
    kf, vf = k.to(dt), v.to(dt)
    u = (vf - (kf.unsqueeze(-2) @ S).squeeze(-2)) * beta.to(dt).unsqueeze(-1)   # β (v - Sᵀk)   [B, H, V]
    S = S + kf.unsqueeze(-1) * u.unsqueeze(-2)
    o = ((q.to(dt) * scale).unsqueeze(-2) @ S).squeeze(-2)
    return o.to(q.dtype), S


def delta_rule_recurrent(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_decay: Tensor, *,
                         scale: float | None = None, initial_state: Tensor | None = None,
                         resets: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Reference: the recurrence token by token. Shapes as in the module docstring.
    Returns (o [B, T, H, V], final_state [B, H, K, V] float32)."""
    check_delta_inputs(q, k, v, beta, log_decay, initial_state, resets)
    B, T, H, K = q.shape
    dt = _compute_dtype(q)
    g = log_decay.to(dt)
    if resets is not None:   # exp(-inf) = 0 drops the carried state at a document start
        g = g.masked_fill(resets.view(B, T, *([1] * (g.dim() - 2))), float("-inf"))
    S = q.new_zeros(B, H, K, v.shape[-1], dtype=dt) if initial_state is None else initial_state.to(dt)
    outs = []
    for t in range(T):
        o, S = delta_rule_step(q[:, t], k[:, t], v[:, t], beta[:, t], g[:, t], S, scale=scale)
        outs.append(o)
    if not outs:
        return v.new_zeros(v.shape, dtype=q.dtype), S
    return torch.stack(outs, 1), S
