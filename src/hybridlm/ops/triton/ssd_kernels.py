"""Triton kernels for chunked SSD (Mamba-2): scalar decay per head, grouped B/C, initial/final state, resets.

One program per (batch, head) walks the chunks in order, carrying the [p, n] state in registers: inside a
chunk the quadratic form gives the outputs, between chunks the state is passed (the Mamba-2 paper,
listing 1). Backward walks the chunks in reverse, carrying d(state) the same way; the forward saves the state
entering every chunk for it. Resets are document masks inside a chunk (as gla_chunked does), so no -inf
ever meets another -inf in a difference of cumulative sums.

Per chunk (Q tokens, a_l = dt_l·A with a = 0 at a reset, acum = in-chunk cumsum, doc = in-chunk reset count):
    L[t, s]  = [s <= t, doc_t = doc_s] exp(acum_t - acum_s)
    y_t      = sum_s L[t, s] (C_t·B_s) dt_s x_s + w_t C_t·H,      w_t = [doc_t = 0] exp(acum_t)
    H'       = d H + sum_s e_s dt_s x_s ⊗ B_s,  e_s = [doc_s = doc_last] exp(acum_last - acum_s),
               d = [no reset in the chunk] exp(acum_last)
"""
import triton
import triton.language as tl

from ._common import dot as _dot


@triton.jit
def ssd_fwd_kernel(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, r_ptr, h0_ptr, y_ptr, states_ptr, final_ptr,
                   T, H, G, P, N, NC,
                   Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                   HAS_H0: tl.constexpr, HAS_RESETS: tl.constexpr, SAVE_STATES: tl.constexpr,
                   LOWP: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)                                # int64 offsets: states exceed 2**31 elements
    ib = pid // H
    ih = pid % H
    ig = ih // (H // G)
    iq = tl.arange(0, Q)
    ip = tl.arange(0, BP)
    i_n = tl.arange(0, BN)
    mp = ip < P
    mn = i_n < N
    A = tl.load(A_ptr + ih).to(tl.float32)
    causal = iq[:, None] >= iq[None, :]
    st_off = ip[:, None] * N + i_n[None, :]
    st_mask = mp[:, None] & mn[None, :]
    if HAS_H0:
        h = tl.load(h0_ptr + (ib * H + ih) * P * N + st_off, mask=st_mask, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BP, BN], dtype=tl.float32)
    for c in range(0, NC):
        t = c * Q + iq
        mt = t < T
        x = tl.load(x_ptr + ((ib * T + t[:, None]) * H + ih) * P + ip[None, :],
                    mask=mt[:, None] & mp[None, :], other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + (ib * T + t) * H + ih, mask=mt, other=0.0).to(tl.float32)
        Bm = tl.load(B_ptr + ((ib * T + t[:, None]) * G + ig) * N + i_n[None, :],
                     mask=mt[:, None] & mn[None, :], other=0.0).to(tl.float32)
        Cm = tl.load(C_ptr + ((ib * T + t[:, None]) * G + ig) * N + i_n[None, :],
                     mask=mt[:, None] & mn[None, :], other=0.0).to(tl.float32)
        a = dt * A
        if HAS_RESETS:
            r = tl.load(r_ptr + ib * T + t, mask=mt, other=0).to(tl.int32)
            a = tl.where(r != 0, 0.0, a)
            doc = tl.cumsum(r, 0)
            doc_last = tl.sum(r, 0)
            same = causal & (doc[:, None] == doc[None, :])
            w = tl.where(doc == 0, tl.exp(tl.cumsum(a, 0)), 0.0)
        else:
            same = causal
        acum = tl.cumsum(a, 0)
        acum_last = tl.sum(a, 0)
        if not HAS_RESETS:
            w = tl.exp(acum)
        L = tl.exp(tl.where(same, acum[:, None] - acum[None, :], float("-inf")))
        xdt = x * dt[:, None]
        CB = _dot(Cm, tl.trans(Bm), LOWP)                              # [Q, Q]
        y = _dot(CB * L, xdt, LOWP)                                    # [Q, P]
        y += w[:, None] * _dot(Cm, tl.trans(h), LOWP)
        tl.store(y_ptr + ((ib * T + t[:, None]) * H + ih) * P + ip[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=mt[:, None] & mp[None, :])
        if SAVE_STATES:
            tl.store(states_ptr + ((ib * H + ih) * NC + c) * P * N + st_off, h, mask=st_mask)
        e = tl.exp(acum_last - acum)
        decay = tl.exp(acum_last)
        if HAS_RESETS:
            e = tl.where(doc == doc_last, e, 0.0)
            decay = tl.where(doc_last == 0, decay, 0.0)
        h = decay * h + _dot(tl.trans(xdt * e[:, None]), Bm, LOWP)
    tl.store(final_ptr + (ib * H + ih) * P * N + st_off, h, mask=st_mask)


@triton.jit
def ssd_bwd_kernel(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, r_ptr, states_ptr, dy_ptr, dfinal_ptr,
                   dx_ptr, ddt_ptr, dAt_ptr, dB_ptr, dC_ptr, dh0_ptr,
                   T, H, G, P, N, NC,
                   Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                   HAS_H0: tl.constexpr, HAS_RESETS: tl.constexpr, LOWP: tl.constexpr):
    """Gradients per token: dx, ddt [b, T, h] (through x·dt and the decay), dAt = d(a)·dt [b, T, h] (summed
    into dA by the caller), dB, dC [b, T, g, n] float32 (zeroed by the caller; every head of a group adds in)."""
    pid = tl.program_id(0).to(tl.int64)                                # int64 offsets: states exceed 2**31 elements
    ib = pid // H
    ih = pid % H
    ig = ih // (H // G)
    iq = tl.arange(0, Q)
    ip = tl.arange(0, BP)
    i_n = tl.arange(0, BN)
    mp = ip < P
    mn = i_n < N
    A = tl.load(A_ptr + ih).to(tl.float32)
    causal = iq[:, None] >= iq[None, :]
    st_off = ip[:, None] * N + i_n[None, :]
    st_mask = mp[:, None] & mn[None, :]
    dh = tl.load(dfinal_ptr + (ib * H + ih) * P * N + st_off, mask=st_mask, other=0.0)   # d(state after chunk)
    for cc in range(0, NC):
        c = NC - 1 - cc
        t = c * Q + iq
        mt = t < T
        mtp = mt[:, None] & mp[None, :]
        mtn = mt[:, None] & mn[None, :]
        x = tl.load(x_ptr + ((ib * T + t[:, None]) * H + ih) * P + ip[None, :], mask=mtp, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + ((ib * T + t[:, None]) * H + ih) * P + ip[None, :], mask=mtp,
                     other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + (ib * T + t) * H + ih, mask=mt, other=0.0).to(tl.float32)
        Bm = tl.load(B_ptr + ((ib * T + t[:, None]) * G + ig) * N + i_n[None, :], mask=mtn, other=0.0).to(tl.float32)
        Cm = tl.load(C_ptr + ((ib * T + t[:, None]) * G + ig) * N + i_n[None, :], mask=mtn, other=0.0).to(tl.float32)
        h = tl.load(states_ptr + ((ib * H + ih) * NC + c) * P * N + st_off, mask=st_mask, other=0.0)
        a = dt * A
        if HAS_RESETS:
            r = tl.load(r_ptr + ib * T + t, mask=mt, other=0).to(tl.int32)
            a = tl.where(r != 0, 0.0, a)
            doc = tl.cumsum(r, 0)
            doc_last = tl.sum(r, 0)
            same = causal & (doc[:, None] == doc[None, :])
            w = tl.where(doc == 0, tl.exp(tl.cumsum(a, 0)), 0.0)
        else:
            same = causal
        acum = tl.cumsum(a, 0)
        acum_last = tl.sum(a, 0)
        if not HAS_RESETS:
            w = tl.exp(acum)
        L = tl.exp(tl.where(same, acum[:, None] - acum[None, :], float("-inf")))
        e = tl.exp(acum_last - acum)
        decay = tl.exp(acum_last)
        if HAS_RESETS:
            e = tl.where(doc == doc_last, e, 0.0)
            decay = tl.where(doc_last == 0, decay, 0.0)
        xdt = x * dt[:, None]
        CB = _dot(Cm, tl.trans(Bm), LOWP)                              # [Q(t), Q(s)]
        DX = _dot(dy, tl.trans(xdt), LOWP)                             # dy_t · xdt_s
        M = CB * L
        LDX = L * DX
        BdH = _dot(Bm, tl.trans(dh), LOWP)                             # [Q, P]: (dH B_s)
        ChT = _dot(Cm, tl.trans(h), LOWP)                              # [Q, P]: (H C_t)
        dxdt = _dot(tl.trans(M), dy, LOWP) + e[:, None] * BdH
        dB = _dot(tl.trans(LDX), Cm, LOWP) + e[:, None] * _dot(xdt, dh, LOWP)
        dC = _dot(LDX, Bm, LOWP) + w[:, None] * _dot(dy, h, LOWP)
        # d(acum): L[t, s] depends on +acum_t and -acum_s; w on +acum_t; e on +acum_last and -acum_s;
        # the chunk decay on +acum_last
        GL = LDX * CB
        de = tl.sum(xdt * BdH, 1) * e
        dacum = tl.sum(GL, 1) - tl.sum(GL, 0) + w * tl.sum(dy * ChT, 1) - de
        dlast = tl.sum(de, 0) + decay * tl.sum(tl.sum(dh * h, 1), 0)
        dacum += tl.where(iq == Q - 1, dlast, 0.0)
        da = tl.cumsum(dacum, 0, reverse=True)                         # acum_l = sum_{m <= l} a_m
        if HAS_RESETS:
            da = tl.where(r != 0, 0.0, da)
        dx = dxdt * dt[:, None]
        ddt = tl.sum(dxdt * x, 1) + da * A
        tl.store(dx_ptr + ((ib * T + t[:, None]) * H + ih) * P + ip[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mtp)
        tl.store(ddt_ptr + (ib * T + t) * H + ih, ddt, mask=mt)
        tl.store(dAt_ptr + (ib * T + t) * H + ih, da * dt, mask=mt)
        # a group's heads add into its B/C gradients: [b, T, g, n] float32, not one copy per head
        tl.atomic_add(dB_ptr + ((ib * T + t[:, None]) * G + ig) * N + i_n[None, :], dB, mask=mtn)
        tl.atomic_add(dC_ptr + ((ib * T + t[:, None]) * G + ig) * N + i_n[None, :], dC, mask=mtn)
        # d(state entering this chunk) = decay · d(state after) + the outputs' reads of it
        dh = decay * dh + _dot(tl.trans(dy * w[:, None]), Cm, LOWP)
    if HAS_H0:
        tl.store(dh0_ptr + (ib * H + ih) * P * N + st_off, dh, mask=st_mask)
