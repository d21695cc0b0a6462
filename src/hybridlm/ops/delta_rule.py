"""The gated delta rule: Gated DeltaNet (scalar gate per head, Qwen3-Next) and Kimi Delta Attention (per-key-channel
gate, Kimi-Linear).

    S'_t = diag(exp(g_t)) S_{t-1}                         (g_t [K] per channel, or one scalar per head)
    S_t  = S'_t + β_t k_t (v_t - S'_tᵀ k_t)ᵀ             = (I - β_t k_t k_tᵀ) S'_t + β_t k_t v_tᵀ
    o_t  = scale · S_tᵀ q_t                               (state S: [key dim K, value dim V])

Shapes: q, k [B, T, Hk, K]; v [B, T, H, V]; beta [B, T, H]; log_decay g [B, T, H] (Gated DeltaNet) or [B, T, H, K]
(KDA), values <= 0; state [B, H, K, V]. Hk divides H: value head j reads key head j // (H / Hk) (Qwen3-Next's value
heads sharing key heads; the decode step takes Hk = H). `resets` [B, T] bool marks document starts in a packed batch (the carried
state is zeroed there). The state is kept in float32 (float64 for float64 inputs); outputs come back in q's dtype.
q and k are used as given: callers L2-normalise them (as both public models do) before calling.

    delta_rule_recurrent  token loop (reference)
    delta_rule_step       one decode token
    delta_rule_chunked    chunked WY / UT-transform form (training and prefill); `delta_rule` is this one

On CUDA tensors delta_rule_chunked is FLA's chunk_gated_delta_rule / chunk_kda when fla is installed (ops/fla.py;
HYBRIDLM_FLA=0 or HYBRIDLM_TRITON=0 turn it off); hybridlm has no Triton kernel of its own for it.
"""
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridlm.errors import InputError

from . import fla
from .gla import LOG_DECAY_MIN, SUBCHUNK, _compute_dtype, _DiagBlocks, _segsum
from .precision import caster, matmul_dtype, no_autocast


def check_delta_inputs(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_decay: Tensor,
                       initial_state: Tensor | None, resets: Tensor | None) -> None:
    if q.dim() != 4 or q.shape != k.shape:
        raise InputError(f"delta rule: q and k must share a [B, T, H, K] shape, got {tuple(q.shape)}, {tuple(k.shape)}")
    B, T, Hk, K = q.shape
    if v.dim() != 4 or v.shape[:2] != (B, T) or v.shape[2] % Hk:
        raise InputError(f"delta rule: v must be [B, T, H, V] = [{B}, {T}, H, V] with H a multiple of q/k's {Hk} "
                         f"heads, got {tuple(v.shape)}")
    H = v.shape[2]
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


def expand_key_heads(q: Tensor, k: Tensor, H: int) -> tuple[Tensor, Tensor]:
    """q, k [B, T, Hk, K] -> [B, T, H, K]: each key head repeated over the H / Hk value heads it serves."""
    r = H // q.shape[2]
    return (q, k) if r == 1 else (q.repeat_interleave(r, 2), k.repeat_interleave(r, 2))


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
    q, k = expand_key_heads(q, k, v.shape[2])
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


def _channel_scores(x: Tensor, y: Tensor, b: Tensor, lo=caster(None)) -> Tensor:
    """P[t, i] = sum_d x[t, d] y[i, d] exp(b[t, d] - b[i, d]) for i <= t, 0 above the diagonal; x, y, b
    [..., C, K] -> [..., C, C], b a non-increasing cumulative log decay. As in gla_chunked: diagonal SUBCHUNK
    blocks use the exact pairwise decay; a query sub-chunk against earlier keys factors the decay through the
    end g of the preceding sub-chunk, exp(b_t - g) and exp(g - b_i), both <= 1. `lo` casts the operands of the
    off-diagonal matmuls (ops/precision.py); the diagonal blocks stay in b's dtype."""
    C, K = x.shape[-2:]
    s = SUBCHUNK if C % SUBCHUNK == 0 else C
    ns, lead = C // s, x.shape[:-2]
    diag = _DiagBlocks.apply(*(t.reshape(*lead, ns, s, K) for t in (x, y, b))).unbind(-3)   # ns x [..., s, s]
    rows = []
    for r in range(ns):
        e = r * s
        parts = [diag[r]]
        if r:
            g = b[..., e - 1:e, :]
            parts.insert(0, (lo(x[..., e:e + s, :] * torch.exp(b[..., e:e + s, :] - g)) @
                             lo(y[..., :e, :] * torch.exp(g - b[..., :e, :])).transpose(-1, -2)).to(b.dtype))
        if e + s < C:
            parts.append(x.new_zeros(*lead, s, C - e - s))
        rows.append(torch.cat(parts, -1))
    return torch.cat(rows, -2)


def delta_rule_chunked(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_decay: Tensor, *,
                       scale: float | None = None, initial_state: Tensor | None = None,
                       resets: Tensor | None = None, chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """Fast form: the WY / UT transform of the Gated DeltaNet paper, per chunk of `chunk_size` tokens.
    Shapes as in the module docstring. Returns (o [B, T, H, V] in q's dtype, final_state [B, H, K, V] float32).

    With b_t the log decay from the chunk start to t (per channel or scalar) and S the state entering the chunk,
    the delta-rule writes w_t = β_t (v_t - S'_tᵀ k_t) satisfy the unit lower-triangular system

        w_t + β_t Σ_{i<t} ⟨k_t, k_i⟩_{b_t - b_i} w_i = β_t (v_t - Sᵀ (exp(b_t) ⊙ k_t))

    (⟨x, y⟩_c = Σ_d x_d y_d exp(c_d)), solved once per chunk for both right-hand parts: W = U - Kb S with
    U = (I + A)⁻¹ βV and Kb = (I + A)⁻¹ β exp(b) K. Then o_t = scale (exp(b_t) q_t)ᵀ S + scale Σ_{i<=t}
    ⟨q_t, k_i⟩_{b_t - b_i} w_i and the next state is exp(b_C) S + Σ_i (exp(b_C - b_i) k_i) w_iᵀ, a loop over
    chunks only. log_decay is clamped to [LOG_DECAY_MIN, 0] = [-40, 0]; resets are exact document masks.
    bf16 (or fp16) q or v, or autocast to it: the score, state and output matmuls read bf16 operands; decays, the
    triangular solve and the carried state stay float32 (ops/precision.py)."""
    check_delta_inputs(q, k, v, beta, log_decay, initial_state, resets)
    if chunk_size < 1:
        raise InputError(f"delta_rule_chunked: chunk_size must be >= 1, got {chunk_size}")
    if fla.enabled(q, k, v, beta, log_decay, key_dim=q.shape[-1]):
        return fla.delta_rule_fla(q, k, v, beta, log_decay, scale=scale, initial_state=initial_state, resets=resets)
    q, k = expand_key_heads(q, k, v.shape[2])
    lo = caster(matmul_dtype(q) or matmul_dtype(v))                # read before autocast is switched off
    with no_autocast(q):
        return _delta_rule_chunked(q, k, v, beta, log_decay, scale, initial_state, resets, chunk_size, lo)


def _delta_rule_chunked(q, k, v, beta, log_decay, scale, initial_state, resets, chunk_size, lo):
    """delta_rule_chunked's body; `lo` casts the matmul operands (the identity on the exact path)."""
    B, T, H, K = q.shape
    V, dt, C = v.shape[-1], _compute_dtype(q), chunk_size
    scale = K ** -0.5 if scale is None else scale
    N = max(1, math.ceil(T / C))
    pad = N * C - T
    per_channel = log_decay.dim() == 4

    w = log_decay.to(dt).clamp(LOG_DECAY_MIN, 0.0)
    if resets is not None:   # the decay at a document start is irrelevant: the carried state is masked below
        w = w.masked_fill(resets.view(B, T, *([1] * (w.dim() - 2))), 0.0)
    # padding tokens (k = 0, β = 0, no decay) leave the state and the real outputs unchanged

    def chunks(x: Tensor) -> Tensor:  # [B, T, H, ...] -> [B, H, N, C, ...]
        x = F.pad(x.to(dt), (0, 0) * (x.dim() - 2) + (0, pad))
        return x.transpose(1, 2).reshape(B, H, N, C, *x.shape[3:])

    qf, kf, vf, bt, w = chunks(q) * scale, chunks(k), chunks(v), chunks(beta).unsqueeze(-1), chunks(w)
    if per_channel:                                  # b [B, H, N, C, K]
        b = w.cumsum(-2)
        Akk = _channel_scores(kf, kf, b, lo)
        Aqk = _channel_scores(qf, kf, b, lo)
        k_end = kf * torch.exp(b[..., -1:, :] - b)
        chunk_decay = torch.exp(b[..., -1, :]).unsqueeze(-1)      # [B, H, N, K, 1]
    else:                                            # scalar: the pairwise decays from a masked cumsum (exact)
        L = torch.exp(_segsum(w))                    # [B, H, N, C, C], L[t, i] = exp(b_t - b_i), 0 for i > t
        b = w.cumsum(-1).unsqueeze(-1)               # [B, H, N, C, 1]
        kl = lo(kf)
        Akk = (kl @ kl.transpose(-1, -2)) * L
        Aqk = (lo(qf) @ kl.transpose(-1, -2)) * L
        k_end = kf * L[..., -1, :].unsqueeze(-1)
        chunk_decay = torch.exp(b[..., -1, :]).unsqueeze(-1)      # [B, H, N, 1, 1]
    k_start, q_start = kf * torch.exp(b), qf * torch.exp(b)

    if resets is not None:
        doc = F.pad(resets, (0, pad)).view(B, 1, N, C).long().cumsum(-1)   # document index within the chunk
        same = doc.unsqueeze(-1) == doc.unsqueeze(-2)
        Akk, Aqk = Akk * same, Aqk * same
        sees_carry = (doc == 0).unsqueeze(-1)
        k_start, q_start = k_start * sees_carry, q_start * sees_carry
        k_end = k_end * (doc == doc[..., -1:]).unsqueeze(-1)
        chunk_decay = chunk_decay * (doc[..., -1] == 0).view(B, 1, N, 1, 1)

    # the in-chunk system: one unit lower-triangular solve per chunk for both right-hand sides
    A = (Akk * bt).tril(-1)                          # strictly lower: β_t ⟨k_t, k_i⟩ for i < t
    rhs = torch.cat([vf * bt, k_start * bt], -1)
    sol = torch.linalg.solve_triangular(A + torch.eye(C, dtype=dt, device=q.device), rhs, upper=False,
                                        unitriangular=True)
    U, Kb = sol.split([V, K], -1)

    S = q.new_zeros(B, H, K, V, dtype=dt) if initial_state is None else initial_state.to(dt)
    carried, writes = [], []
    for U_n, Kb_n, ke_n, d_n in zip(U.unbind(2), Kb.unbind(2), k_end.unbind(2), chunk_decay.unbind(2)):
        carried.append(S)
        W_n = U_n - lo(Kb_n) @ lo(S)                  # [B, H, C, V] the chunk's delta-rule writes
        writes.append(W_n)
        S = d_n * S + lo(ke_n.transpose(-1, -2)) @ lo(W_n)
    o = (lo(q_start) @ lo(torch.stack(carried, 2))).to(dt) + lo(Aqk) @ lo(torch.stack(writes, 2))  # [B, H, N, C, V]
    o = o.reshape(B, H, N * C, V)[:, :, :T]
    return o.transpose(1, 2).to(q.dtype), S


delta_rule = delta_rule_chunked          # the fast form the layers use (G, K)
