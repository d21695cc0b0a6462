"""Whole-mixer decode steps on a CPU: one C++ call (csrc/mixers.cpp, built into the kernels' library by
ops/cpu_kernels.py) for a mixer's whole decode step, from its input x [B, 1, d] to its output, in place of the
10-40 PyTorch calls of the layer's own decode (each a few microseconds of dispatch at batch 1: 0.1-0.25 ms a layer
at d_model 256, more than the layer's arithmetic). The projections run through the linear kernels (csrc/matvec.cpp)
on the weights as stored: float32, bf16, int8 or int4 (`describe`).

    gated_deltanet(layer, x, slot)   layers/gated_deltanet.GatedDeltaNet (G): projections, conv, gates, delta rule,
                                     gated norm, out_proj
    kda(layer, x, slot)              layers/kda.KDA (K): the same with KDA's low-rank gates and sigmoid output gate
    routed_moe(layer, x)             layers/routed_moe.RoutedMoE (the experts of O): router, the k chosen experts
                                     (each once, on every row that chose it), the shared expert and its gate
    mlp(layer, x)                    layers/mlp.MLP (M): w_in, the activation (gated or not), w_out
    attention(layer, x, ctx, slot)   layers/attention.Attention (A): qkv, q/k norms, RoPE, the KV append, GQA /
                                     shared-key attention over the cache, the output gate, out
    mamba2(layer, x, slot)           layers/mamba2.Mamba2 (S): in_proj, conv, dt / A / D, the SSD update, the
                                     gate or gated norm, out_proj
    gated_conv(layer, x, slot)       layers/gated_conv.GatedShortConv (C, LFM2): in_proj, the gated conv, out_proj
    rodimus(layer, x, slot)          layers/rodimus.Rodimus (R): fc, conv, q/k, the DDTS gates, β̂, the GLA
                                     update, the feed-through, gated norm, out_proj

Each returns the layer's output [B, 1, d] (the cache slot updated in place), or None where it cannot take the layer
(a weight the kernels do not read, an option it does not cover): the layer then runs its PyTorch decode, which each
step equals to float32 rounding (in a bf16 model, to bf16 rounding: the step rounds where the PyTorch decode rounds;
tests/test_cpu_decode.py holds them together). Layers call a step when `serves(x)`; `enabled = False` turns every
step off (the layers' PyTorch decode, for tests and A/B timings).
"""
import ctypes
import weakref

import torch
from torch import Tensor, nn

from . import cpu_decode, cpu_kernels

enabled = True
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_FORMATS = {torch.float32: 0, torch.bfloat16: 1, "int8": 2, "int4": 3}


class Lin(ctypes.Structure):
    """One linear layer's stored weight as csrc/mixers.cpp reads it (its `struct Lin`)."""
    _fields_ = [("fmt", _i64), ("N", _i64), ("K", _i64), ("G", _i64), ("w", _ptr), ("scale", _ptr), ("zero", _ptr),
                ("bias", _ptr), ("w_step", _i64), ("s_step", _i64)]


def serves(x: Tensor) -> bool:
    """True when a step can take x [B, 1, d]: a decode-sized CPU input without gradient, float32 or bf16, the kernels
    built, not inside torch.compile, and `enabled`."""
    return enabled and x.dim() == 3 and x.shape[1] == 1 and cpu_decode.serves(x) and cpu_decode.one_token(x)


def _f32(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().float().contiguous()


def describe(m) -> tuple[Lin, list[Tensor]] | None:
    """The `Lin` of a linear module (nn.Linear and its kernel class, layers.quantized.QuantizedLinear) or of a stack
    of experts (a float [E, d_in, d_out] weight in the kernels' layout, layers.quantized.QuantizedExperts), and the
    tensors it points into (kept alive with it: an int4 weight's repacked copy among them); None when the kernels
    cannot read the weight as stored."""
    scheme = getattr(m, "scheme", None)
    if scheme is not None:
        q, *scales = m.stored()
        stack = q.dim() == 3
        bias = _f32(getattr(m, "bias", None))
        b = bias.data_ptr() if bias is not None else None
        if scheme == "int8":                         # weight_q as stored, a float32 copy of its scales
            s = _f32(scales[0])
            N = s.shape[-1]
            return Lin(2, N, q.shape[-1], 1, q.data_ptr(), s.data_ptr(), None, b, q.stride(0) if stack else 0,
                       N if stack else 0), [q, s, bias]
        # int4: repacked as the layers' own kernel reads it (cpu_kernels.int4_pack: Q4 x Q8_0 tiles), per expert
        N, G = scales[0].shape[-2:]
        Kp = q.shape[-1] * 2
        packed = (torch.stack([cpu_kernels.int4_pack(*(t[e] for t in (q, *scales))) for e in range(q.shape[0])])
                  if stack else cpu_kernels.int4_pack(q, *scales))
        return Lin(3, N, Kp, G, packed.data_ptr(), None, None, b, packed.stride(0) if stack else 0, 0), \
            [packed, bias]
    if isinstance(m, Tensor):                        # float experts [E, d_in, d_out], each [d_out, d_in] in memory
        E, K, N = m.shape
        if m.dtype not in _FORMATS or m.stride(1) != 1 or m.stride(2) != K:
            return None
        return Lin(_FORMATS[m.dtype], N, K, 1, m.data_ptr(), None, None, None, m.stride(0) * m.element_size(),
                   0), [m]
    w = m.weight
    if w.dtype not in _FORMATS or not w.is_contiguous():
        return None
    bias = _f32(m.bias)
    return Lin(_FORMATS[w.dtype], w.shape[0], w.shape[1], 1, w.data_ptr(), None, None,
               bias.data_ptr() if bias is not None else None, 0, 0), [w, bias]


def _tensors(module: nn.Module, out: list) -> list[Tensor]:
    """Every Parameter and buffer of `module` and its submodules (a mixer's few), appended to `out`."""
    out += [t for t in module._parameters.values() if t is not None]
    out += [t for t in module._buffers.values() if t is not None]
    for child in module._modules.values():
        if child is not None:
            _tensors(child, out)
    return out


_plans: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _plan(layer: nn.Module, dtype: torch.dtype, build):
    """build(dtype) for `layer` (the addresses its step reads: `Lin`s, float32 copies), kept until a tensor of the
    layer is replaced (a module swapped, a Parameter or its data reassigned) or changed in place (its version), or
    the activations' dtype changes: ~4 us a call, a third of reading the weights through the modules' attributes."""
    tensors = _tensors(layer, [])
    try:
        key = (dtype, *[(id(t), t.data_ptr(), t._version) for t in tensors])
    except RuntimeError:                             # an inference tensor keeps no version counter (nor changes)
        key = (dtype, *[(id(t), t.data_ptr()) for t in tensors])
    kept = _plans.get(layer)
    if kept is None or kept[0] != key:
        kept = _plans[layer] = (key, build(dtype), tensors)
    return kept[1]


def _lins(*modules) -> tuple[list, list] | None:
    """The addresses of the `Lin`s of `modules` (None passes as a null pointer) and what they need kept alive (the
    `Lin`s, the tensors they point into); None if one is unreadable."""
    refs, keep = [], []
    for m in modules:
        d = None if m is None else describe(m)
        if m is not None and d is None:
            return None
        refs.append(None if d is None else ctypes.addressof(d[0]))
        keep += [] if d is None else [d[0], *d[1]]
    return refs, keep


def _floats(*ts: Tensor | None) -> tuple[list, list]:
    """The addresses of float32 copies of `ts` (None: a null pointer), and the copies (to keep alive)."""
    copies = [_f32(t) for t in ts]
    return [None if c is None else c.data_ptr() for c in copies], copies


def _bind():
    lib = cpu_kernels._lib
    if not hasattr(lib, "_mixers_bound"):
        p, i, f, b = _ptr, _i64, ctypes.c_float, ctypes.c_int
        lib.mix_gated_deltanet.argtypes = [p, p, i, i, b, p, p, p, p, i, p, p, p, f, p, p, i, i, i, i]
        lib.mix_kda.argtypes = [p, p, i, i, b, p, p, p, i, p, p, p, p, p, p, p, p, f, p, p, i, i]
        lib.mix_moe.argtypes = [p, p, i, i, b, b, p, p, b, b, f, i, p, p, p, p, p, b, p, p, b, p]
        lib.mix_mlp.argtypes = [p, p, i, i, b, p, p, b, b]
        lib.mix_attention.argtypes = [p, p, i, i, b, p, p, i, i, i, i, b, p, p, f, i, b, p, p, p, p, *[i] * 7, f]
        lib.mix_mamba2.argtypes = [p, p, i, i, b, p, p, p, p, i, p, p, p, f, f, b, p, f, p, p, i, i, i, i]
        lib.mix_gated_conv.argtypes = [p, p, i, i, b, p, p, p, p, i, p]
        lib.mix_rodimus.argtypes = [p, p, i, i, b, p, p, p, p, i, p, p, b, p, p, p, p, p, p, f, p, p, i, i]
        for fn in (lib.mix_gated_deltanet, lib.mix_kda, lib.mix_moe, lib.mix_mlp, lib.mix_attention, lib.mix_mamba2,
                   lib.mix_gated_conv, lib.mix_rodimus):
            fn.restype = None
        lib._mixers_bound = True
    return lib


def _recurrent_slot(slot, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The slot's conv tail (in the activations' dtype) and float32 state as tensors the step may update in place:
    the slot's own, or copies (a static cache's views); the caller stores them back (`slot.conv, slot.state = ...`:
    a static cache copies them into its buffers)."""
    return cpu_decode.owned(slot.conv, dtype), cpu_decode.owned(slot.state, torch.float32)


def _conv_weight(conv, dtype: torch.dtype) -> Tensor:
    """A ShortConv's weight [C, W] as its decode reads it (in the activations' dtype), in float32."""
    return conv.weight.detach().to(dtype).float().contiguous()


def _conv_bias(conv, dtype: torch.dtype) -> Tensor | None:
    """A ShortConv's bias [C] (or None) as its decode reads it (in the activations' dtype), in float32."""
    return None if conv.bias is None else conv.bias.detach().to(dtype).float().contiguous()


def _io(x: Tensor) -> tuple[Tensor, Tensor, int, int, int]:
    """x [B, 1, d] contiguous, an empty output like it, B, d, and whether they are bf16."""
    B, _, d = x.shape
    return x.contiguous(), torch.empty(B, 1, d, dtype=x.dtype), B, d, int(x.dtype == torch.bfloat16)


def _delta_build(layer, *linears):
    """The plan builder of a delta-rule layer (G, K): its linears, then its conv weight, A_log, dt_bias and norm
    weight; None where the step does not cover it (a conv bias)."""
    def build(dtype):
        lins = _lins(*linears)
        if lins is None or layer.conv.bias is not None:
            return None
        small = _floats(_conv_weight(layer.conv, dtype), layer.A_log, layer.dt_bias, layer.norm_weight)
        return (*lins[0], *small[0]), (lins[1], small[1])
    return build


def gated_deltanet(layer, x: Tensor, slot) -> Tensor | None:
    """layers/gated_deltanet.GatedDeltaNet's decode step: x [B, 1, d] -> [B, 1, d]; `slot` (RecurrentCache: conv
    [B, W-1, C], state [B, hv, dk, dv]) updated in place."""
    plan = _plan(layer, x.dtype, _delta_build(layer, layer.in_proj_qkvz, layer.in_proj_ba, layer.out_proj))
    if plan is None:
        return None
    qkvz, ba, out, cw, A_log, dt_bias, norm_w = plan[0]
    conv, state = _recurrent_slot(slot, x.dtype)
    xc, y, B, d, bf = _io(x)
    _bind().mix_gated_deltanet(xc.data_ptr(), y.data_ptr(), B, d, bf, qkvz, ba, cw, conv.data_ptr(),
                               layer.conv.kernel, A_log, dt_bias, norm_w, layer.norm_eps, state.data_ptr(), out,
                               layer.hk, layer.hv, layer.dk, layer.dv)
    slot.conv, slot.state = conv, state
    return y


def kda(layer, x: Tensor, slot) -> Tensor | None:
    """layers/kda.KimiDeltaAttention's decode step: x [B, 1, d] -> [B, 1, d]; `slot` (conv [B, W-1, 3 H D], state
    [B, H, D, D]) updated in place."""
    plan = _plan(layer, x.dtype, _delta_build(layer, layer.qkv, layer.f_a, layer.f_b, layer.b_proj, layer.g_a,
                                              layer.g_b, layer.o_proj))
    if plan is None:
        return None
    qkv, f_a, f_b, b_proj, g_a, g_b, o_proj, cw, A_log, dt_bias, norm_w = plan[0]
    conv, state = _recurrent_slot(slot, x.dtype)
    xc, y, B, d, bf = _io(x)
    _bind().mix_kda(xc.data_ptr(), y.data_ptr(), B, d, bf, qkv, cw, conv.data_ptr(), layer.conv.kernel, f_a, f_b,
                    b_proj, A_log, dt_bias, g_a, g_b, norm_w, layer.norm_eps, state.data_ptr(), o_proj,
                    layer.n_heads, layer.head_dim)
    slot.conv, slot.state = conv, state
    return y


_ACTS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "relu2": 4}   # layers/mlp.ACTIVATIONS in mixers.cpp


def routed_moe(layer, x: Tensor) -> Tensor | None:
    """layers/routed_moe.RoutedMoE's decode step: x [B, 1, d] -> [B, 1, d] (its `aux_loss`, training's, is not
    computed: the caller sets it to None)."""
    shared = layer.shared

    def build(dtype):
        code = _ACTS.get(layer.act_name)
        if code is None or (shared is not None and shared.act_name != layer.act_name):
            return None
        lins = _lins(layer.router, layer.w_gate, layer.w_up, layer.w_down, *((shared.w_in, shared.w_out) if shared
                                                                           is not None else (None, None)),
                     layer.shared_gate)
        if lins is None:
            return None
        bias = _floats(layer.router_bias)
        return (*lins[0], *bias[0], code), (lins[1], bias[1])
    plan = _plan(layer, x.dtype, build)
    if plan is None or (shared is not None and shared.training and isinstance(shared.drop, nn.Dropout)):
        return None
    router, gate, up, down, sh_in, sh_out, sh_gate, rbias, code = plan[0]
    route, k = layer.route, layer.top_k
    xc, y, B, d, bf = _io(x)
    ids, weights = torch.empty(B, k, dtype=torch.int64), torch.empty(B, k)
    here = route["n_group"] == 1                         # group-limited choice: routed by ops.moe.route_topk first
    if not here:
        from .moe import route_topk
        w, i, _ = route_topk(layer.router(xc.view(B, d)), k, bias=layer.router_bias, **route)
        ids.copy_(i)
        weights.copy_(w)
    _bind().mix_moe(xc.data_ptr(), y.data_ptr(), B, d, bf, int(here), router, rbias, int(route["score"] == "sigmoid"),
                    int(route["norm_topk"]), route["scale"], k, ids.data_ptr(), weights.data_ptr(), gate, up, down,
                    code, sh_in, sh_out, int(shared is not None and shared.gated), sh_gate)
    return y


def mlp(layer, x: Tensor) -> Tensor | None:
    """layers/mlp.MLP's step: x [B, 1, d] -> [B, 1, d] (None for an activation the step lacks, or dropout in
    training)."""
    if layer.training and isinstance(layer.drop, nn.Dropout):
        return None

    def build(dtype):
        code, lins = _ACTS.get(layer.act_name), _lins(layer.w_in, layer.w_out)
        return None if code is None or lins is None else ((*lins[0], code), lins[1])
    plan = _plan(layer, x.dtype, build)
    if plan is None:
        return None
    w_in, w_out, code = plan[0]
    xc, y, B, d, bf = _io(x)
    _bind().mix_mlp(xc.data_ptr(), y.data_ptr(), B, d, bf, w_in, w_out, int(layer.gated), code)
    return y


def attention(layer, x: Tensor, ctx, slot) -> Tensor | None:
    """layers/attention.Attention's decode step without masks (no window, key mask or bias: the layer checks):
    x [B, 1, d] -> [B, 1, d]; the token's k and v appended to `slot` (a KVCache holding the prefill's keys, in x's
    dtype). None while the cache is long enough for torch's batched matmuls to read it faster
    (cpu_decode.ATTENTION_PAIRS), as the layer's own decode chooses."""
    H, Hk, Hv, D = layer.n_heads, layer.n_k_heads, layer.n_kv_heads, layer.head_dim
    k, S = slot.k, slot.length + 1
    if k is None or k.dtype != x.dtype or k.stride(3) != 1 or slot.v.stride(3) != 1 \
            or H * S > cpu_decode.ATTENTION_PAIRS:
        return None

    def build(dtype):
        lins = _lins(layer.qkv, layer.out)
        if lins is None:
            return None
        norms = _floats(*((layer.q_norm.weight, layer.k_norm.weight) if layer.q_norm is not None else (None, None)))
        return (*lins[0], *norms[0]), (lins[1], norms[1])
    plan = _plan(layer, x.dtype, build)
    if plan is None:
        return None
    qkv, out, qn, kn = plan[0]
    if S > k.shape[1]:
        slot.reserve(max(S, 2 * k.shape[1]))
    r = layer.rope_dim
    cos, sin = (t.float().contiguous() for t in ctx.rope(r, layer.rope_base)) if r else (None, None)
    xc, y, B, d, bf = _io(x)
    k, v = slot.k, slot.v
    _bind().mix_attention(xc.data_ptr(), y.data_ptr(), B, d, bf, qkv, out, H, Hk, Hv, D, int(layer.output_gate), qn,
                          kn, layer.q_norm.eps if layer.q_norm is not None else 0.0, r, int(layer.rope_interleaved),
                          cos.data_ptr() if r else None, sin.data_ptr() if r else None, k.data_ptr(), v.data_ptr(),
                          *k.stride()[:3], *v.stride()[:3], slot.length, D ** -0.5)
    slot.length = S
    return y


def mamba2(layer, x: Tensor, slot) -> Tensor | None:
    """layers/mamba2.Mamba2's decode step: x [B, 1, d] -> [B, 1, d]; `slot` (conv [B, W-1, di + 2 g n], state
    [B, h, p, n]) updated in place."""
    def build(dtype):
        lins = _lins(layer.in_proj, layer.out_proj)
        if lins is None:
            return None
        small = _floats(_conv_weight(layer.conv, dtype), _conv_bias(layer.conv, dtype), layer.dt_bias, layer.A_log,
                        layer.D, layer.norm_weight)
        return (*lins[0], *small[0]), (lins[1], small[1])
    plan = _plan(layer, x.dtype, build)
    if plan is None:
        return None
    in_proj, out, cw, cb, dt_bias, A_log, D, norm_w = plan[0]
    conv, state = _recurrent_slot(slot, x.dtype)
    lo, hi = layer.dt_limit if layer.dt_limit is not None else (0.0, float("inf"))
    norm = 0 if layer.norm_weight is None else 2 if layer.norm == "norm_gate" else 1
    xc, y, B, d, bf = _io(x)
    _bind().mix_mamba2(xc.data_ptr(), y.data_ptr(), B, d, bf, in_proj, cw, cb, conv.data_ptr(), layer.conv.kernel,
                       dt_bias, A_log, D, lo, hi, norm, norm_w, layer.norm_eps, state.data_ptr(), out, layer.nheads,
                       layer.headdim, layer.ngroups, layer.d_state)
    slot.conv, slot.state = conv, state
    return y


def gated_conv(layer, x: Tensor, slot) -> Tensor | None:
    """layers/gated_conv.GatedShortConv's decode step: x [B, 1, d] -> [B, 1, d]; `slot.conv` [B, W-1, d] shifted in
    place."""
    def build(dtype):
        lins = _lins(layer.in_proj, layer.out_proj)
        if lins is None:
            return None
        small = _floats(_conv_weight(layer.conv, dtype), _conv_bias(layer.conv, dtype))
        return (*lins[0], *small[0]), (lins[1], small[1])
    plan = _plan(layer, x.dtype, build)
    if plan is None:
        return None
    in_proj, out, cw, cb = plan[0]
    conv = cpu_decode.owned(slot.conv, x.dtype)
    xc, y, B, d, bf = _io(x)
    _bind().mix_gated_conv(xc.data_ptr(), y.data_ptr(), B, d, bf, in_proj, cw, cb, conv.data_ptr(), layer.conv.kernel,
                           out)
    slot.conv = conv
    return y


def rodimus(layer, x: Tensor, slot) -> Tensor | None:
    """layers/rodimus.Rodimus's decode step (not its product-decay ablation: None): x [B, 1, d] -> [B, 1, d]; `slot`
    (conv [B, W-1, m], state [B, 1, n, m]) updated in place."""
    if layer.product_decay:
        return None

    def build(dtype):
        beta = (layer.beta_down, layer.beta_up) if layer.use_beta_hat else (None, None)
        lins = _lins(layer.fc, layer.qk_proj, layer.gate_proj, *beta, layer.out_proj)
        if lins is None:
            return None
        small = _floats(_conv_weight(layer.conv, dtype), _conv_bias(layer.conv, dtype), layer.g_bias,
                        layer.tau_bias, layer.residual_weight, layer.norm_weight)
        return (*lins[0], *small[0]), (lins[1], small[1])
    plan = _plan(layer, x.dtype, build)
    if plan is None:
        return None
    fc, qk_proj, gate_proj, beta_down, beta_up, out, cw, cb, g_bias, tau_bias, res_w, norm_w = plan[0]
    conv, state = _recurrent_slot(slot, x.dtype)
    xc, y, B, d, bf = _io(x)
    _bind().mix_rodimus(xc.data_ptr(), y.data_ptr(), B, d, bf, fc, cw, cb, conv.data_ptr(), layer.conv.kernel,
                        qk_proj, gate_proj, int(layer.use_g), g_bias, tau_bias, beta_down, beta_up, res_w, norm_w,
                        layer.norm_eps, state.data_ptr(), out, layer.d_inner, layer.d_state)
    slot.conv, slot.state = conv, state
    return y
