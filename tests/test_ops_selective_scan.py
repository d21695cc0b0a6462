"""Mamba-1's selective scan: the chunked log-depth form and the decode step equal the token recurrence, forward and
backward, at odd lengths, with an initial state, grouped or shared B/C, resets and strong decays."""
import pytest
import torch

from conftest import assert_close
from hybridlm.ops.selective_scan import selective_scan_chunked, selective_scan_recurrent, selective_scan_step


def make(b=2, T=37, d=12, n=5, g=3, dtype=torch.float32, grad=True, dt_scale=0.5):
    x = torch.randn(b, T, d, dtype=dtype)
    dt = (torch.rand(b, T, d) * dt_scale + 0.01).to(dtype)
    A = -(torch.rand(d, n) * 3 + 0.1).to(dtype if dtype == torch.float64 else torch.float32)
    B = torch.randn(b, T, g, n, dtype=dtype) if g else torch.randn(b, T, n, dtype=dtype)
    C = torch.randn(b, T, g, n, dtype=dtype) if g else torch.randn(b, T, n, dtype=dtype)
    D = torch.randn(d, dtype=A.dtype)
    h0 = torch.randn(b, d, n, dtype=A.dtype)
    ts = [x, dt, A, B, C, D, h0]
    if grad:
        for t in ts:
            t.requires_grad_(True)
    return ts


def run(fn, ts, use_h0=True, resets=None, **kw):
    x, dt, A, B, C, D, h0 = ts
    return fn(x, dt, A, B, C, D, initial_state=h0 if use_h0 else None, resets=resets, **kw)


def chunked(chunk_size):
    return lambda *a, **k: selective_scan_chunked(*a, chunk_size=chunk_size, **k)


def grads(out, ts):
    y, s = out
    loss = (y.double() * torch.linspace(-1, 1, y.shape[-1], dtype=torch.float64)).sum() + (s.double() * 0.3).sum()
    return torch.autograd.grad(loss, ts, allow_unused=True)


@pytest.mark.parametrize("T", [1, 7, 8, 9, 37, 64])
@pytest.mark.parametrize("use_h0", [False, True])
def test_chunked_equals_recurrent_fwd_bwd(T, use_h0):
    ts = make(T=T)
    ref, fast = run(selective_scan_recurrent, ts, use_h0), run(chunked(8), ts, use_h0)
    assert fast[1].dtype == torch.float32
    assert_close(fast[0], ref[0], msg="y")
    assert_close(fast[1], ref[1], msg="final state")
    for name, a, b in zip("x dt A B C D h0".split(), grads(fast, ts), grads(ref, ts)):
        if b is None:
            assert a is None and name == "h0" and not use_h0
            continue
        assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"grad {name}")


@pytest.mark.parametrize("g", [0, 1, 4])
def test_groups_and_shared_bc(g):
    ts = make(T=21, d=8, g=g, grad=False)
    ref, fast = run(selective_scan_recurrent, ts), run(chunked(5), ts)
    assert_close(fast[0], ref[0])
    assert_close(fast[1], ref[1])
    if g == 1:   # one group [b, t, 1, n] is the same as shared [b, t, n]
        x, dt, A, B, C, D, h0 = ts
        shared = selective_scan_chunked(x, dt, A, B[:, :, 0], C[:, :, 0], D, initial_state=h0, chunk_size=5)
        assert_close(shared[0], fast[0], rtol=0, atol=0)


def test_float64_tight():
    ts = make(T=45, dtype=torch.float64)
    ref, fast = run(selective_scan_recurrent, ts), run(chunked(16), ts)
    assert fast[1].dtype == torch.float64
    assert_close(fast[0], ref[0], rtol=1e-12, atol=1e-12)
    assert_close(fast[1], ref[1], rtol=1e-12, atol=1e-12)
    for a, b in zip(grads(fast, ts), grads(ref, ts)):
        assert_close(a, b, rtol=1e-11, atol=1e-11)


def test_bf16_loose():
    ts = make(T=50, dtype=torch.bfloat16, grad=False)
    ref = run(selective_scan_recurrent, [t.float() for t in ts])
    fast = run(chunked(16), ts)
    assert fast[0].dtype == torch.bfloat16 and fast[1].dtype == torch.float32
    assert_close(fast[0], ref[0], rtol=3e-2, atol=3e-2)
    assert_close(fast[1], ref[1], rtol=3e-2, atol=3e-2)


def test_resets_equal_separate_runs():
    x, dt, A, B, C, D, h0 = make(b=1, T=40, grad=False)
    cut = 17
    resets = torch.zeros(1, 40, dtype=torch.bool)
    resets[0, cut] = True
    for fn in (selective_scan_recurrent, chunked(8)):
        y, s = fn(x, dt, A, B, C, D, initial_state=h0, resets=resets)
        y1, _ = fn(x[:, :cut], dt[:, :cut], A, B[:, :cut], C[:, :cut], D, initial_state=h0)
        y2, s2 = fn(x[:, cut:], dt[:, cut:], A, B[:, cut:], C[:, cut:], D)
        assert_close(y, torch.cat([y1, y2], 1))
        assert_close(s, s2)


def test_resets_gradients_match():
    ts = make(T=33)
    resets = torch.rand(2, 33) < 0.2
    resets[:, 0] = True
    g_fast = grads(run(chunked(8), ts, resets=resets), ts)
    g_ref = grads(run(selective_scan_recurrent, ts, resets=resets), ts)
    for name, a, b in zip("x dt A B C D h0".split(), g_fast, g_ref):
        assert torch.isfinite(a).all()
        assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"grad {name}")


def test_strong_decay_exact_and_finite():
    """dt·A down to -3000 per token: decays underflow to 0, never a ratio of them (no inf/nan), still exact."""
    ts = make(T=70, grad=True, dt_scale=1000.0)
    ref, fast = run(selective_scan_recurrent, ts), run(chunked(32), ts)
    assert torch.isfinite(fast[0]).all() and torch.isfinite(fast[1]).all()
    assert_close(fast[0], ref[0], rtol=1e-4, atol=1e-4)
    for a, b in zip(grads(fast, ts), grads(ref, ts)):
        assert torch.isfinite(a).all()
        assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_zero_dt_passes_state_unchanged():
    x, dt, A, B, C, D, h0 = make(b=1, T=6, grad=False)
    _, s = selective_scan_chunked(x, torch.zeros_like(dt), A, B, C, D, initial_state=h0, chunk_size=4)
    assert_close(s, h0, rtol=0, atol=0)


@pytest.mark.parametrize("inplace", [False, True])
def test_step_chain_equals_recurrent(inplace):
    x, dt, A, B, C, D, h0 = make(T=9, grad=False)
    y_ref, s_ref = selective_scan_recurrent(x, dt, A, B, C, D, initial_state=h0)
    s = h0.clone()
    for t in range(9):
        y, s2 = selective_scan_step(x[:, t], dt[:, t], A, B[:, t], C[:, t], s, D, inplace=inplace)
        assert (s2.data_ptr() == s.data_ptr()) == inplace          # in place: the state buffer is reused
        s = s2
        assert_close(y, y_ref[:, t])
    assert_close(s, s_ref)


def test_chunk_states_chain():
    """Two calls chained through the final state = one call (what chunked prefill relies on)."""
    x, dt, A, B, C, D, h0 = make(T=30, grad=False)
    y, s = selective_scan_chunked(x, dt, A, B, C, D, initial_state=h0, chunk_size=8)
    y1, s1 = selective_scan_chunked(x[:, :11], dt[:, :11], A, B[:, :11], C[:, :11], D, initial_state=h0)
    y2, s2 = selective_scan_chunked(x[:, 11:], dt[:, 11:], A, B[:, 11:], C[:, 11:], D, initial_state=s1)
    assert_close(torch.cat([y1, y2], 1), y)
    assert_close(s2, s)
