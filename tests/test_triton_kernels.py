"""Our Triton kernels (ops/triton) equal the PyTorch ops they replace on GPU: chunked SSD and chunked GLA,
forward and gradients, float32 and bf16, odd lengths, initial states, resets, ngroups > 1.

Without CUDA the kernels run under Triton's interpreter on CPU tensors at small sizes (seconds); with CUDA
the same tests run compiled at full head sizes. Skipped when triton is not installed (`hybridlm[gpu]`)."""
import importlib
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from conftest import assert_close                                   # noqa: E402
from hybridlm.errors import InputError                              # noqa: E402
from hybridlm.ops import triton as tri                              # noqa: E402
from hybridlm.ops.gla import gla_chunked, gla_recurrent             # noqa: E402
from hybridlm.ops.moe import expert_neurons_ref                     # noqa: E402
from hybridlm.ops.ssd import ssd_chunked, ssd_recurrent             # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and triton was imported without TRITON_INTERPRET=1 (conftest sets it)",
                allow_module_level=True)
_ssd_mod = importlib.import_module("hybridlm.ops.triton.ssd")
_gla_mod = importlib.import_module("hybridlm.ops.triton.gla")
_moe_mod = importlib.import_module("hybridlm.ops.triton.cdmoe")
ssd_triton, gla_triton = _ssd_mod.ssd_chunked_triton, _gla_mod.gla_chunked_triton
experts_triton = _moe_mod.expert_neurons_triton

# interpreter (one program per batch row and head, run one after another): tiny; CUDA: the head sizes
SSD_SIZE = dict(b=2, h=4, p=64, n=128) if CUDA else dict(b=1, h=4, p=8, n=16)
GLA_SIZE = dict(b=2, h=2, k=128, v=128) if CUDA else dict(b=1, h=2, k=16, v=8)
LENGTHS = [1, 200, 1000] if CUDA else [1, 37]       # odd lengths: a partial last chunk
CHUNK = 64 if CUDA else 16


def _leaves(ts):
    return [None if t is None else t.detach().clone().requires_grad_(t.is_floating_point()) for t in ts]


def _fwd_bwd(fn, ts, kw, seed=1):
    """(outputs, grads) of a random linear functional of (y, final_state); grads None where unused."""
    leaves = _leaves(ts)
    y, s = fn(*leaves[:-1], initial_state=leaves[-1], **kw)
    g = torch.Generator(device=DEV).manual_seed(seed)
    gy = torch.randn(y.shape, generator=g, device=DEV)
    gs = torch.randn(s.shape, generator=g, device=DEV)
    ((y.float() * gy).sum() + (s * gs).sum()).backward()
    return (y.detach(), s.detach()), [None if x is None else x.grad for x in leaves]


def _compare(a, b, names, tol, gtol):
    (ya, sa), ga = a
    (yb, sb), gb = b
    assert ya.dtype == yb.dtype and sa.dtype == torch.float32
    assert_close(ya, yb, rtol=tol, atol=tol, msg="y")
    assert_close(sa, sb, rtol=tol, atol=tol, msg="final state")
    for name, x, y in zip(names, ga, gb):
        assert (x is None) == (y is None), name
        if y is not None:
            assert x.dtype == y.dtype, name
            assert_close(x, y, rtol=gtol, atol=gtol, msg=f"grad {name}")


# ---------------------------------------------------------------- SSD


def ssd_inputs(T, g=2, dtype=torch.float32, b=None, h=None, p=None, n=None):
    s = dict(SSD_SIZE, **{k: v for k, v in dict(b=b, h=h, p=p, n=n).items() if v is not None})
    b, h, p, n = s["b"], s["h"], s["p"], s["n"]
    x = torch.randn(b, T, h, p, device=DEV)
    dt = F.softplus(torch.randn(b, T, h, device=DEV) - 1)
    A = -(torch.rand(h, device=DEV) * 3 + 0.1)
    B, C = (torch.randn(b, T, g, n, device=DEV) * n ** -0.5 for _ in range(2))
    h0 = torch.randn(b, h, p, n, device=DEV)
    return [x.to(dtype), dt.to(dtype), A, B.to(dtype), C.to(dtype), h0]


SSD_NAMES = "x dt A B C h0".split()


def _ssd_ref(*args, **kw):  # the PyTorch path even for CUDA tensors
    os.environ["HYBRIDLM_TRITON"] = "0"
    try:
        return ssd_chunked(*args, **kw)
    finally:
        del os.environ["HYBRIDLM_TRITON"]


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("g,use_h0", [(1, False), (2, True)])
def test_ssd_equals_reference(T, g, use_h0):
    ts = ssd_inputs(T, g=g)
    if not use_h0:
        ts[-1] = None
    ref = _fwd_bwd(_ssd_ref, ts, dict(chunk_size=CHUNK))
    _compare(_fwd_bwd(ssd_triton, ts, dict(chunk_size=CHUNK)), ref, SSD_NAMES, 1e-4, 2e-4)


def test_ssd_equals_token_recurrence():
    ts = ssd_inputs(23, g=2)
    ref = _fwd_bwd(ssd_recurrent, ts, {})
    _compare(_fwd_bwd(ssd_triton, ts, dict(chunk_size=16)), ref, SSD_NAMES, 1e-4, 2e-4)


def test_ssd_resets():
    T = 300 if CUDA else 40
    ts = ssd_inputs(T, g=2)
    resets = torch.zeros(ts[0].shape[0], T, dtype=torch.bool, device=DEV)
    # at the first token (drops the initial state), two in a row, on a chunk boundary, mid-chunk
    resets[0, [0, 5, 6, 16, T - 3]] = True
    kw = dict(chunk_size=16, resets=resets)
    out = _fwd_bwd(ssd_triton, ts, kw)
    _compare(out, _fwd_bwd(_ssd_ref, ts, kw), SSD_NAMES, 1e-4, 2e-4)
    # the packed row equals separate runs (split at the boundary reset)
    (y, s) = out[0]
    row = [t[:1] if t.dim() > 1 else t for t in ts[:5]]
    y1, _ = ssd_triton(*(t[:, :16] if t.dim() > 1 else t for t in row), initial_state=ts[5][:1], chunk_size=16,
                       resets=resets[:1, :16])
    y2, s2 = ssd_triton(*(t[:, 16:] if t.dim() > 1 else t for t in row), chunk_size=16, resets=resets[:1, 16:])
    assert_close(y[:1], torch.cat([y1, y2], 1), rtol=1e-4, atol=1e-4)
    assert_close(s[:1], s2, rtol=1e-4, atol=1e-4)


def test_ssd_bf16():
    T = 500 if CUDA else 37
    ts = ssd_inputs(T, g=2, dtype=torch.bfloat16)
    ref = _fwd_bwd(_ssd_ref, [t.float() if t.dtype == torch.bfloat16 else t for t in ts], dict(chunk_size=CHUNK))
    (y, s), grads = _fwd_bwd(ssd_triton, ts, dict(chunk_size=CHUNK))
    assert y.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert_close(y, ref[0][0], rtol=3e-2, atol=3e-2, msg="y")
    assert_close(s, ref[0][1], rtol=3e-2, atol=3e-2, msg="final state")
    for name, a, b, t in zip(SSD_NAMES, grads, ref[1], ts):
        assert a.dtype == t.dtype, name
        assert_close(a, b, rtol=5e-2, atol=5e-2, msg=f"grad {name}")


# ---------------------------------------------------------------- GLA


def gla_inputs(T, dtype=torch.float32):
    b, h, k, v = GLA_SIZE["b"], GLA_SIZE["h"], GLA_SIZE["k"], GLA_SIZE["v"]
    q, kk = (torch.randn(b, T, h, k, device=DEV) for _ in range(2))
    vv = torch.randn(b, T, h, v, device=DEV)
    w = -F.softplus(2 * torch.randn(b, T, h, k, device=DEV) - 1)   # slow and fast channels
    s0 = torch.randn(b, h, k, v, device=DEV)
    return [q.to(dtype), kk.to(dtype), vv.to(dtype), w.to(dtype), s0]


GLA_NAMES = "q k v log_decay s0".split()


def _gla_ref(*args, **kw):
    os.environ["HYBRIDLM_TRITON"] = "0"
    try:
        return gla_chunked(*args, **kw)
    finally:
        del os.environ["HYBRIDLM_TRITON"]


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("use_h0", [False, True])
def test_gla_equals_reference(T, use_h0):
    ts = gla_inputs(T)
    if not use_h0:
        ts[-1] = None
    kw = dict(chunk_size=CHUNK)
    _compare(_fwd_bwd(gla_triton, ts, kw), _fwd_bwd(_gla_ref, ts, kw), GLA_NAMES, 1e-4, 2e-4)


def test_gla_equals_token_recurrence_with_clamp_and_scale():
    ts = gla_inputs(21)
    ts[3][0, 4] = -60.0                                  # below LOG_DECAY_MIN: clamped, no gradient
    kw = dict(scale=0.3)
    ref = _fwd_bwd(_gla_ref, ts, kw)
    out = _fwd_bwd(gla_triton, ts, dict(kw, chunk_size=16))
    _compare(out, ref, GLA_NAMES, 1e-4, 2e-4)
    assert out[1][3][0, 4].abs().max() == 0
    rec = _fwd_bwd(gla_recurrent, [t.clamp(min=-40) if i == 3 else t for i, t in enumerate(ts)], kw)
    assert_close(out[0][0], rec[0][0], rtol=1e-4, atol=1e-4)


def test_gla_resets():
    T = 300 if CUDA else 40
    ts = gla_inputs(T)
    resets = torch.zeros(ts[0].shape[0], T, dtype=torch.bool, device=DEV)
    resets[0, [0, 5, 6, 16, T - 3]] = True
    kw = dict(chunk_size=16, resets=resets)
    out = _fwd_bwd(gla_triton, ts, kw)
    _compare(out, _fwd_bwd(_gla_ref, ts, kw), GLA_NAMES, 1e-4, 2e-4)
    assert out[1][3][0, 16].abs().max() == 0             # the decay at a document start is unused
    assert out[1][4].abs().max() == 0                    # the initial state is dropped at token 0


def test_gla_bf16():
    T = 500 if CUDA else 37
    ts = gla_inputs(T, dtype=torch.bfloat16)
    ref = _fwd_bwd(_gla_ref, [t.float() for t in ts], dict(chunk_size=CHUNK))
    (o, s), grads = _fwd_bwd(gla_triton, ts, dict(chunk_size=CHUNK))
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert_close(o, ref[0][0], rtol=3e-2, atol=3e-2, msg="o")
    assert_close(s, ref[0][1], rtol=3e-2, atol=3e-2, msg="final state")
    for name, a, b, t in zip(GLA_NAMES, grads, ref[1], ts):
        assert a.dtype == t.dtype, name
        assert_close(a, b, rtol=5e-2, atol=5e-2, msg=f"grad {name}")


# ---------------------------------------------------------------- CDMoE experts

MOE_SIZE = dict(N=64, d=1024, E=16384, k=64) if CUDA else dict(N=5, d=40, E=30, k=6)


def moe_inputs(weighting, dtype=torch.float32):
    N, d, E, k = MOE_SIZE["N"], MOE_SIZE["d"], MOE_SIZE["E"], MOE_SIZE["k"]
    x = torch.randn(N, d, device=DEV)
    down, up = torch.randn(E, d, device=DEV) * d ** -0.5, torch.randn(E, d, device=DEV)
    ids = torch.randint(0, E, (N, k), device=DEV)
    ids[0, 1] = ids[0, 0]                                # a row twice in one token: its gradients add up
    ids[1, 0] = ids[0, 0]                                # and across tokens
    gates = torch.rand(N, k, device=DEV) if weighting != "scale" else None
    scale = torch.randn(N, k, device=DEV) if weighting != "gates" else None
    cast = (lambda t: None if t is None else t.to(dtype))
    return cast(x), cast(down), cast(up), ids, cast(gates), cast(scale)


def _moe_fwd_bwd(fn, x, down, up, ids, gates, scale, act):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, down, up, gates, scale)]
    y = fn(leaves[0], leaves[1], leaves[2], ids, leaves[3], act=act, scale=leaves[4])
    gy = torch.randn(y.shape, generator=torch.Generator(device=DEV).manual_seed(2), device=DEV)
    y.backward(gy.to(y.dtype))
    return y.detach(), [t.grad if t is not None else None for t in leaves]


@pytest.mark.parametrize("act", [F.silu, F.relu, F.gelu])
@pytest.mark.parametrize("weighting", ["gates", "scale", "both"])
def test_experts_equal_reference(act, weighting):
    ins = moe_inputs(weighting)
    y, g = _moe_fwd_bwd(experts_triton, *ins, act)
    y_ref, g_ref = _moe_fwd_bwd(expert_neurons_ref, *ins, act)
    assert_close(y, y_ref, rtol=1e-5, atol=1e-5, msg="y")
    for name, a, b in zip("x down up gates scale".split(), g, g_ref):
        assert (a is None) == (b is None), name
        if b is not None:
            assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"grad {name}")


def test_experts_bf16():
    ins = moe_inputs("gates", dtype=torch.bfloat16)
    y, g = _moe_fwd_bwd(experts_triton, *ins, F.silu)
    y_ref, g_ref = _moe_fwd_bwd(expert_neurons_ref, *(t.float() if t is not None and t.is_floating_point() else t
                                                      for t in ins), F.silu)
    assert y.dtype == torch.bfloat16
    assert_close(y, y_ref, rtol=2e-2, atol=2e-2, msg="y")
    for name, a, b in zip("x down up gates".split(), g, g_ref):
        assert a.dtype == torch.bfloat16, name
        assert_close(a, b, rtol=3e-2, atol=3e-2, msg=f"grad {name}")


# ---------------------------------------------------------------- dispatch and input checks


def test_dispatch(monkeypatch):
    x = torch.zeros(1, 2, 2, 4, device=DEV)
    assert tri.enabled(x) == CUDA                            # CPU tensors keep the PyTorch path
    assert not tri.enabled(x.double())
    monkeypatch.setenv("HYBRIDLM_TRITON", "0")
    assert not tri.enabled(x)


def test_bad_inputs_raise_input_error():
    ts = ssd_inputs(5, g=2)
    with pytest.raises(InputError, match="h % g"):
        ssd_triton(ts[0], ts[1], ts[2], ts[3][:, :, :1].expand(-1, -1, 3, -1), ts[4])
    with pytest.raises(InputError, match="initial_state"):
        ssd_triton(*ts[:5], initial_state=ts[5][:, :1])
    with pytest.raises(InputError, match="resets"):
        ssd_triton(*ts[:5], resets=torch.zeros(ts[0].shape[0] + 1, 5, dtype=torch.bool, device=DEV))
    q, k, v, w, s0 = gla_inputs(5)
    with pytest.raises(InputError, match="v must be"):
        gla_triton(q, k, v[:, :4], w)
    with pytest.raises(InputError, match="chunk_size"):
        gla_triton(q, k, v, w, chunk_size=0)
    x, down, up, ids, gates, _ = moe_inputs("gates")
    with pytest.raises(InputError, match="act"):
        experts_triton(x, down, up, ids, gates, act=torch.tanh)
    with pytest.raises(InputError, match="gates"):
        experts_triton(x, down, up, ids, gates[:, :1])


def test_bench_kernels():
    from hybridlm.bench.kernels import run_kernels
    from hybridlm.errors import ConfigError
    if not CUDA:
        with pytest.raises(ConfigError, match="needs a CUDA GPU"):
            run_kernels()
        return
    res = run_kernels([(1, 256)], repeats=2, log=lambda *a: None)
    assert [r["op"] for r in res["rows"]] == ["ssd", "gla", "cdmoe"]
    for r in res["rows"]:
        assert 0 < r["ours"]["fwd_ms"] and 0 < r["ours"]["fwd_bwd_ms"]


@pytest.mark.parametrize("preset,size", [("mamba2", dict(d_model=64, n_layers=2)),
                                         ("rodimus", dict(d_model=64, n_layers=1)),
                                         ("doge", dict(d_model=64, n_layers=1))])
def test_models_through_the_kernels(monkeypatch, preset, size):
    """A whole model's loss and parameter gradients are the same with the ops dispatched to the kernels (as
    they are for CUDA tensors) as on the PyTorch path."""
    import hybridlm.ops.gla as gla_ops
    import hybridlm.ops.moe as moe_ops
    import hybridlm.ops.ssd as ssd_ops
    from hybridlm import presets
    from hybridlm.models.causal_lm import CausalLM
    from hybridlm.ops import triton as entry
    calls = []
    for name in ("ssd_chunked_triton", "gla_chunked_triton", "expert_neurons_triton"):
        monkeypatch.setattr(entry, name, lambda *a, f=getattr(entry, name), n=name, **k: calls.append(n) or f(*a, **k))
    m = CausalLM(presets.get(preset, vocab_size=64, **size)).to(DEV)
    ids = torch.randint(0, 64, (1, 21), device=DEV)
    runs = []
    for on in (False, True):
        for mod in (ssd_ops, gla_ops, moe_ops):
            monkeypatch.setattr(mod, "triton_enabled", lambda *t, on=on: on)
        m.zero_grad()
        loss = m(ids, labels=ids).loss
        loss.backward()
        runs.append((loss.detach(), [p.grad.clone() for p in m.parameters() if p.grad is not None]))
    (l0, g0), (l1, g1) = runs
    expected = {"mamba2": "ssd_chunked_triton", "rodimus": "gla_chunked_triton", "doge": "expert_neurons_triton"}
    assert expected[preset] in calls, calls              # the kernel ran (only in the second pass)
    assert len(g0) == len(g1) > 0
    assert_close(l1, l0, rtol=1e-5, atol=1e-5, msg="loss")
    for a, b in zip(g1, g0):
        assert_close(a, b, rtol=1e-4, atol=1e-4, msg="grad")
