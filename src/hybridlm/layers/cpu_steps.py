"""The CPU decode seam: one table {mixer class: its whole decode step}, each step one C++ call (ops/cpu_kernels.py's
`mix_*`, csrc/mixers.cpp) from the mixer's input x [B, 1, d] to its output, in place of the 10-40 PyTorch calls of the
layer's own decode (each a few microseconds of dispatch at batch 1, more than a small layer's arithmetic).

`CausalLM` decides once per forward whether the seam applies (`serves`: a decode step of few rows on a CPU, no
gradient, not inside torch.compile, the kernels built, `enabled`) and marks the call's SeqContext; the blocks
(layers/residual.py's `mix`) then hand each mixer to `step`, which looks its class up in `STEPS`. A step returns the
output (the cache slot updated in place), or None where it does not cover the layer (a weight the kernels cannot
read, an option no kernel has): the layer then runs its own PyTorch decode, which every step equals to float32
rounding (bf16 rounding in a bf16 model; tests/test_cpu_decode.py holds them together).

    Attention (A, W)      qkv, q/k norms, RoPE, the KV append (a growing cache or a window's ring), GQA / shared-key
                          attention over each row's own keys (left padding skipped), the output gate, out
    MLA (L)               the absorbed decode: query and latent projections, norms, RoPE, the latent append, W_uk /
                          W_uv folded in, attention over the one shared latent head
    Mamba2 (S)            in_proj, conv, dt / A / D, the SSD update, the gate or gated norm, out_proj
    Rodimus (R)           fc, conv, q/k, the DDTS gates, β̂, the GLA update, the feed-through, gated norm, out_proj
    GatedDeltaNet (G)     projections, conv, gates, delta rule, gated norm, out_proj
    KimiDeltaAttention (K)  the same with KDA's low-rank gates and sigmoid output gate
    GatedShortConv (C)    in_proj, the gated conv, out_proj
    RoutedMoE (O)         the router (softmax / sigmoid, correction bias, group-limited), the k chosen experts (each
                          once, on every row that chose it), the shared expert and its gate
    MLP (M)               w_in, the activation (gated or not), w_out

Each layer's plan (the `Lin` of each linear: its stored format and pointers, no copy; float32 copies of the small
vectors) is built once and kept until a tensor of the layer changes (`_plan`). int4 weights are read in the packed
form their QuantizedLinear / QuantizedExperts keeps for its own products (`int4_kernel`): one packed copy.
"""
import ctypes
import weakref
from functools import partial

import torch
from torch import Tensor, nn

from ..cache import KVCache, LatentCache, RecurrentCache, WindowKVCache
from ..ops import cpu_decode, cpu_kernels
from .attention import Attention
from .gated_conv import GatedShortConv
from .gated_deltanet import GatedDeltaNet
from .kda import KimiDeltaAttention
from .mamba2 import Mamba2
from .mla import MLA
from .mlp import MLP
from .rodimus import Rodimus
from .routed_moe import RoutedMoE

enabled = True          # False: every mixer runs its PyTorch decode (tests, A/B timings)
Lin = cpu_kernels.Lin


def serves(x: Tensor, cache) -> bool:
    """True when this forward is a decode step the seam takes: x [B, 1, d] (few rows) on a CPU without gradient,
    float32 or bf16, a cache, the kernels built, not inside torch.compile, `enabled`."""
    return (enabled and cache is not None and x.dim() == 3 and x.shape[1] == 1 and cpu_decode.one_token(x)
            and cpu_decode.serves(x))


def step(mixer: nn.Module, x: Tensor, ctx, cache) -> Tensor | None:
    """The whole decode step of `mixer` on x [B, 1, d] -> [B, 1, d], or None (no step for its class, or one that
    does not cover it: the caller runs the mixer itself)."""
    fn = STEPS.get(type(mixer))
    return None if fn is None else fn(mixer, x, ctx, cache)


# ---- plans: what a step reads, built once per layer ------------------------------------------------------------

def _f32(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().float().contiguous()


def describe(m) -> tuple[Lin, list[Tensor]] | None:
    """The `Lin` of a linear module (nn.Linear and its kernel class, QuantizedLinear) or of a stack of experts (a
    float [E, d_in, d_out] weight in the kernels' layout, or QuantizedExperts), and the tensors it points into (kept
    alive with it); None when the kernels cannot read the weight as stored."""
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
        packed, N, Kp, G = m.int4_kernel()           # the module's own packed copy (Q4 x Q8_0 tiles)
        return Lin(3, N, Kp, G, packed.data_ptr(), None, None, b, packed.stride(0) if stack else 0, 0), \
            [packed, bias]
    if isinstance(m, Tensor):                        # float experts [E, d_in, d_out], each [d_out, d_in] in memory
        E, K, N = m.shape
        if m.dtype not in cpu_kernels.FORMATS or m.stride(1) != 1 or m.stride(2) != K:
            return None
        return Lin(cpu_kernels.FORMATS[m.dtype], N, K, 1, m.data_ptr(), None, None, None,
                   m.stride(0) * m.element_size(), 0), [m]
    w = getattr(m, "weight", None)
    if w is None or w.dtype not in cpu_kernels.FORMATS or not w.is_contiguous():
        return None
    bias = _f32(m.bias)
    return Lin(cpu_kernels.FORMATS[w.dtype], w.shape[0], w.shape[1], 1, w.data_ptr(), None, None,
               bias.data_ptr() if bias is not None else None, 0, 0), [w, bias]


def _tensors(module: nn.Module) -> list[Tensor]:
    """Every Parameter and buffer of `module` and its submodules (a mixer's few)."""
    return [*module.parameters(), *module.buffers()]


_plans: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _plan(layer: nn.Module, dtype: torch.dtype, build):
    """build(dtype) for `layer` (the addresses its step reads: `Lin`s, float32 copies), kept until a tensor of the
    layer is replaced (a module swapped, a Parameter or its data reassigned) or changed in place (its version), or
    the activations' dtype changes: ~4 us a call, a third of reading the weights through the modules' attributes."""
    tensors = _tensors(layer)
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


def _with(lins_of, floats_of):
    """A plan builder: the `Lin`s of lins_of(dtype)'s modules, then float32 copies of floats_of(dtype)'s tensors;
    None when a weight is unreadable."""
    def build(dtype):
        lins = _lins(*lins_of(dtype))
        if lins is None:
            return None
        small = _floats(*floats_of(dtype))
        return (*lins[0], *small[0]), (lins[1], small[1])
    return build


def _conv(conv, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """A ShortConv's weight [C, W] and bias [C] (or None) as its decode reads them (in the activations' dtype)."""
    return conv.weight.detach().to(dtype), None if conv.bias is None else conv.bias.detach().to(dtype)


def _io(x: Tensor) -> tuple[Tensor, Tensor, int, int, int]:
    """x [B, 1, d] contiguous, an empty output like it, B, d, and whether they are bf16."""
    B, _, d = x.shape
    return x.contiguous(), torch.empty(B, 1, d, dtype=x.dtype), B, d, int(x.dtype == torch.bfloat16)


def _recurrent(layer, cache, ctx, dtype: torch.dtype, conv: bool = True):
    """A recurrent layer's slot when its step can run (a prefill filled it; no padded token in this step), with its
    conv tail (in the activations' dtype) and float32 state as tensors the step may update in place: the slot's own,
    or copies (a static cache's views) the caller stores back; else None."""
    slot = cache.layer(layer.layer_idx, RecurrentCache)
    if ctx.pad_mask is not None or slot.conv is None or (conv and slot.state is None):
        return None
    state = cpu_decode.owned(slot.state, torch.float32) if slot.state is not None else None
    return slot, cpu_decode.owned(slot.conv, dtype), state


# ---- attention: each row at its own length ---------------------------------------------------------------------

def _rows(slot) -> Tensor:
    """Each row's tokens in an attention slot before this step, int64 [B] (a copy): its own lengths where the rows
    hold them (the serving batch, cache.py), else the one length of every row."""
    return slot.lengths.to(torch.int64).contiguous().clone()


def _advance(slot):
    """One token appended to every row of `slot`, as its own `update` / `step` count it."""
    if slot.ragged:
        slot.lengths.add_(1)
    slot.length += 1


def _left_pads(ctx) -> Tensor | None:
    """[B] int64: each row's first real token when the key mask is a left padding (None: no padding, or rows at
    their own lengths, whose key mask only hides what lies past a row's length)."""
    return None if ctx.lengths is not None else ctx.left_pads()


def _attends(layer, ctx) -> bool:
    """True when the attention step covers this call: no static cache, no packed documents, no dropout, and a key
    mask (if any) that is a left padding (`SeqContext.left_pads`) or rows at their own lengths."""
    return (ctx.cache_pos is None and ctx.segment_ids is None
            and (ctx.lengths is not None or ctx.left_pads() is not False)
            and not (layer.training and isinstance(layer.drop, nn.Dropout)))


def _readable(slot, x: Tensor) -> bool:
    """True when the step can write and read `slot`'s buffers: filled by a prefill, in x's dtype, each head's row
    contiguous."""
    return slot.k is not None and slot.k.dtype == x.dtype and slot.k.stride(-1) == 1 and slot.v.stride(-1) == 1


def _kv_slot(slot, x: Tensor) -> bool:
    """A growing K/V slot made to hold one more token in every row (one reallocation at most: row b writes column
    lengths[b] <= length); False if it cannot be read."""
    if not _readable(slot, x):
        return False
    if slot.length + 1 > slot.k.shape[1]:
        slot.reserve(max(slot.length + 1, 2 * slot.k.shape[1]))
    return True


# Past this many query-head x key pairs a grouped-query or multi-head cache (fewer than 8 query heads per key head)
# goes to the layer's own decode: PyTorch's batched matmuls (bf16 dot products) read it faster than the C++ loop,
# which widens every key to float32 and sums per query head (measured on a loaded Zen 4: 0.47-0.57 against 0.22 ms
# at 32 heads x 1025 keys, 0.07-0.08 against 0.09 at 128). Shared keys and MLA (many query heads per key head: the
# scores are vectors across the heads) stay in the step at every length.
LONG_PAIRS = 16384


def attention(layer: Attention, x: Tensor, ctx, cache) -> Tensor | None:
    """layers/attention.Attention's decode step (letters A and W): x [B, 1, d] -> [B, 1, d]; the token's k and v
    written into its slot (a KVCache, or the WindowKVCache ring of a sliding window) at each row's own length."""
    if not _attends(layer, ctx):
        return None
    window = layer.window
    slot = cache.layer(layer.layer_idx, KVCache if window is None else partial(WindowKVCache, window))
    keys = slot.length + 1 if window is None else min(slot.length + 1, window)
    if layer.n_heads // layer.n_k_heads < 8 and layer.n_heads * keys > LONG_PAIRS:
        return None
    if not (_kv_slot(slot, x) if window is None else _readable(slot, x)):
        return None
    pos = _rows(slot)
    H, Hk, Hv, D = layer.n_heads, layer.n_k_heads, layer.n_kv_heads, layer.head_dim
    norms = (layer.q_norm.weight, layer.k_norm.weight) if layer.q_norm is not None else (None, None)
    plan = _plan(layer, x.dtype, _with(lambda dt: (layer.qkv, layer.out), lambda dt: norms))
    if plan is None:
        return None
    qkv, out, qn, kn = plan[0]
    r = layer.rope_dim
    cos, sin = (t.float().contiguous() for t in ctx.rope(r, layer.rope_base)) if r else (None, None)
    lo = _left_pads(ctx)
    xc, y, B, d, bf = _io(x)
    k, v = slot.k, slot.v
    cpu_kernels.mix_attention(xc.data_ptr(), y.data_ptr(), B, d, bf, qkv, out, H, Hk, Hv, D, int(layer.output_gate),
                              qn, kn, layer.q_norm.eps if layer.q_norm is not None else 0.0, r,
                              int(layer.rope_interleaved), cos.data_ptr() if r else None,
                              sin.data_ptr() if r else None, k.data_ptr(), v.data_ptr(), *k.stride()[:3],
                              *v.stride()[:3], pos.data_ptr(), lo.data_ptr() if lo is not None else None,
                              window or 0, D ** -0.5)
    _advance(slot)
    return y


def mla(layer: MLA, x: Tensor, ctx, cache) -> Tensor | None:
    """layers/mla.MLA's absorbed decode step (its own decode path; not with mode "expanded"): x [B, 1, d] ->
    [B, 1, d]; [latent | roped key] written into its LatentCache at each row's own length."""
    if layer.mode == "expanded" or not _attends(layer, ctx):
        return None
    slot = cache.layer(layer.layer_idx, LatentCache)
    wkv = layer.kv_b.weight if isinstance(getattr(layer.kv_b, "weight", None), Tensor) else None
    if wkv is None or wkv.dtype not in (torch.float32, torch.bfloat16) or not wkv.is_contiguous() \
            or not _kv_slot(slot, x):
        return None
    pos = _rows(slot)
    q_a = getattr(layer, "q_a", None)
    if q_a is not None and layer.q_norm.eps != layer.kv_norm.eps:
        return None
    plan = _plan(layer, x.dtype, _with(
        lambda dt: (q_a, layer.q_b if q_a is not None else layer.q_proj, layer.kv_a, layer.out),
        lambda dt: (layer.q_norm.weight if q_a is not None else None, layer.kv_norm.weight)))
    if plan is None:
        return None
    q_a_l, q_b_l, kv_a_l, out_l, qn, kvn = plan[0]
    r = layer.rope
    cos, sin = (t.float().contiguous() for t in ctx.rope(r, layer.rope_base))
    lo = _left_pads(ctx)
    xc, y, B, d, bf = _io(x)
    k = slot.k
    cpu_kernels.mix_mla(xc.data_ptr(), y.data_ptr(), B, d, bf, q_a_l, qn, q_b_l, kv_a_l, kvn, layer.kv_norm.eps,
                        wkv.data_ptr(), int(wkv.dtype == torch.bfloat16), out_l, layer.n_heads, layer.kv_lora_rank,
                        layer.nope, r, layer.v_dim, int(layer.rotate), int(layer.rope_interleaved), cos.data_ptr(),
                        sin.data_ptr(), k.data_ptr(), k.stride(0), k.stride(1), pos.data_ptr(),
                        lo.data_ptr() if lo is not None else None, layer.scale)
    _advance(slot)
    return y


# ---- recurrent mixers ------------------------------------------------------------------------------------------

def _delta_plan(layer, *linears):
    """The plan builder of a delta-rule layer (G, K): its linears, then its conv weight, A_log, dt_bias and norm
    weight; None where the step does not cover it (a conv bias)."""
    build = _with(lambda dt: linears, lambda dt: (_conv(layer.conv, dt)[0], layer.A_log, layer.dt_bias,
                                                  layer.norm_weight))
    return (lambda dt: None) if layer.conv.bias is not None else build


def gated_deltanet(layer: GatedDeltaNet, x: Tensor, ctx, cache) -> Tensor | None:
    """layers/gated_deltanet.GatedDeltaNet's decode step: x [B, 1, d] -> [B, 1, d]; its slot (conv [B, W-1, C],
    state [B, hv, dk, dv]) updated in place."""
    got = _recurrent(layer, cache, ctx, x.dtype)
    plan = got and _plan(layer, x.dtype, _delta_plan(layer, layer.in_proj_qkvz, layer.in_proj_ba, layer.out_proj))
    if not plan:
        return None
    slot, conv, state = got
    qkvz, ba, out, cw, A_log, dt_bias, norm_w = plan[0]
    xc, y, B, d, bf = _io(x)
    cpu_kernels.mix_gated_deltanet(xc.data_ptr(), y.data_ptr(), B, d, bf, qkvz, ba, cw, conv.data_ptr(),
                                   layer.conv.kernel, A_log, dt_bias, norm_w, layer.norm_eps, state.data_ptr(), out,
                                   layer.hk, layer.hv, layer.dk, layer.dv)
    slot.conv, slot.state = conv, state
    return y


def kda(layer: KimiDeltaAttention, x: Tensor, ctx, cache) -> Tensor | None:
    """layers/kda.KimiDeltaAttention's decode step: x [B, 1, d] -> [B, 1, d]; its slot (conv [B, W-1, 3 H D], state
    [B, H, D, D]) updated in place."""
    got = _recurrent(layer, cache, ctx, x.dtype)
    plan = got and _plan(layer, x.dtype, _delta_plan(layer, layer.qkv, layer.f_a, layer.f_b, layer.b_proj,
                                                     layer.g_a, layer.g_b, layer.o_proj))
    if not plan:
        return None
    slot, conv, state = got
    qkv, f_a, f_b, b_proj, g_a, g_b, o_proj, cw, A_log, dt_bias, norm_w = plan[0]
    xc, y, B, d, bf = _io(x)
    cpu_kernels.mix_kda(xc.data_ptr(), y.data_ptr(), B, d, bf, qkv, cw, conv.data_ptr(), layer.conv.kernel, f_a,
                        f_b, b_proj, A_log, dt_bias, g_a, g_b, norm_w, layer.norm_eps, state.data_ptr(), o_proj,
                        layer.n_heads, layer.head_dim)
    slot.conv, slot.state = conv, state
    return y


def mamba2(layer: Mamba2, x: Tensor, ctx, cache) -> Tensor | None:
    """layers/mamba2.Mamba2's decode step: x [B, 1, d] -> [B, 1, d]; its slot (conv [B, W-1, di + 2 g n], state
    [B, h, p, n]) updated in place."""
    got = _recurrent(layer, cache, ctx, x.dtype)
    plan = got and _plan(layer, x.dtype, _with(lambda dt: (layer.in_proj, layer.out_proj),
                                               lambda dt: (*_conv(layer.conv, dt), layer.dt_bias, layer.A_log,
                                                           layer.D, layer.norm_weight)))
    if not plan:
        return None
    slot, conv, state = got
    in_proj, out, cw, cb, dt_bias, A_log, D, norm_w = plan[0]
    lo, hi = layer.dt_limit if layer.dt_limit is not None else (0.0, float("inf"))
    norm = 0 if layer.norm_weight is None else 2 if layer.norm == "norm_gate" else 1
    xc, y, B, d, bf = _io(x)
    cpu_kernels.mix_mamba2(xc.data_ptr(), y.data_ptr(), B, d, bf, in_proj, cw, cb, conv.data_ptr(),
                           layer.conv.kernel, dt_bias, A_log, D, lo, hi, norm, norm_w, layer.norm_eps,
                           state.data_ptr(), out, layer.nheads, layer.headdim, layer.ngroups, layer.d_state)
    slot.conv, slot.state = conv, state
    return y


def gated_conv(layer: GatedShortConv, x: Tensor, ctx, cache) -> Tensor | None:
    """layers/gated_conv.GatedShortConv's decode step: x [B, 1, d] -> [B, 1, d]; its conv tail [B, W-1, d] shifted in
    place."""
    got = _recurrent(layer, cache, ctx, x.dtype, conv=False)
    plan = got and _plan(layer, x.dtype, _with(lambda dt: (layer.in_proj, layer.out_proj),
                                               lambda dt: _conv(layer.conv, dt)))
    if not plan:
        return None
    slot, conv, _ = got
    in_proj, out, cw, cb = plan[0]
    xc, y, B, d, bf = _io(x)
    cpu_kernels.mix_gated_conv(xc.data_ptr(), y.data_ptr(), B, d, bf, in_proj, cw, cb, conv.data_ptr(),
                               layer.conv.kernel, out)
    slot.conv = conv
    return y


def rodimus(layer: Rodimus, x: Tensor, ctx, cache) -> Tensor | None:
    """layers/rodimus.Rodimus's decode step (not its product-decay ablation: None): x [B, 1, d] -> [B, 1, d]; its
    slot (conv [B, W-1, m], state [B, 1, n, m]) updated in place."""
    if layer.product_decay:
        return None
    got = _recurrent(layer, cache, ctx, x.dtype)
    beta = (layer.beta_down, layer.beta_up) if layer.use_beta_hat else (None, None)
    plan = got and _plan(layer, x.dtype, _with(
        lambda dt: (layer.fc, layer.qk_proj, layer.gate_proj, *beta, layer.out_proj),
        lambda dt: (*_conv(layer.conv, dt), layer.g_bias, layer.tau_bias, layer.residual_weight, layer.norm_weight)))
    if not plan:
        return None
    slot, conv, state = got
    fc, qk_proj, gate_proj, beta_down, beta_up, out, cw, cb, g_bias, tau_bias, res_w, norm_w = plan[0]
    xc, y, B, d, bf = _io(x)
    cpu_kernels.mix_rodimus(xc.data_ptr(), y.data_ptr(), B, d, bf, fc, cw, cb, conv.data_ptr(), layer.conv.kernel,
                            qk_proj, gate_proj, int(layer.use_g), g_bias, tau_bias, beta_down, beta_up, res_w, norm_w,
                            layer.norm_eps, state.data_ptr(), out, layer.d_inner, layer.d_state)
    slot.conv, slot.state = conv, state
    return y


# ---- routed experts --------------------------------------------------------------------------------------------

_ACTS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "relu2": 4}   # layers/mlp.ACTIVATIONS in mixers.cpp


def _experts(w):
    """A stack of expert weights as `describe` reads it: a float Parameter in the kernels' layout, else the
    QuantizedExperts module; None stays None."""
    return w.detach() if isinstance(w, nn.Parameter) else w


def routed_moe(layer: RoutedMoE, x: Tensor, ctx=None, cache=None) -> Tensor | None:
    """layers/routed_moe.RoutedMoE's decode step: x [B, 1, d] -> [B, 1, d] (its `aux_loss`, training's, is set to
    None: a decode step has none to give)."""
    shared = layer.shared
    if shared is not None and shared.training and isinstance(shared.drop, nn.Dropout):
        return None
    code = _ACTS.get(layer.act_name)
    if code is None or (shared is not None and shared.act_name != layer.act_name):
        return None
    plan = _plan(layer, x.dtype, _with(
        lambda dt: (layer.router, *(_experts(w) for w in (layer.w_gate, layer.w_up, layer.w_down)),
                    *((shared.w_in, shared.w_out) if shared is not None else (None, None)), layer.shared_gate),
        lambda dt: (layer.router_bias,)))
    if plan is None:
        return None
    router, gate, up, down, sh_in, sh_out, sh_gate, rbias = plan[0]
    route, k = layer.route, layer.top_k
    xc, y, B, d, bf = _io(x)
    ids, weights = torch.empty(B, k, dtype=torch.int64), torch.empty(B, k)
    cpu_kernels.mix_moe(xc.data_ptr(), y.data_ptr(), B, d, bf, 1, router, rbias, int(route["score"] == "sigmoid"),
                        int(route["norm_topk"]), route["scale"], route["n_group"], route["topk_group"], k,
                        ids.data_ptr(), weights.data_ptr(), gate, up, down, code, sh_in, sh_out,
                        int(shared is not None and shared.gated), sh_gate)
    layer.aux_loss = None
    return y


def mlp(layer: MLP, x: Tensor, ctx=None, cache=None) -> Tensor | None:
    """layers/mlp.MLP's decode step: x [B, 1, d] -> [B, 1, d] (None for an activation the step lacks, or dropout in
    training)."""
    code = _ACTS.get(layer.act_name)
    if code is None or (layer.training and isinstance(layer.drop, nn.Dropout)):
        return None
    plan = _plan(layer, x.dtype, _with(lambda dt: (layer.w_in, layer.w_out), lambda dt: ()))
    if plan is None:
        return None
    w_in, w_out = plan[0]
    xc, y, B, d, bf = _io(x)
    cpu_kernels.mix_mlp(xc.data_ptr(), y.data_ptr(), B, d, bf, w_in, w_out, int(layer.gated), code)
    return y


STEPS = {Attention: attention, MLA: mla, Mamba2: mamba2, Rodimus: rodimus, GatedDeltaNet: gated_deltanet,
         KimiDeltaAttention: kda, GatedShortConv: gated_conv, RoutedMoE: routed_moe, MLP: mlp}
