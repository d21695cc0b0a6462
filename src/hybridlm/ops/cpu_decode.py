"""One-token decode ops on a CPU as single C++ calls (csrc/decode_ops.cpp, built into the kernels' library by
ops/cpu_kernels.py, whose public functions they call with the tensors' pointers): at batch 1 the reference forms
below cost a few microseconds of dispatch per small PyTorch op, 30-80 ops a layer, more than the layer's
matrix-vector kernels on small models. The whole-mixer steps (layers/cpu_steps.py) run the same C++ inside one call. Each function has its reference's
signature and semantics (the reference named in its docstring; tests/test_cpu_decode.py holds them together):

    ssd_step            ops/ssd.ssd_step (inplace)           state float32 [B, H, P, N], updated in place
    ssd_gated_step      the same with Mamba-2's dt, A and D skip computed inside (the layer's lines around it)
    gla_step            ops/gla.gla_step                     state float32 [B, H, K, V], updated in place
    delta_rule_step     ops/delta_rule.delta_rule_step       state float32 [B, H, K, V], updated in place
    gated_delta_step    the same with Gated DeltaNet's / KDA's L2 norms and gates computed inside (the layers'
                        decode lines before delta_rule_step)
    conv_step           ops/conv.causal_conv1d_step (+ SiLU) conv tail [B, W-1, C] in x's dtype, shifted in place
    decode_attention    ops/attention.decode_attention       reads each row's own keys as stored (strides, lengths)
    rms_norm            ops/norm.rms_norm / gated_rms_norm   (+ the residual add before it)

Sums are float32 (the references' bf16 paths round some intermediates to bf16: the fast forms differ from them by
bf16 rounding there). Callers use the fast form when `serves(...)`: CPU tensors, no gradient, not inside
torch.compile, the library built, float32 / bf16 data; else the reference. A state the fast form updates in place
must be the cache's own (decode rebinds the slot to the returned tensor either way).
"""
import torch
from torch import Tensor

from . import cpu_kernels

_DTYPES = (torch.float32, torch.bfloat16)


def serves(*ts: Tensor | None) -> bool:
    """True when the fast forms can take these tensors (see the module docstring)."""
    grad = torch.is_grad_enabled()
    for t in ts:
        if t is not None and (t.device.type != "cpu" or (grad and t.requires_grad) or t.dtype not in _DTYPES):
            return False
    return not torch.compiler.is_compiling() and cpu_kernels.available()


def one_token(x: Tensor) -> bool:
    """True when x [..., d] is a decode step's few rows (cpu_kernels.DECODE_ROWS at most)."""
    return cpu_kernels.decode_sized(x)


def _f32(t: Tensor) -> Tensor:
    return t.float().contiguous()


def owned(state: Tensor, dtype: torch.dtype) -> Tensor:
    """`state` itself when it can be updated in place (contiguous, own storage, `dtype`), else a copy that can."""
    if state.dtype == dtype and state.is_contiguous() and state._base is None:
        return state
    return state.to(dtype).contiguous().clone()


def ssd_step(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """ops/ssd.ssd_step(..., inplace=True): x [b, h, p]; dt [b, h]; A [h]; B, C [b, g, n]; state [b, h, p, n]
    float32 -> (y [b, h, p] in x's dtype, the state updated in place)."""
    b, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    state = owned(state, torch.float32)
    xf, dtf, Af, Bf, Cf = (_f32(t) for t in (x, dt, A, B, C))
    y = torch.empty(b, h, p)
    cpu_kernels.dec_ssd_step(xf.data_ptr(), dtf.data_ptr(), Af.data_ptr(), Bf.data_ptr(), Cf.data_ptr(),
                                  state.data_ptr(), y.data_ptr(), b, h, p, g, n)
    return y.to(x.dtype), state


def ssd_gated_step(x: Tensor, dt: Tensor, dt_bias: Tensor, A_log: Tensor, D: Tensor, B: Tensor, C: Tensor,
                   state: Tensor, *, dt_limit: tuple[float, float] | None = None) -> tuple[Tensor, Tensor]:
    """Mamba-2's decode step from the layer's raw inputs: dt = softplus(dt + dt_bias) (clamped to `dt_limit`),
    A = -exp(A_log), ssd_step, then y + D x (the layer's lines around ops/ssd.ssd_step). x [b, h, p]; dt [b, h];
    dt_bias, A_log, D [h]; B, C [b, g, n]; state [b, h, p, n] float32, updated in place -> (y [b, h, p] in x's
    dtype, the state)."""
    b, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    state = owned(state, torch.float32)
    lo, hi = dt_limit if dt_limit is not None else (0.0, float("inf"))
    xf, dtf, bf, af, df, Bf, Cf = (_f32(t) for t in (x, dt, dt_bias, A_log, D, B, C))
    y = torch.empty(b, h, p)
    cpu_kernels.dec_ssd_gated(xf.data_ptr(), dtf.data_ptr(), bf.data_ptr(), af.data_ptr(), df.data_ptr(), lo, hi,
                                   Bf.data_ptr(), Cf.data_ptr(), state.data_ptr(), y.data_ptr(), b, h, p, g, n)
    return y.to(x.dtype), state


def gla_step(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, state: Tensor, *,
             scale: float | None = None) -> tuple[Tensor, Tensor]:
    """ops/gla.gla_step: q, k, log_decay [B, H, K]; v [B, H, V]; state [B, H, K, V] float32 -> (o [B, H, V] in q's
    dtype, the state updated in place)."""
    B, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    state = owned(state, torch.float32)
    qf, kf, vf, lf = (_f32(t) for t in (q, k, v, log_decay))
    o = torch.empty(B, H, V)
    cpu_kernels.dec_gla_step(qf.data_ptr(), kf.data_ptr(), vf.data_ptr(), lf.data_ptr(), state.data_ptr(),
                                  o.data_ptr(), B, H, K, V, scale)
    return o.to(q.dtype), state


def delta_rule_step(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_decay: Tensor, state: Tensor, *,
                    scale: float | None = None) -> tuple[Tensor, Tensor]:
    """ops/delta_rule.delta_rule_step: q, k [B, H, K]; v [B, H, V]; beta [B, H]; log_decay [B, H] or [B, H, K];
    state [B, H, K, V] float32 -> (o [B, H, V] in q's dtype, the state updated in place)."""
    B, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    state = owned(state, torch.float32)
    qf, kf, vf, bf, lf = (_f32(t) for t in (q, k, v, beta, log_decay))
    o = torch.empty(B, H, V)
    cpu_kernels.dec_delta_step(qf.data_ptr(), kf.data_ptr(), vf.data_ptr(), bf.data_ptr(), lf.data_ptr(),
                                    int(log_decay.dim() == 3), state.data_ptr(), o.data_ptr(), B, H, K, V, scale)
    return o.to(q.dtype), state


def gated_delta_step(qkv: Tensor, b: Tensor, a: Tensor, A_log: Tensor, dt_bias: Tensor, state: Tensor, *,
                     key_heads: int, head_k: int, scale: float | None = None, eps: float = 1e-6
                     ) -> tuple[Tensor, Tensor]:
    """The decode step of Gated DeltaNet and KDA from the layer's raw inputs, gates included: qkv [B, 2 Hk K + H V]
    ([q | k | v] after the conv), q and k L2-normalised (ops/norm.l2_norm), key head h // (H / Hk) serving value head
    h; beta = sigmoid(b [B, H]); log decay = -exp(A_log) · softplus(a + dt_bias): a [B, H], dt_bias [H] (Gated
    DeltaNet) or a [B, H, K], dt_bias [H * K] (KDA, per key channel); then delta_rule_step. state [B, H, K, V]
    float32, updated in place -> (o [B, H, V] in qkv's dtype, the state)."""
    B, H = b.shape
    K, V = head_k, state.shape[-1]
    state = owned(state, torch.float32)
    qf, bf, af, Af, df = (_f32(t) for t in (qkv, b, a, A_log, dt_bias))
    o = torch.empty(B, H, V)
    cpu_kernels.dec_delta_gated(qf.data_ptr(), bf.data_ptr(), af.data_ptr(), Af.data_ptr(), df.data_ptr(),
                                     int(a.dim() == 3), state.data_ptr(), o.data_ptr(), B, H, key_heads, K, V,
                                     K ** -0.5 if scale is None else scale, eps)
    return o.to(qkv.dtype), state


def conv_step(x: Tensor, state: Tensor, weight: Tensor, bias: Tensor | None = None, *,
              silu: bool = False) -> tuple[Tensor, Tensor]:
    """ops/conv.causal_conv1d_step (then SiLU when `silu`): x [B, C]; state [B, W-1, C]; weight [C, W]; bias [C]
    -> (y [B, C] in x's dtype, the state in x's dtype, shifted in place)."""
    Bn, C = x.shape
    W = weight.shape[1]
    dt = x.dtype
    state = owned(state, dt)
    xc, w = x.contiguous(), weight.to(dt).contiguous()
    b = bias.to(dt).contiguous() if bias is not None else None
    y = torch.empty(Bn, C, dtype=dt)
    cpu_kernels.dec_conv_step(xc.data_ptr(), state.data_ptr(), w.data_ptr(), b.data_ptr() if b is not None
                                   else None, y.data_ptr(), Bn, C, W, int(silu), int(dt == torch.bfloat16))
    return y, state


def decode_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None,
                     lengths: Tensor | None = None) -> Tensor:
    """ops/attention.decode_attention: q [B, 1, Hq, D]; k [B, S, Hk, D], v [B, S, Hv, Dv] (the cache's buffers: any
    batch, time and head strides, each head's row contiguous), Hk and Hv dividing Hq; `lengths` [B] int64: row b
    attends its first lengths[b] keys (None: all S) -> [B, 1, Hq, Dv]. Reads only each row's own keys, in runs split
    over the threads with an online softmax (a long cache or one key head still uses every thread)."""
    B, _, Hq, D = q.shape
    S, Hk, Hv, Dv = k.shape[1], k.shape[2], v.shape[2], v.shape[3]
    dt = k.dtype
    if v.dtype != dt or k.stride(3) != 1 or v.stride(3) != 1:
        k, v = k.to(dt).contiguous(), v.to(dt).contiguous()
    qc = q.to(dt).contiguous()
    n = torch.full((B,), S, dtype=torch.int64) if lengths is None else lengths.to(torch.int64).contiguous()
    if lengths is not None and not bool(((n >= 0) & (n <= S)).all()):
        raise ValueError(f"decode_attention: lengths {n.tolist()} outside the cache's 0..{S} keys")
    o = torch.empty(B, 1, Hq, Dv, dtype=dt)
    cpu_kernels.dec_attention(qc.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), B, Hq, Hk, Hv, D, Dv,
                              k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), None,
                              n.data_ptr(), 0, D ** -0.5 if scale is None else scale, int(dt == torch.bfloat16))
    return o.to(q.dtype)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float = 1e-6, *, gate: Tensor | None = None,
             group_size: int | None = None, norm_before_gate: bool = False, sigmoid_gate: bool = False,
             residual: Tensor | None = None) -> Tensor:
    """ops/norm.rms_norm (no gate) or gated_rms_norm (a gate: RMSNorm(x · silu(gate)), or RMSNorm(x) · silu(gate)
    with norm_before_gate), the mean per group of `group_size` channels (default all). x, gate [..., d] -> [..., d]
    in x's dtype (`sigmoid_gate`: RMSNorm(x) · sigmoid(gate), KDA's output gate). With `residual`: x += residual first (in place, in x's dtype: the stream's add), then the norm."""
    d, dt = x.shape[-1], x.dtype
    if residual is not None and not x.is_contiguous():
        raise ValueError("rms_norm with a residual adds it to x in place: x must be contiguous")
    xc = x.contiguous()
    z = gate.to(dt).contiguous() if gate is not None else None
    w = _f32(weight) if weight is not None else None
    r = residual.to(dt).contiguous() if residual is not None else None
    y = torch.empty_like(xc)
    mode = 0 if gate is None else (3 if sigmoid_gate else 2 if norm_before_gate else 1)
    cpu_kernels.dec_rms_norm(xc.data_ptr(), r.data_ptr() if r is not None else None,
                                  z.data_ptr() if z is not None else None, w.data_ptr() if w is not None else None,
                                  y.data_ptr(), xc.numel() // d, d, group_size or d, mode, eps,
                                  int(dt == torch.bfloat16))
    return y
