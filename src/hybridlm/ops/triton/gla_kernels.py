"""Triton kernels for chunked gated linear attention with a per-key-channel decay (ops/gla.py).

One program per (batch, head) walks the chunks in order, carrying the [K, V] state in registers; backward
walks them in reverse carrying d(state), reading the state entering each chunk that the forward saved.
Every exponent is <= 0, as in gla_chunked: queries are decayed from the chunk start, keys to the chunk end,
and inside a chunk each key column j gets the exact pairwise decay exp(b_t - b_j) per channel (one [chunk, K]
tile per column, no [chunk, chunk, K] tensor). Resets are document masks, never -inf decays.

Per chunk (b = in-chunk cumsum of the clamped log decay w, doc = in-chunk reset count):
    o_t = (q_t ⊙ exp(b_t))·S [doc_t = 0] + sum_{j <= t, doc_j = doc_t} (sum_d q_td k_jd exp(b_td - b_jd)) v_j
    S'  = exp(b_last) S [no reset in the chunk] + sum_j [doc_j = doc_last] (k_j ⊙ exp(b_last - b_j)) ⊗ v_j
"""
import triton
import triton.language as tl

from ._common import dot as _dot


@triton.jit
def _load_chunk(q_ptr, k_ptr, v_ptr, w_ptr, r_ptr, ib, ih, c, T, H, K, V, scale, LOG_DECAY_MIN,
                Q: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_RESETS: tl.constexpr):
    it = tl.arange(0, Q)
    ik = tl.arange(0, BK)
    iv = tl.arange(0, BV)
    t = c * Q + it
    mt = t < T
    mtk = mt[:, None] & (ik < K)[None, :]
    mtv = mt[:, None] & (iv < V)[None, :]
    offk = ((ib * T + t[:, None]) * H + ih) * K + ik[None, :]
    offv = ((ib * T + t[:, None]) * H + ih) * V + iv[None, :]
    q = tl.load(q_ptr + offk, mask=mtk, other=0.0).to(tl.float32) * scale
    k = tl.load(k_ptr + offk, mask=mtk, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offv, mask=mtv, other=0.0).to(tl.float32)
    w_raw = tl.load(w_ptr + offk, mask=mtk, other=0.0).to(tl.float32)
    w = tl.minimum(tl.maximum(w_raw, LOG_DECAY_MIN), 0.0)
    if HAS_RESETS:
        r = tl.load(r_ptr + ib * T + t, mask=mt, other=0).to(tl.int32)
        w = tl.where(r[:, None] != 0, 0.0, w)    # the carried state is masked at a reset, its decay irrelevant
        doc = tl.cumsum(r, 0)
    else:
        r = tl.zeros([Q], dtype=tl.int32)
        doc = r
    return q, k, v, w_raw, w, r, doc, offk, offv, mtk, mtv


@triton.jit
def _key_row(k_ptr, v_ptr, w_ptr, r_ptr, ib, ih, tj, T, H, K, V, b_j, doc_j, LOG_DECAY_MIN,
             BK: tl.constexpr, BV: tl.constexpr, HAS_RESETS: tl.constexpr):
    """Key row tj: k [BK], v [BV], and the running log decay b_j [BK] / document index doc_j [1] advanced past it
    (the same clamp and reset masking as _load_chunk). Loaded rather than sliced out of the chunk tiles:
    a register tile has no cheap row access."""
    ik = tl.arange(0, BK)
    iv = tl.arange(0, BV)
    t1 = tj + tl.arange(0, 1)                                          # [1]: masks are tensors
    row = (ib * T + tj) * H + ih
    k_j = tl.load(k_ptr + row * K + ik, mask=(ik < K) & (t1 < T), other=0.0).to(tl.float32)
    v_j = tl.load(v_ptr + row * V + iv, mask=(iv < V) & (t1 < T), other=0.0).to(tl.float32)
    w_j = tl.load(w_ptr + row * K + ik, mask=(ik < K) & (t1 < T), other=0.0).to(tl.float32)
    w_j = tl.minimum(tl.maximum(w_j, LOG_DECAY_MIN), 0.0)
    if HAS_RESETS:
        r_j = tl.load(r_ptr + ib * T + t1, mask=t1 < T, other=0).to(tl.int32)
        w_j = tl.where(r_j != 0, 0.0, w_j)
        doc_j += r_j
    return k_j, v_j, b_j + w_j, doc_j


@triton.jit
def gla_fwd_kernel(q_ptr, k_ptr, v_ptr, w_ptr, r_ptr, h0_ptr, o_ptr, states_ptr, final_ptr,
                   T, H, K, V, NC, scale, LOG_DECAY_MIN,
                   Q: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   HAS_H0: tl.constexpr, HAS_RESETS: tl.constexpr, SAVE_STATES: tl.constexpr,
                   LOWP: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)                                # int64 offsets: states exceed 2**31 elements
    ib = pid // H
    ih = pid % H
    it = tl.arange(0, Q)
    ik = tl.arange(0, BK)
    iv = tl.arange(0, BV)
    st_off = ik[:, None] * V + iv[None, :]
    st_mask = (ik < K)[:, None] & (iv < V)[None, :]
    if HAS_H0:
        S = tl.load(h0_ptr + (ib * H + ih) * K * V + st_off, mask=st_mask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    for c in range(0, NC):
        q, k, v, w_raw, w, r, doc, offk, offv, mtk, mtv = _load_chunk(
            q_ptr, k_ptr, v_ptr, w_ptr, r_ptr, ib, ih, c, T, H, K, V, scale, LOG_DECAY_MIN, Q, BK, BV, HAS_RESETS)
        b = tl.cumsum(w, 0)                                            # [Q, BK] log decay chunk start -> t
        b_last = tl.sum(w, 0)                                          # [BK]
        doc_last = tl.max(doc, 0)
        eq = tl.exp(b)                                                 # query side: from the chunk start
        ek = tl.exp(b_last[None, :] - b)                               # key side: to the chunk end
        decay = tl.exp(b_last)
        if HAS_RESETS:
            eq = tl.where(doc[:, None] == 0, eq, 0.0)
            ek = tl.where(doc[:, None] == doc_last, ek, 0.0)
            decay = tl.where(doc_last == 0, decay, 0.0)
        qg = q * eq
        kd = k * ek
        o = _dot(qg, S, LOWP)
        # intra-chunk scores, one key column at a time with the exact pairwise decay
        A = tl.zeros([Q, Q], dtype=tl.float32)
        b_j = tl.zeros([BK], dtype=tl.float32)                         # key j's log decay from the chunk start
        doc_j = tl.zeros([1], dtype=tl.int32)                          # key j's document in the chunk
        nj = T - c * Q                                                 # keys in this chunk: skip the padding
        if nj > Q:
            nj = Q
        for j in range(0, nj):
            k_j, v_j, b_j, doc_j = _key_row(k_ptr, v_ptr, w_ptr, r_ptr, ib, ih, c * Q + j, T, H, K, V, b_j, doc_j,
                                            LOG_DECAY_MIN, BK, BV, HAS_RESETS)
            seen = (it >= j) & (doc == doc_j)
            E = tl.exp(tl.where(seen[:, None], b - b_j[None, :], float("-inf")))
            a_j = tl.sum(q * E * k_j[None, :], 1)
            A = tl.where(it[None, :] == j, a_j[:, None], A)
        o += _dot(A, v, LOWP)
        tl.store(o_ptr + offv, o.to(o_ptr.dtype.element_ty), mask=mtv)
        if SAVE_STATES:
            tl.store(states_ptr + ((ib * H + ih) * NC + c) * K * V + st_off, S, mask=st_mask)
        S = decay[:, None] * S + _dot(tl.trans(kd), v, LOWP)
    tl.store(final_ptr + (ib * H + ih) * K * V + st_off, S, mask=st_mask)


@triton.jit
def gla_bwd_kernel(q_ptr, k_ptr, v_ptr, w_ptr, r_ptr, states_ptr, do_ptr, dfinal_ptr,
                   dq_ptr, dk_ptr, dv_ptr, dw_ptr, dh0_ptr,
                   T, H, K, V, NC, scale, LOG_DECAY_MIN,
                   Q: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   HAS_H0: tl.constexpr, HAS_RESETS: tl.constexpr, LOWP: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)                                # int64 offsets: states exceed 2**31 elements
    ib = pid // H
    ih = pid % H
    it = tl.arange(0, Q)
    ik = tl.arange(0, BK)
    iv = tl.arange(0, BV)
    st_off = ik[:, None] * V + iv[None, :]
    st_mask = (ik < K)[:, None] & (iv < V)[None, :]
    dS = tl.load(dfinal_ptr + (ib * H + ih) * K * V + st_off, mask=st_mask, other=0.0)   # d(state after chunk)
    for cc in range(0, NC):
        c = NC - 1 - cc
        q, k, v, w_raw, w, r, doc, offk, offv, mtk, mtv = _load_chunk(
            q_ptr, k_ptr, v_ptr, w_ptr, r_ptr, ib, ih, c, T, H, K, V, scale, LOG_DECAY_MIN, Q, BK, BV, HAS_RESETS)
        do = tl.load(do_ptr + offv, mask=mtv, other=0.0).to(tl.float32)
        S = tl.load(states_ptr + ((ib * H + ih) * NC + c) * K * V + st_off, mask=st_mask, other=0.0)
        b = tl.cumsum(w, 0)
        b_last = tl.sum(w, 0)
        doc_last = tl.max(doc, 0)
        eq = tl.exp(b)                                                 # query side: from the chunk start
        ek = tl.exp(b_last[None, :] - b)                               # key side: to the chunk end
        decay = tl.exp(b_last)
        if HAS_RESETS:
            eq = tl.where(doc[:, None] == 0, eq, 0.0)
            ek = tl.where(doc[:, None] == doc_last, ek, 0.0)
            decay = tl.where(doc_last == 0, decay, 0.0)
        qg = q * eq
        kd = k * ek
        # carried state read by the queries: o += qg S
        dqg = _dot(do, tl.trans(S), LOWP)                              # [Q, BK]
        dq = dqg * eq
        db = dqg * qg
        # this chunk's contribution to the next state: S' = decay S + kdᵀ v
        dkd = _dot(v, tl.trans(dS), LOWP)                              # [Q, BK]
        dk = dkd * ek
        dv = _dot(kd, dS, LOWP)
        db -= dkd * kd
        dlast = tl.sum(dkd * kd, 0) + decay * tl.sum(dS * S, 1)        # [BK]
        # intra-chunk pairs: the scores A are rebuilt column by column with their gradients
        A = tl.zeros([Q, Q], dtype=tl.float32)
        dq_i = tl.zeros([Q, BK], dtype=tl.float32)
        dk_i = tl.zeros([Q, BK], dtype=tl.float32)
        b_j = tl.zeros([BK], dtype=tl.float32)                         # key j's log decay from the chunk start
        doc_j = tl.zeros([1], dtype=tl.int32)                          # key j's document in the chunk
        nj = T - c * Q                                                 # keys in this chunk: skip the padding
        if nj > Q:
            nj = Q
        for j in range(0, nj):
            k_j, v_j, b_j, doc_j = _key_row(k_ptr, v_ptr, w_ptr, r_ptr, ib, ih, c * Q + j, T, H, K, V, b_j, doc_j,
                                            LOG_DECAY_MIN, BK, BV, HAS_RESETS)
            seen = (it >= j) & (doc == doc_j)
            E = tl.exp(tl.where(seen[:, None], b - b_j[None, :], float("-inf")))
            qE = q * E
            A = tl.where(it[None, :] == j, tl.sum(qE * k_j[None, :], 1)[:, None], A)
            dA_j = tl.where(seen, tl.sum(do * v_j[None, :], 1), 0.0)    # dL/dA[:, j]
            dq_i += dA_j[:, None] * E * k_j[None, :]
            dk_i = tl.where(it[:, None] == j, tl.sum(dA_j[:, None] * qE, 0)[None, :], dk_i)
        dv += _dot(tl.trans(A), do, LOWP)
        dq += dq_i
        dk += dk_i
        db += q * dq_i - k * dk_i                                      # exp(b_t - b_j): + on t, - on j
        db += tl.where(it[:, None] == Q - 1, dlast[None, :], 0.0)
        dw = tl.cumsum(db, 0, reverse=True)                            # b_t = sum_{u <= t} w_u
        keep = (w_raw >= LOG_DECAY_MIN) & (w_raw <= 0.0)               # clamp passes gradients inside its range
        if HAS_RESETS:
            keep = keep & (r[:, None] == 0)
        dw = tl.where(keep, dw, 0.0)
        tl.store(dq_ptr + offk, (dq * scale).to(dq_ptr.dtype.element_ty), mask=mtk)
        tl.store(dk_ptr + offk, dk.to(dk_ptr.dtype.element_ty), mask=mtk)
        tl.store(dv_ptr + offv, dv.to(dv_ptr.dtype.element_ty), mask=mtv)
        tl.store(dw_ptr + offk, dw.to(dw_ptr.dtype.element_ty), mask=mtk)
        dS = decay[:, None] * dS + _dot(tl.trans(qg), do, LOWP)
    if HAS_H0:
        tl.store(dh0_ptr + (ib * H + ih) * K * V + st_off, dS, mask=st_mask)
