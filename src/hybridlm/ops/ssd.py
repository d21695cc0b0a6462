"""State-space duality (SSD, Mamba-2) with a scalar decay per head: three exact forms of one operator.

    h_t = exp(dt_t * A) h_{t-1} + dt_t * x_t ⊗ B_t          (state h: [heads, headdim, d_state])
    y_t = h_t · C_t

Shapes: x [b, t, h, p]; dt [b, t, h] (already softplus'd); A [h] (negative); B, C [b, t, g, n] with
h % g == 0 (head h reads group h // (h/g)). State [b, h, p, n] is float32. `resets` [b, t] bool marks
document starts in a packed batch: setting the log-decay to -inf there zeroes the carried state
(the Mamba-2 paper, section 8). The D skip connection is applied by the layer, not here.
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from . import fla
from .precision import caster, matmul_dtype, no_autocast
from .triton import enabled as triton_enabled


def _log_decay(dt: Tensor, A: Tensor, resets: Tensor | None) -> Tensor:
    a = dt.float() * A.float()                                    # [b, t, h], <= 0
    if resets is not None:
        a = a.masked_fill(resets.unsqueeze(-1), float("-inf"))
    return a


def _expand_groups(t: Tensor, h: int) -> Tensor:
    """[b, t, g, n] -> [b, t, h, n] by repeating each group over its heads."""
    return t.repeat_interleave(h // t.shape[2], dim=2) if t.shape[2] != h else t


def segsum(a: Tensor) -> Tensor:
    """Stable segment sum: a [..., T] -> [..., T, T] with out[i, j] = sum_{k=j+1..i} a_k for i >= j,
    -inf above the diagonal. Built from a masked cumsum (no differences of cumsums, so -inf entries
    from resets never meet +inf)."""
    T = a.shape[-1]
    ones = torch.ones(T, T, dtype=torch.bool, device=a.device)
    x = torch.where(torch.tril(ones, -1), a.unsqueeze(-1), 0.0).cumsum(dim=-2)   # x[..., i, j] = a_i masked
    return torch.where(torch.tril(ones), x, float("-inf"))


def ssd_recurrent(x, dt, A, B, C, *, initial_state=None, resets=None):
    """Reference: token-by-token recurrence. Returns (y [b, t, h, p], final_state [b, h, p, n])."""
    b, T, h, p = x.shape
    a = _log_decay(dt, A, resets)
    Bh, Ch = _expand_groups(B, h).float(), _expand_groups(C, h).float()
    state = x.new_zeros(b, h, p, B.shape[-1], dtype=torch.float32) if initial_state is None \
        else initial_state.float()
    ys = []
    for t in range(T):
        state = torch.exp(a[:, t])[..., None, None] * state + \
            (dt[:, t, :, None].float() * x[:, t].float())[..., None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]))
    return torch.stack(ys, 1).to(x.dtype), state


def ssd_quadratic(x, dt, A, B, C, *, initial_state=None, resets=None):
    """Reference: the masked quadratic (attention-like) form y = (L ∘ C Bᵀ) (dt·x) + C·(decay·h0)."""
    b, T, h, p = x.shape
    a = _log_decay(dt, A, resets).transpose(1, 2)                  # [b, h, t]
    L = torch.exp(segsum(a))                                       # [b, h, t, t]
    Bh, Ch = _expand_groups(B, h).float(), _expand_groups(C, h).float()
    xdt = x.float() * dt.float().unsqueeze(-1)
    scores = torch.einsum("bthn,bshn->bhts", Ch, Bh) * L
    y = torch.einsum("bhts,bshp->bthp", scores, xdt)
    acum = torch.cumsum(a, -1)                                     # decay from t=0 to t (inclusive)
    if initial_state is not None:
        y = y + torch.einsum("bthn,bhpn,bht->bthp", Ch, initial_state.float(), torch.exp(acum))
    # final state: every token decayed to the end, plus the decayed initial state
    to_end = torch.exp(segsum(a)[..., -1, :])                      # [b, h, t]: sum_{k>s} a_k
    final = torch.einsum("bhs,bshn,bshp->bhpn", to_end, Bh, xdt)
    if initial_state is not None:
        final = final + torch.exp(acum[..., -1])[..., None, None] * initial_state.float()
    return y.to(x.dtype), final


def ssd_chunked(x, dt, A, B, C, *, chunk_size: int = 64, initial_state=None, resets=None):
    """Fast form: quadratic inside chunks of `chunk_size`, state passing between chunks
    (the Mamba-2 paper, listing 1). Returns (y [b, t, h, p], final_state [b, h, p, n] float32).

    Layout: heads are split as (group, head-in-group) so B/C are never repeated over heads, and the
    state/output matmuls run per (batch, chunk, group) over all of that group's heads at once
    ([Q, n] x [n, heads*p]), with no expanded operands; the scan over chunks carries the state.

    bf16 (or fp16) x, or autocast to it: the four matmuls read bf16 operands; decays, cumsums and the carried state
    stay float32 (ops/precision.py). CUDA tensors go to FLA's chunk_simple_gla when fla is installed (ops/fla.py),
    else mamba_ssm's kernel when that is, else our Triton kernels (ops/triton) when triton imports; HYBRIDLM_FLA=0
    skips FLA, HYBRIDLM_TRITON=0 all three."""
    if fla.enabled(x, dt, B, C, key_dim=B.shape[-1]):
        return fla.ssd_fla(x, dt, A, B, C, initial_state=initial_state, resets=resets)
    if fla.mamba_enabled(x, dt, B, C):
        return fla.ssd_mamba(x, dt, A, B, C, initial_state=initial_state, resets=resets)
    if triton_enabled(x, dt, B, C):
        from .triton import ssd_chunked_triton
        return ssd_chunked_triton(x, dt, A, B, C, chunk_size=chunk_size, initial_state=initial_state,
                                  resets=resets)
    lo = caster(matmul_dtype(x))                                   # read before autocast is switched off
    with no_autocast(x):
        return _ssd_chunked(x, dt, A, B, C, chunk_size, initial_state, resets, lo)


def _ssd_chunked(x, dt, A, B, C, chunk_size, initial_state, resets, lo):
    """ssd_chunked's CPU form; `lo` casts the matmul operands (the identity on the exact path)."""
    b, T, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    hg = h // g
    Q = min(chunk_size, T)
    pad = (-T) % Q
    a = _log_decay(dt, A, resets)                                  # [b, t, h]
    xdt = x.float() * dt.float().unsqueeze(-1)                     # [b, t, h, p]
    Bf, Cf = B.float(), C.float()
    if pad:  # zero input, zero decay: padding changes neither outputs nor the final state
        a = F.pad(a, (0, 0, 0, pad))
        xdt = F.pad(xdt, (0, 0, 0, 0, 0, pad))
        Bf = F.pad(Bf, (0, 0, 0, 0, 0, pad))
        Cf = F.pad(Cf, (0, 0, 0, 0, 0, pad))
    c = (T + pad) // Q
    a = a.view(b, c, Q, h).transpose(2, 3)                         # [b, c, h, Q]
    acum = torch.cumsum(a, dim=-1)                                 # decay chunk start -> l (inclusive)
    Bc = lo(Bf.view(b, c, Q, g, n).transpose(2, 3))                # [b, c, g, Q, n]
    Cc = lo(Cf.view(b, c, Q, g, n).transpose(2, 3))

    # 1. intra-chunk outputs: (L ∘ C Bᵀ) xdt, one [Q, Q] x [Q, p] product per head
    CB = Cc @ Bc.transpose(-1, -2)                                 # [b, c, g, Q, Q]
    L = torch.exp(segsum(a))                                       # [b, c, h, Q, Q]
    M = (L.view(b, c, g, hg, Q, Q) * CB.unsqueeze(3)).view(b, c, h, Q, Q)
    y_diag = lo(M) @ lo(xdt.view(b, c, Q, h, p).transpose(2, 3))   # [b, c, h, Q, p]

    # 2. each chunk's own final state: decay every token to the chunk end (exclusive reverse cumsum)
    rev = torch.flip(torch.cumsum(torch.flip(a, [-1]), -1), [-1])
    to_end = torch.exp(F.pad(rev[..., 1:], (0, 1)))               # sum_{k>s} a_k, no differences
    xd = xdt.view(b, c, Q, h, p) * to_end.transpose(2, 3).unsqueeze(-1)      # [b, c, Q, h, p]
    states = lo(xd.view(b, c, Q, g, hg * p).permute(0, 1, 3, 4, 2)) @ Bc     # [b, c, g, hg*p, n]
    states = states.view(b, c, h, p, n).float()

    # 3. pass states between chunks (a scan over chunks, not tokens)
    decay = torch.exp(acum[..., -1]).unsqueeze(-1).unsqueeze(-1)   # [b, c, h, 1, 1]
    prev = x.new_zeros(b, h, p, n, dtype=torch.float32) if initial_state is None else initial_state.float()
    st, dc = states.unbind(1), decay.unbind(1)
    carried = [prev]
    for i in range(c):
        prev = torch.addcmul(st[i], prev, dc[i])
        if i + 1 < c:
            carried.append(prev)
    carried = torch.stack(carried, 1)                              # [b, c, h, p, n]: state entering chunk

    # 4. contribution of the carried state to each position: exp(acum_l) · C_l · h_prev
    y_off = Cc @ lo(carried.view(b, c, g, hg * p, n).transpose(-1, -2))       # [b, c, g, Q, hg*p]
    y_off = y_off.view(b, c, g, Q, hg, p) * torch.exp(acum).view(b, c, g, hg, Q).transpose(3, 4).unsqueeze(-1)
    y = y_off + y_diag.view(b, c, g, hg, Q, p).transpose(3, 4)     # [b, c, g, Q, hg, p]
    y = y.transpose(2, 3).reshape(b, c * Q, h, p)[:, :T]
    return y.to(x.dtype), prev


def ssd_step(x, dt, A, B, C, state, *, inplace: bool = False):
    """One decode step. x [b, h, p]; dt [b, h]; B, C [b, g, n]; state [b, h, p, n] (float32).
    Returns (y [b, h, p], new_state). `inplace` updates `state` itself (a decode cache owns its state: this
    saves writing two state-sized temporaries per step) and returns it as new_state."""
    b, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    dtf = dt.float()
    decay = torch.exp(dtf * A.float()).view(b, h, 1, 1)
    xdt = (x.float() * dtf.unsqueeze(-1)).view(b, g, h // g, p, 1)
    Bg = B.float().view(b, g, 1, 1, n)                              # groups broadcast over their heads
    if inplace:
        new = state.mul_(decay).view(b, g, h // g, p, n).addcmul_(xdt, Bg)
    else:
        new = torch.addcmul((state * decay).view(b, g, h // g, p, n), xdt, Bg)
    y = new @ C.float().view(b, g, 1, n, 1)                       # [b, g, h/g, p, 1]
    return y.view(b, h, p).to(x.dtype), new.view(b, h, p, n)
