"""The one-token decode ops in C++ (ops/cpu_decode.py) against their PyTorch references, float32 (to summation
order) and bf16 (to bf16 rounding), batch 2, odd sizes; the layers' decode with them equals the full forward; and
`serves` keeps gradients, other devices and torch.compile on the reference."""
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close, decode_logits
from test_models import tiny

from hybridlm.models.quantize import quantize_, use_cpu_kernels_
from hybridlm.cache import InferenceCache
from hybridlm.layers import cpu_steps
from hybridlm.ops import cpu_decode, cpu_kernels
from hybridlm.ops.attention import decode_attention
from hybridlm.ops.conv import causal_conv1d_step
from hybridlm.ops.delta_rule import delta_rule_step
from hybridlm.ops.gla import gla_step
from hybridlm.ops.norm import gated_rms_norm, l2_norm, rms_norm
from hybridlm.ops.ssd import ssd_step

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def built():
    assert cpu_decode.serves()            # builds the library (a compiler is there: a failed build fails here)


def r(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,p,g,n", [(4, 8, 1, 16), (6, 5, 3, 7)])
def test_ssd_step(dtype, h, p, g, n):
    torch.manual_seed(0)
    x, dt, A, B, C = r(2, h, p, dtype=dtype), torch.rand(2, h), -torch.rand(h), r(2, g, n, dtype=dtype), \
        r(2, g, n, dtype=dtype)
    s0 = r(2, h, p, n)
    y_ref, s_ref = ssd_step(x, dt, A, B, C, s0.clone())
    s = s0.clone()
    y, s_new = cpu_decode.ssd_step(x, dt, A, B, C, s)
    assert s_new.data_ptr() == s.data_ptr() and y.dtype == dtype
    assert_close(s_new, s_ref, **TOL[torch.float32])
    assert_close(y.float(), y_ref.float(), **TOL[dtype])


@pytest.mark.parametrize("limit", [None, (0.01, 0.5)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ssd_gated_step(dtype, limit):
    """dt, A and the D skip inside, against Mamba-2's lines around ssd_step."""
    torch.manual_seed(0)
    h, p, g, n = 6, 5, 3, 7
    x, dt, B, C = r(2, h, p, dtype=dtype), r(2, h, dtype=dtype), r(2, g, n, dtype=dtype), r(2, g, n, dtype=dtype)
    dt_bias, A_log, D, s0 = r(h), torch.rand(h), r(h), r(2, h, p, n)
    d = F.softplus(dt.float() + dt_bias)
    d = d.clamp(*limit) if limit else d
    y_ref, s_ref = ssd_step(x, d, -torch.exp(A_log), B, C, s0.clone())
    y_ref = torch.addcmul(y_ref, x, D.to(dtype).unsqueeze(-1))
    y, s = cpu_decode.ssd_gated_step(x, dt, dt_bias, A_log, D, B, C, s0.clone(), dt_limit=limit)
    assert_close(s, s_ref, **TOL[torch.float32])
    assert_close(y.float(), y_ref.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gla_step(dtype):
    torch.manual_seed(0)
    q, k, ld, v, s0 = r(2, 3, 12, dtype=dtype), r(2, 3, 12, dtype=dtype), -torch.rand(2, 3, 12), \
        r(2, 3, 10, dtype=dtype), r(2, 3, 12, 10)
    o_ref, s_ref = gla_step(q, k, v, ld, s0.clone(), scale=0.3)
    o, s = cpu_decode.gla_step(q, k, v, ld, s0.clone(), scale=0.3)
    assert_close(s, s_ref, **TOL[torch.float32])
    assert_close(o.float(), o_ref.float(), **TOL[dtype])


@pytest.mark.parametrize("per_key", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_delta_rule_step(dtype, per_key):
    torch.manual_seed(0)
    q, k = F.normalize(r(2, 3, 12), dim=-1), F.normalize(r(2, 3, 12), dim=-1)
    v, beta, s0 = r(2, 3, 10, dtype=dtype), torch.rand(2, 3), r(2, 3, 12, 10)
    ld = -torch.rand(2, 3, 12) if per_key else -torch.rand(2, 3)
    o_ref, s_ref = delta_rule_step(q, k, v, beta, ld, s0.clone())
    o, s = cpu_decode.delta_rule_step(q, k, v, beta, ld, s0.clone())
    assert_close(s, s_ref, **TOL[torch.float32])
    assert_close(o.float(), o_ref.float(), **TOL[torch.float32])


@pytest.mark.parametrize("per_key,Hk", [(False, 2), (False, 4), (True, 4)])
def test_gated_delta_step(per_key, Hk):
    """The gates and norms inside (Gated DeltaNet: per-head decay, key heads shared by H / Hk value heads; KDA:
    per-key decay) against the layers' PyTorch lines then delta_rule_step."""
    torch.manual_seed(0)
    B, H, K, V = 2, 4, 8, 6
    qkv, b, A_log = r(B, 2 * Hk * K + H * V), r(B, H), torch.rand(H)
    a, dt_bias = (r(B, H, K), r(H * K)) if per_key else (r(B, H), r(H))
    s0 = r(B, H, K, V)
    q, k, v = qkv.split((Hk * K, Hk * K, H * V), -1)
    q, k = (l2_norm(t.view(B, Hk, K)).repeat_interleave(H // Hk, 1) for t in (q, k))
    A = -torch.exp(A_log)
    ld = A[:, None] * F.softplus(a + dt_bias.view(H, K)) if per_key else A * F.softplus(a + dt_bias)
    o_ref, s_ref = delta_rule_step(q, k, v.view(B, H, V), torch.sigmoid(b), ld, s0.clone(), scale=0.4)
    o, s = cpu_decode.gated_delta_step(qkv, b, a, A_log, dt_bias, s0.clone(), key_heads=Hk, head_k=K, scale=0.4)
    assert_close(s, s_ref, **TOL[torch.float32])
    assert_close(o, o_ref, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("W,bias", [(4, True), (3, False), (2, True)])
def test_conv_step(dtype, W, bias):
    torch.manual_seed(0)
    x, s0, w = r(2, 9, dtype=dtype), r(2, W - 1, 9, dtype=dtype), r(9, W, dtype=dtype)
    b = r(9, dtype=dtype) if bias else None
    y_ref, s_ref = causal_conv1d_step(x, s0, w, b)
    y, s = cpu_decode.conv_step(x, s0.clone(), w, b)
    assert_close(s, s_ref, rtol=0, atol=0)
    assert_close(y.float(), y_ref.float(), **TOL[dtype])
    y, _ = cpu_decode.conv_step(x, s0[:, :].transpose(0, 1).contiguous().transpose(0, 1), w, b, silu=True)
    assert_close(y.float(), F.silu(y_ref.float()), **TOL[dtype])


@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq,Hk,Hv", [(8, 2, 2), (4, 1, 4), (3, 3, 3), (4, 1, 1)])
def test_decode_attention(dtype, Hq, Hk, Hv, head_major):
    torch.manual_seed(0)
    buf_k, buf_v = r(2, 40, Hk, 16, dtype=dtype), r(2, 40, Hv, 8, dtype=dtype)
    if head_major:                                            # the KV cache's layout (cache.time_buffer)
        buf_k, buf_v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (buf_k, buf_v))
    k, v = buf_k[:, :29], buf_v[:, :29]                       # the cache's views: a longer buffer's prefix
    q = r(2, 1, Hq, 16, dtype=dtype)
    assert_close(cpu_decode.decode_attention(q, k, v).float(), decode_attention(q, k, v).float(), **TOL[dtype])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,Hq,Hk,Hv", [(3, 4, 2, 2), (1, 4, 1, 4), (1, 4, 1, 1)])
def test_decode_attention_reads_each_rows_own_keys(dtype, B, Hq, Hk, Hv, threads):
    """Per-row lengths: row b attends its first lengths[b] keys only (the rest of the buffer is NaN here, so a key
    read past a row's length shows); long caches split into runs of keys merged by the online softmax (one row and
    one key head still split, at any thread count) equal the reference on each row's own slice."""
    torch.manual_seed(0)
    S = 700
    k, v = r(B, S, Hk, 32, dtype=dtype), r(B, S, Hv, 16, dtype=dtype)
    lengths = torch.tensor([700, 1, 333][:B] if B == 3 else [613])
    for b, n in enumerate(lengths.tolist()):
        k[b, n:], v[b, n:] = float("nan"), float("nan")
    q = r(B, 1, Hq, 32, dtype=dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_decode.decode_attention(q, k, v, lengths=lengths)
    finally:
        torch.set_num_threads(before)
    for b, n in enumerate(lengths.tolist()):
        want = decode_attention(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n])
        assert_close(got[b:b + 1].float(), want.float(), **TOL[dtype])
    with pytest.raises(ValueError, match="lengths"):
        cpu_decode.decode_attention(q, k, v, lengths=lengths + S)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norms(dtype):
    torch.manual_seed(0)
    x, z, w = r(2, 1, 24, dtype=dtype), r(2, 1, 24, dtype=dtype), r(24, dtype=dtype)
    assert_close(cpu_decode.rms_norm(x, w, 1e-5).float(), rms_norm(x, w, 1e-5).float(), **TOL[dtype])
    for before in (False, True):
        for group in (None, 8):
            assert_close(cpu_decode.rms_norm(x, w, 1e-5, gate=z, group_size=group, norm_before_gate=before).float(),
                         gated_rms_norm(x, z, w, group_size=group, eps=1e-5, norm_before_gate=before).float(),
                         **TOL[dtype])
    of = x.float()
    want = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float() * torch.sigmoid(z.float())
    got = cpu_decode.rms_norm(x, w, 1e-5, gate=z, norm_before_gate=True, sigmoid_gate=True)
    assert_close(got.float(), want.to(dtype).float(), **TOL[dtype])
    res, x2 = r(2, 1, 24, dtype=dtype), x.clone()
    y = cpu_decode.rms_norm(x2, w, 1e-5, residual=res)
    assert_close(x2.float(), (x + res).float(), rtol=0, atol=0)
    assert_close(y.float(), rms_norm(x + res, w, 1e-5).float(), **TOL[dtype])


def test_serves():
    x = torch.randn(3, requires_grad=True)
    assert cpu_decode.serves(torch.randn(3), None)
    assert not cpu_decode.serves(x) and not cpu_decode.serves(torch.randn(3).double())
    assert not cpu_decode.serves(torch.randn(3, device="meta"))
    with torch.no_grad():
        assert cpu_decode.serves(x)                       # a parameter read without a gradient


def _spy(monkeypatch) -> list:
    """Count each whole-mixer step called (its class name, whether it took the layer) through layers/cpu_steps.py."""
    used = []
    for cls, fn in list(cpu_steps.STEPS.items()):
        monkeypatch.setitem(cpu_steps.STEPS, cls, lambda *a, _f=fn, _n=cls.__name__: _counted(used, _n, _f(*a)))
    return used


def _counted(used: list, name: str, y):
    used.append((name, y is not None))
    return y


@pytest.mark.parametrize("name", ["llama", "rodimus++", "qwen3-next", "kimi-linear", "deepseek-mla"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_equals_forward_through_the_seam(name, dtype, monkeypatch):
    """Decode (no gradient: the whole-mixer steps, seen called) equals the full forward, float32 and bf16 (to bf16
    rounding); the full forward never takes a step."""
    torch.manual_seed(0)
    m = use_cpu_kernels_(tiny(name).to(dtype))
    ids = torch.randint(0, 97, (2, 19))
    used = _spy(monkeypatch)
    with torch.no_grad():
        full = m(ids).logits.float()
        assert not used                                   # the full forward keeps PyTorch's ops
        dec = decode_logits(m, ids, 7, cache=m.make_cache(2)).float()
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.15, rtol=0.05)
    assert_close(dec, full, **tol, msg=name)
    assert used and all(ok for _, ok in used), used


# whole-mixer steps (layers/cpu_steps.py): each letter's step against the layer's own PyTorch decode, step by step
MIXER_STEPS = {"qwen3-next": {"GatedDeltaNet", "RoutedMoE", "Attention"},
               "kimi-linear": {"KimiDeltaAttention", "RoutedMoE", "MLA", "MLP"}, "llama": {"Attention", "MLP"},
               "mamba2": {"Mamba2"}, "nemotron-h": {"Mamba2", "Attention", "MLP"},
               "falcon-h1": {"Mamba2", "Attention", "MLP"}, "lfm2": {"GatedShortConv", "Attention", "MLP"},
               "rodimus": {"Rodimus"}, "rodimus++": {"Rodimus", "Attention", "MLP"}, "deepseek-mla": {"MLA", "MLP"}}
# options the presets do not set: a group-limited sigmoid router with its correction bias (DeepSeek-V3), shared keys
# with a sliding window past which the test runs (Rodimus+), RoPE-less MLA (Kimi-Linear's NoPE)
OPTIONS = {"deepseek-mla-moe": (dict(moe_experts=8, moe_n_group=4, moe_topk_group=2, moe_router="sigmoid",
                                     moe_router_bias=True), {"MLA", "RoutedMoE", "MLP"})}


def _steps(m, ids, prefill, mask=None):
    """Logits [B, T - prefill, V] of decoding ids [B, T] one token at a time after a prefill of `prefill` tokens
    (`mask` [B, prefill]: the prefill's attention mask, e.g. a left padding)."""
    cache = m.make_cache(ids.shape[0])
    m(ids[:, :prefill], attention_mask=mask, cache=cache)
    return torch.cat([m(ids[:, t:t + 1], cache=cache).logits for t in range(prefill, ids.shape[1])], 1).float()


def _mixer_cases():
    """Every preset in float32 and bf16; int8 and int4 weights for Qwen3-Next and Kimi-Linear (the rest: slow)."""
    for name in sorted(MIXER_STEPS) + sorted(OPTIONS):
        for dtype in DTYPES:
            for scheme in (None, "int8", "int4"):
                fast = scheme is None or (name in ("qwen3-next", "kimi-linear") and dtype == torch.float32)
                yield pytest.param(name, dtype, scheme, marks=() if fast else pytest.mark.slow)


def _tol(dtype, scheme) -> dict:
    # int4 rounds x to int8 per block of 32: a last-bit difference upstream can move it one step of that grid.
    # (Since the repacked Q4 x Q8_0 kernel, the int4 steps differ from the layers' int4 decode by up to ~1e-2 on
    # logits of ~0.5, against 7e-5 with the stored-form kernel: not yet explained; x's rounding by vector loops keeps
    # the original column order, which brought six steps with the MLP step back under 2e-2.)
    return dict(atol=0.1, rtol=0.05) if dtype == torch.bfloat16 else \
        dict(atol=2e-2, rtol=1e-2) if scheme == "int4" else dict(atol=2e-5, rtol=1e-4)


def _model(name, dtype, scheme):
    torch.manual_seed(0)
    kw, _ = OPTIONS.get(name, ({}, None))
    m = tiny(name, **kw).to(dtype)
    if scheme:
        quantize_(m, scheme, 32 if scheme == "int4" else None)
    return use_cpu_kernels_(m)


@pytest.mark.parametrize("name,dtype,scheme", _mixer_cases())
def test_mixer_steps_equal_the_layers_decode(name, dtype, scheme, monkeypatch):
    """Each whole-mixer step (seen called, never declining) equals the layer's PyTorch decode (cpu_steps off): to
    float32 rounding in a float32 model, to bf16 rounding noise in a bf16 one; weights float, int8 and int4; 3 rows,
    the third left-padded in its prompt; a sliding window's ring run past its size (swa_window 8)."""
    m = _model(name, dtype, scheme)
    used = _spy(monkeypatch)
    ids = torch.randint(0, 97, (3, 15))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[2, :3] = 0
    with torch.no_grad():
        fast = _steps(m, ids, 9, mask)
        assert {n for n, _ in used} == (MIXER_STEPS.get(name) or OPTIONS[name][1]), used
        assert all(ok for n, ok in used), used
        monkeypatch.setattr(cpu_steps, "enabled", False)
        used.clear()
        ref = _steps(m, ids, 9, mask)
        assert not used
    assert_close(fast, ref, **_tol(dtype, scheme), msg=name)


@pytest.mark.parametrize("name", ["llama", "rodimus++", "kimi-linear"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_steps_read_rows_at_their_own_lengths(name, dtype, monkeypatch):
    """Rows at their own lengths in one cache (the serving layout: `InferenceCache.concat` of three prompts of 4, 11
    and 7 tokens; the window of 8 wrapped in one row) decode through the steps (attention, its window, MLA) as each
    row alone through the layers' PyTorch decode."""
    m = _model(name, dtype, None)
    prompts = [torch.randint(0, 97, (1, n)) for n in (4, 11, 7)]
    nxt = torch.randint(0, 97, (3, 3))

    def prefilled(p):
        cache = m.make_cache(1)
        m(p, cache=cache)
        return cache
    with torch.no_grad():
        batch = InferenceCache.concat([(prefilled(p), [0]) for p in prompts])
        assert batch.lengths is not None
        used = _spy(monkeypatch)
        fast = torch.cat([m(nxt[:, t:t + 1], cache=batch).logits for t in range(3)], 1).float()
        assert used and all(ok for n, ok in used), used
        monkeypatch.setattr(cpu_steps, "enabled", False)
        alone = []
        for b, p in enumerate(prompts):
            cache = prefilled(p)
            alone.append(torch.cat([m(nxt[b:b + 1, t:t + 1], cache=cache).logits for t in range(3)], 1).float())
    assert_close(fast, torch.cat(alone), **_tol(dtype, None), msg=name)


@pytest.mark.parametrize("level", [name for name in cpu_kernels.LEVELS if name in cpu_kernels.cpu_levels()])
def test_mixer_steps_at_every_level(level, monkeypatch):
    """The steps at each instruction-set level this CPU runs (its library loaded in place of the chosen one) equal
    the layers' PyTorch decode: every letter with a step, float32, left padding and a wrapped window included."""
    monkeypatch.setattr(cpu_kernels, "_lib", cpu_kernels.load(level))
    ids = torch.randint(0, 97, (3, 13))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :2] = 0
    for name in ("qwen3-next", "kimi-linear", "rodimus++", "nemotron-h", "lfm2"):
        m = _model(name, torch.float32, None)
        with torch.no_grad():
            monkeypatch.setattr(cpu_steps, "enabled", True)
            fast = _steps(m, ids, 9, mask)
            monkeypatch.setattr(cpu_steps, "enabled", False)
            ref = _steps(m, ids, 9, mask)
        assert_close(fast, ref, **_tol(torch.float32, None), msg=f"{name} at {level}")


def test_long_grouped_query_caches_go_to_the_layers_decode(monkeypatch):
    """Past `LONG_PAIRS` query-head x key pairs a grouped-query cache (few query heads per key head) declines the
    step (the layer's PyTorch decode reads it faster) and the output is the same; below it the step runs."""
    m = _model("llama", torch.float32, None)
    ids = torch.randint(0, 97, (2, 12))
    used = _spy(monkeypatch)
    with torch.no_grad():
        fast = _steps(m, ids, 9)
        assert {ok for n, ok in used if n == "Attention"} == {True}
        monkeypatch.setattr(cpu_steps, "LONG_PAIRS", 4 * 9)
        used.clear()
        slow = _steps(m, ids, 9)
        assert {ok for n, ok in used if n == "Attention"} == {False}
    assert_close(fast, slow, **_tol(torch.float32, None))
