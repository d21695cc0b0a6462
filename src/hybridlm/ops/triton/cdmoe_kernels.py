"""Triton kernels for CDMoE's private single-neuron experts (ops.moe.expert_neurons):

    y[n] = sum_i act(<down[id_ni], x[n]> · scale_ni) · gate_ni · up[id_ni]

One program per token gathers its k expert rows of the down table block by block along d (the pre-activations
h [k] accumulate in registers), then gathers the up rows and writes y: no [tokens, k, d] tensor exists. The
backward program recomputes nothing but the activation: it reads h saved by the forward, forms dx from the
gathered down rows and adds the table gradients with atomics (rows repeat across tokens and within one)."""
import triton
import triton.language as tl

SQRT1_2 = 0.7071067811865476
INV_SQRT_2PI = 0.3989422804014327


@triton.jit
def _act(h, ACT: tl.constexpr):
    if ACT == "silu":
        return h * tl.sigmoid(h)
    elif ACT == "relu":
        return tl.maximum(h, 0.0)
    else:                                                              # gelu (erf form)
        return 0.5 * h * (1.0 + tl.erf(h * SQRT1_2))


@triton.jit
def _act_grad(h, ACT: tl.constexpr):
    if ACT == "silu":
        sg = tl.sigmoid(h)
        return sg * (1.0 + h * (1.0 - sg))
    elif ACT == "relu":
        return tl.where(h > 0.0, 1.0, 0.0)
    else:
        return 0.5 * (1.0 + tl.erf(h * SQRT1_2)) + h * INV_SQRT_2PI * tl.exp(-0.5 * h * h)


@triton.jit
def cdmoe_fwd_kernel(x_ptr, down_ptr, up_ptr, ids_ptr, gate_ptr, scale_ptr, y_ptr, h_ptr,
                     D, KE, BKE: tl.constexpr, BD: tl.constexpr, ACT: tl.constexpr,
                     HAS_GATE: tl.constexpr, HAS_SCALE: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    ie = tl.arange(0, BKE)
    me = ie < KE
    ids = tl.load(ids_ptr + n * KE + ie, mask=me, other=0).to(tl.int64)
    h = tl.zeros([BKE], dtype=tl.float32)
    for d0 in range(0, D, BD):
        idd = d0 + tl.arange(0, BD)
        md = idd < D
        xb = tl.load(x_ptr + n * D + idd, mask=md, other=0.0).to(tl.float32)
        w = tl.load(down_ptr + ids[:, None] * D + idd[None, :], mask=me[:, None] & md[None, :], other=0.0)
        h += tl.sum(w.to(tl.float32) * xb[None, :], 1)
    tl.store(h_ptr + n * KE + ie, h, mask=me)
    if HAS_SCALE:
        h = h * tl.load(scale_ptr + n * KE + ie, mask=me, other=0.0).to(tl.float32)
    s = _act(h, ACT)
    if HAS_GATE:
        s = s * tl.load(gate_ptr + n * KE + ie, mask=me, other=0.0).to(tl.float32)
    s = tl.where(me, s, 0.0)
    for d0 in range(0, D, BD):
        idd = d0 + tl.arange(0, BD)
        md = idd < D
        u = tl.load(up_ptr + ids[:, None] * D + idd[None, :], mask=me[:, None] & md[None, :], other=0.0)
        y = tl.sum(u.to(tl.float32) * s[:, None], 0)
        tl.store(y_ptr + n * D + idd, y.to(y_ptr.dtype.element_ty), mask=md)


@triton.jit
def cdmoe_bwd_kernel(x_ptr, down_ptr, up_ptr, ids_ptr, gate_ptr, scale_ptr, h_ptr, dy_ptr,
                     dx_ptr, ddown_ptr, dup_ptr, dgate_ptr, dscale_ptr,
                     D, KE, BKE: tl.constexpr, BD: tl.constexpr, ACT: tl.constexpr,
                     HAS_GATE: tl.constexpr, HAS_SCALE: tl.constexpr):
    """dx [N, D] and dgate / dscale [N, k] are written; ddown / dup [E, D] float32 are accumulated into."""
    n = tl.program_id(0).to(tl.int64)
    ie = tl.arange(0, BKE)
    me = ie < KE
    ids = tl.load(ids_ptr + n * KE + ie, mask=me, other=0).to(tl.int64)
    h = tl.load(h_ptr + n * KE + ie, mask=me, other=0.0)
    ds = tl.zeros([BKE], dtype=tl.float32)                             # dL/ds_i = <dy, up_i>
    for d0 in range(0, D, BD):
        idd = d0 + tl.arange(0, BD)
        md = idd < D
        dyb = tl.load(dy_ptr + n * D + idd, mask=md, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + ids[:, None] * D + idd[None, :], mask=me[:, None] & md[None, :], other=0.0)
        ds += tl.sum(u.to(tl.float32) * dyb[None, :], 1)
    if HAS_SCALE:
        sc = tl.load(scale_ptr + n * KE + ie, mask=me, other=0.0).to(tl.float32)
        hs = h * sc
    else:
        hs = h
    a = _act(hs, ACT)
    if HAS_GATE:
        g = tl.load(gate_ptr + n * KE + ie, mask=me, other=0.0).to(tl.float32)
        tl.store(dgate_ptr + n * KE + ie, ds * a, mask=me)
        s = a * g
        dhs = ds * g * _act_grad(hs, ACT)
    else:
        s = a
        dhs = ds * _act_grad(hs, ACT)
    if HAS_SCALE:
        tl.store(dscale_ptr + n * KE + ie, dhs * h, mask=me)
        dh = dhs * sc
    else:
        dh = dhs
    s = tl.where(me, s, 0.0)
    dh = tl.where(me, dh, 0.0)
    for d0 in range(0, D, BD):
        idd = d0 + tl.arange(0, BD)
        md = idd < D
        m2 = me[:, None] & md[None, :]
        w = tl.load(down_ptr + ids[:, None] * D + idd[None, :], mask=m2, other=0.0).to(tl.float32)
        tl.store(dx_ptr + n * D + idd, tl.sum(w * dh[:, None], 0).to(dx_ptr.dtype.element_ty), mask=md)
        xb = tl.load(x_ptr + n * D + idd, mask=md, other=0.0).to(tl.float32)
        dyb = tl.load(dy_ptr + n * D + idd, mask=md, other=0.0).to(tl.float32)
        tl.atomic_add(ddown_ptr + ids[:, None] * D + idd[None, :], dh[:, None] * xb[None, :], mask=m2)
        tl.atomic_add(dup_ptr + ids[:, None] * D + idd[None, :], s[:, None] * dyb[None, :], mask=m2)
