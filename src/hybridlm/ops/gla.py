"""Gated linear attention (GLA) with a per-key-channel ("vector") decay, the token mixer of Rodimus.

    S_t = diag(exp(log_decay_t)) S_{t-1} + k_tᵀ v_t          (state S: [key dim K, value dim V])
    o_t = (scale · q_t) S_t

This is the Rodimus* paper, eq. 14 with β_t = 1 (section 3.1.1); the input gates α̂ and β̂ (eq. 9-11)
are folded into k and v by the caller. Four exact forms of the same operator:

    gla_recurrent  token loop (reference)
    gla_quadratic  masked parallel form, eq. 18, evaluated pairwise in log space (reference, moderate T)
    gla_chunked    chunkwise form, appendix C.3 eq. 19 (the fast path used for training and prefill)
    gla_step       one decode token

Shapes: q, k, log_decay [B, T, H, K]; v [B, T, H, V]; state [B, H, K, V]. `log_decay` holds values <= 0.
`resets` [B, T] bool marks document starts in a packed batch: the state carried into that token is
zeroed (the same as log_decay = -inf there), so a packed batch equals separate runs. The state is kept
in float32 (float64 if the inputs are float64) whatever the input dtype; outputs come back in q's dtype.
"""
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridlm.errors import InputError
from hybridlm.ops import fla
from hybridlm.ops.precision import caster, matmul_dtype, no_autocast
from hybridlm.ops.triton import enabled as triton_enabled

# gla_chunked clamps log_decay to [LOG_DECAY_MIN, 0]: exp(-40) ≈ 4e-18 is invisible next to float32
# rounding, and the floor keeps in-chunk cumulative sums small enough that their differences stay precise
# (and -inf never meets -inf). Use `resets` for exact document boundaries.
LOG_DECAY_MIN = -40.0
# inside a chunk, blocks of this many tokens on the diagonal use the exact pairwise form (see gla_chunked)
SUBCHUNK = 8


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, initial_state: Tensor | None,
           resets: Tensor | None) -> None:
    if q.dim() != 4 or q.shape != k.shape or q.shape != log_decay.shape:
        raise InputError(f"gla: q, k, log_decay must share a [B, T, H, K] shape, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(log_decay.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise InputError(f"gla: v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if initial_state is not None and initial_state.shape != (B, H, K, v.shape[-1]):
        raise InputError(f"gla: initial_state must be [B, H, K, V] = {(B, H, K, v.shape[-1])}, "
                         f"got {tuple(initial_state.shape)}")
    if resets is not None and resets.shape != (B, T):
        raise InputError(f"gla: resets must be [B, T] = {(B, T)}, got {tuple(resets.shape)}")


def _zero_state(q: Tensor, v: Tensor, dtype: torch.dtype) -> Tensor:
    B, _, H, K = q.shape
    return q.new_zeros(B, H, K, v.shape[-1], dtype=dtype)


def gla_step(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, state: Tensor, *,
             scale: float | None = None) -> tuple[Tensor, Tensor]:
    """One decode token. q, k, log_decay [B, H, K]; v [B, H, V]; state [B, H, K, V] (float32).
    Returns (o [B, H, V] in q's dtype, new_state [B, H, K, V] float32)."""
    dt = _compute_dtype(q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    state = torch.exp(log_decay.to(dt)).unsqueeze(-1) * state.to(dt) + \
        k.to(dt).unsqueeze(-1) * v.to(dt).unsqueeze(-2)
    o = (q.to(dt) * scale).unsqueeze(-2) @ state                  # [B, H, 1, V]
    return o.squeeze(-2).to(q.dtype), state


def gla_recurrent(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, *, scale: float | None = None,
                  initial_state: Tensor | None = None, resets: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Reference: the recurrence token by token. q, k, log_decay [B, T, H, K]; v [B, T, H, V];
    initial_state [B, H, K, V] or None; resets [B, T] bool or None.
    Returns (o [B, T, H, V], final_state [B, H, K, V] float32)."""
    _check(q, k, v, log_decay, initial_state, resets)
    dt = _compute_dtype(q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    w = log_decay.to(dt)
    if resets is not None:  # exp(-inf) = 0 drops the carried state at a document start
        w = w.masked_fill(resets[:, :, None, None], float("-inf"))
    a, qs, kf, vf = torch.exp(w), q.to(dt) * scale, k.to(dt), v.to(dt)
    S = _zero_state(q, v, dt) if initial_state is None else initial_state.to(dt)
    outs = []
    for t in range(q.shape[1]):
        S = a[:, t, :, :, None] * S + kf[:, t, :, :, None] * vf[:, t, :, None, :]
        outs.append((qs[:, t, :, None, :] @ S).squeeze(-2))      # [B, H, V]
    if not outs:
        return v.new_zeros(v.shape, dtype=q.dtype), S
    return torch.stack(outs, 1).to(q.dtype), S


def _segsum(w: Tensor) -> Tensor:
    """w [..., T] -> [..., T, T] with out[t, i] = sum_{j=i+1..t} w_j for i <= t, -inf above the diagonal.
    A masked cumsum rather than a difference of cumsums, so -inf entries (resets) never meet -inf."""
    T = w.shape[-1]
    x = w.unsqueeze(-1).expand(*w.shape, T)                        # x[..., j, i] = w_j
    strict = torch.ones(T, T, dtype=torch.bool, device=w.device).tril(-1)
    x = x.masked_fill(~strict, 0.0).cumsum(-2)
    lower = torch.ones(T, T, dtype=torch.bool, device=w.device).tril()
    return x.masked_fill(~lower, float("-inf"))


def gla_quadratic(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, *, scale: float | None = None,
                  initial_state: Tensor | None = None, resets: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Reference: the masked parallel form (the Rodimus* paper, eq. 18) plus the initial-state term.
    Eq. 18 factors the decay as (Q ⊙ 𝒜)(K / 𝒜)ᵀ, which overflows for long or strongly decaying inputs, so
    here every pair (t, i) gets its own decay exp(sum_{j=i+1..t} log_decay_j) per key channel:
    O(T² K) memory, meant for tests. Shapes as gla_recurrent."""
    _check(q, k, v, log_decay, initial_state, resets)
    dt = _compute_dtype(q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    w = log_decay.to(dt)
    if resets is not None:
        w = w.masked_fill(resets[:, :, None, None], float("-inf"))
    qs, kf, vf = (q.to(dt) * scale).transpose(1, 2), k.to(dt).transpose(1, 2), v.to(dt).transpose(1, 2)
    w = w.permute(0, 2, 3, 1)                                      # [B, H, K, T]
    L = _segsum(w)                                                 # [B, H, K, T, T]
    scores = torch.einsum("bhtd,bhid,bhdti->bhti", qs, kf, torch.exp(L))   # [B, H, T, T]
    o = scores @ vf                                                # [B, H, T, V]
    # final state: each token decayed to the end (last row of the segsum)
    S = torch.einsum("bhdi,bhid,bhiv->bhdv", torch.exp(L[..., -1, :]), kf, vf)
    if initial_state is not None:
        cum = torch.exp(w.cumsum(-1))                              # [B, H, K, T]: decay from start to t
        S0 = initial_state.to(dt)
        o = o + (qs * cum.transpose(-1, -2)) @ S0
        S = S + cum[..., -1, None] * S0
    return o.transpose(1, 2).to(q.dtype), S


class _DiagBlocks(torch.autograd.Function):
    """A[t, i] = sum_d q[t, d] k[i, d] exp(b[t, d] - b[i, d]) for i <= t (0 above the diagonal), over
    blocks q, k, b [..., s, K] -> A [..., s, s]. The [..., s, s, K] decay tensor is the costly part, so
    it is rebuilt in backward instead of saved, with in-place ops (about half the memory traffic of
    plain autograd)."""

    @staticmethod
    def _decay(b: Tensor) -> Tensor:
        s = b.shape[-2]
        upper = torch.ones(s, s, dtype=torch.bool, device=b.device).triu(1)
        E = b.unsqueeze(-2) - b.unsqueeze(-3)                      # [..., t, i, K], <= 0 where i <= t
        return E.masked_fill_(upper[..., None], float("-inf")).exp_()

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, b: Tensor) -> Tensor:
        ctx.save_for_backward(q, k, b)
        W = _DiagBlocks._decay(b).mul_(k.unsqueeze(-3))           # W[t, i, d] = decay * k[i, d]
        return (W @ q.unsqueeze(-1)).squeeze(-1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gA: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, b = ctx.saved_tensors
        M = _DiagBlocks._decay(b).mul_(gA.unsqueeze(-1))          # dL/dA[t, i] * decay[t, i, d]
        dq = (M * k.unsqueeze(-3)).sum(-2)
        dk = (M.mul_(q.unsqueeze(-2))).sum(-3)
        # b[t] enters with + (query side) and b[i] with - (key side); the diagonal cancels exactly
        db = q * dq - k * dk
        return dq, dk, db


def gla_chunked(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, *, scale: float | None = None,
                initial_state: Tensor | None = None, resets: Tensor | None = None,
                chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """Fast form (the Rodimus* paper, appendix C.3 eq. 19): the sequence is cut into chunks of
    `chunk_size`; inside a chunk the parallel form gives the outputs, between chunks the state is passed
    by a loop over chunks. Shapes as gla_recurrent: q, k, log_decay [B, T, H, K]; v [B, T, H, V];
    initial_state [B, H, K, V] or None; resets [B, T] bool or None.
    Returns (o [B, T, H, V], final_state [B, H, K, V] float32).

    Every exponent is <= 0 (decays are measured from a reference point that precedes the position
    they scale), so T = 16k with log_decay ≈ -5 per step neither over- nor underflows into inf/NaN:
      - state passing: keys decayed to the chunk end, queries decayed from the chunk start;
      - inside a chunk, blocks of SUBCHUNK queries against earlier sub-chunks factor the decay
        through the start of the query sub-chunk: (q ⊙ exp(b_t - g)) (k ⊙ exp(g - b_i))ᵀ;
      - the diagonal SUBCHUNK x SUBCHUNK blocks use the exact pairwise form exp(b_t - b_i) per channel.
    Resets are applied as document masks (not -inf decays), so they are exact and NaN-free.
    log_decay is clamped to [LOG_DECAY_MIN, 0] = [-40, 0] to keep in-chunk cumulative sums precise.
    bf16 (or fp16) q or v, or autocast to it: the in-chunk and state matmuls read bf16 operands; decays, cumsums,
    the diagonal blocks and the carried state stay float32 (ops/precision.py).
    CUDA tensors go to FLA's chunk_gla when fla is installed (ops/fla.py), else to our Triton kernels (ops/triton)
    when triton imports; HYBRIDLM_FLA=0 skips FLA, HYBRIDLM_TRITON=0 both.
    """
    _check(q, k, v, log_decay, initial_state, resets)
    if fla.enabled(q, k, v, log_decay, key_dim=q.shape[-1]):
        return fla.gla_fla(q, k, v, log_decay, scale=scale, initial_state=initial_state, resets=resets)
    if triton_enabled(q, k, v, log_decay) and len({q.dtype, k.dtype, v.dtype}) == 1:
        from hybridlm.ops.triton import gla_chunked_triton
        return gla_chunked_triton(q, k, v, log_decay, scale=scale, initial_state=initial_state, resets=resets,
                                  chunk_size=chunk_size)
    if chunk_size < 1:
        raise InputError(f"gla_chunked: chunk_size must be >= 1, got {chunk_size}")
    lo = caster(matmul_dtype(q) or matmul_dtype(v))                # read before autocast is switched off
    with no_autocast(q):
        return _gla_chunked(q, k, v, log_decay, scale, initial_state, resets, chunk_size, lo)


def _gla_chunked(q, k, v, log_decay, scale, initial_state, resets, chunk_size, lo):
    """gla_chunked's CPU form; `lo` casts the matmul operands (the identity on the exact path)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = _compute_dtype(q)
    scale = K ** -0.5 if scale is None else scale
    C = chunk_size
    s = SUBCHUNK if C % SUBCHUNK == 0 else C                       # sub-chunk size
    ns = C // s
    N = max(1, math.ceil(T / C))
    pad = N * C - T

    w = log_decay.to(dt).clamp(LOG_DECAY_MIN, 0.0)                 # <= 0: cumsums never increase
    if resets is not None:  # the decay at a document start is irrelevant: the carried state is masked
        w = w.masked_fill(resets[:, :, None, None], 0.0)
    # padding: zero q/k/v and zero log-decay change neither the outputs nor the final state
    qf, kf, vf = (F.pad(x.to(dt), (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    w = F.pad(w, (0, 0, 0, 0, 0, pad))
    qf = qf * scale

    def chunks(x: Tensor) -> Tensor:  # [B, N*C, H, D] -> [B, H, N, C, D]
        return x.transpose(1, 2).reshape(B, H, N, C, x.shape[-1])

    qf, kf, vf, w = chunks(qf), chunks(kf), chunks(vf), chunks(w)
    b = w.cumsum(-2)                                               # [B, H, N, C, K] log decay chunk start -> t
    b_last = b[..., -1:, :]                                        # [B, H, N, 1, K]

    if resets is not None:
        r = F.pad(resets, (0, pad)).view(B, 1, N, C)
        doc = r.long().cumsum(-1)                                  # [B, 1, N, C] document index within the chunk
        sees_carry = (doc == 0).unsqueeze(-1)                      # no reset in the chunk up to t
        reaches_end = (doc == doc[..., -1:]).unsqueeze(-1)         # no reset in the chunk after i
        chunk_keeps = (doc[..., -1] == 0).unsqueeze(-1)            # [B, 1, N, 1] no reset in the whole chunk

    # 1. each chunk's own contribution to its end state, and the decay across the whole chunk
    k_end = kf * torch.exp(b_last - b)
    if resets is not None:
        k_end = k_end * reaches_end
    vl = lo(vf)
    U = (lo(k_end.transpose(-1, -2)) @ vl).to(dt)                  # [B, H, N, K, V]
    chunk_decay = torch.exp(b_last.squeeze(-2))                    # [B, H, N, K]
    if resets is not None:
        chunk_decay = chunk_decay * chunk_keeps

    # 2. state passing: a loop over chunks, not tokens
    S = _zero_state(q, v, dt) if initial_state is None else initial_state.to(dt)
    carried = []
    # unbind, not U[:, :, n]: indexing would make backward allocate a full-size zero gradient per chunk
    for decay_n, U_n in zip(chunk_decay.unsqueeze(-1).unbind(2), U.unbind(2)):
        carried.append(S)
        S = decay_n * S + U_n
    carried = torch.stack(carried, 2)                              # [B, H, N, K, V] state entering each chunk

    # 3. inter-chunk output: queries decayed from the chunk start read the carried state
    q_start = qf * torch.exp(b)
    if resets is not None:
        q_start = q_start * sees_carry
    o = lo(q_start) @ lo(carried)                                  # [B, H, N, C, V]

    # 4. intra-chunk output, diagonal sub-blocks: exact pairwise decay per key channel
    qs = qf.view(B, H, N, ns, s, K)
    ks = kf.view(B, H, N, ns, s, K)
    bs = b.view(B, H, N, ns, s, K)
    A = _DiagBlocks.apply(qs, ks, bs)                              # [B, H, N, ns, s, s]
    if resets is not None:
        ds = doc.view(B, 1, N, ns, s)
        A = A * (ds.unsqueeze(-1) == ds.unsqueeze(-2))
    o_intra = (lo(A) @ vl.view(B, H, N, ns, s, V)).to(dt)          # [B, H, N, ns, s, V]

    # 5. intra-chunk output, query sub-chunk r >= 1 against the keys of all earlier sub-chunks, the decay
    #    factored through g (log decay from the chunk start to the end of sub-chunk r-1): both
    #    exp(b_t - g) for t in sub-chunk r and exp(g - b_i) for i before it are <= 1.
    if ns > 1:
        outs = list(o_intra.unbind(3))                             # ns x [B, H, N, s, V]
        q_sub, b_sub = qs.unbind(3), bs.unbind(3)
        for r in range(1, ns):
            e = r * s                                              # keys [0, e) precede sub-chunk r
            g = b[..., e - 1:e, :]                                 # [B, H, N, 1, K]
            q_g = q_sub[r] * torch.exp(b_sub[r] - g)               # [B, H, N, s, K]
            k_g = kf[..., :e, :] * torch.exp(g - b[..., :e, :])    # [B, H, N, e, K]
            A_r = lo(q_g) @ lo(k_g.transpose(-1, -2))              # [B, H, N, s, e]
            if resets is not None:
                A_r = A_r * (ds[..., r, :, None] == doc[..., None, :e])
            outs[r] = outs[r] + lo(A_r) @ vl[..., :e, :]
        o_intra = torch.stack(outs, 3)

    o = (o + o_intra.reshape(B, H, N, C, V)).reshape(B, H, N * C, V)[:, :, :T]
    return o.transpose(1, 2).to(q.dtype), S
