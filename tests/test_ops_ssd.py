import pytest
import torch

from conftest import assert_close
from hybridlm.ops.ssd import segsum, ssd_chunked, ssd_quadratic, ssd_recurrent, ssd_step


def make(b=2, T=37, h=4, p=8, g=2, n=16, dtype=torch.float32, grad=True):
    x = torch.randn(b, T, h, p, dtype=dtype)
    dt = (torch.rand(b, T, h) * 0.5 + 0.01).to(dtype)
    A = -(torch.rand(h) * 3 + 0.1)
    B = torch.randn(b, T, g, n, dtype=dtype)
    C = torch.randn(b, T, g, n, dtype=dtype)
    h0 = torch.randn(b, h, p, n)
    ts = [x, dt, A, B, C, h0]
    if grad:
        for t in ts:
            t.requires_grad_(True)
    return ts


def run(fn, ts, use_h0, resets=None, **kw):
    x, dt, A, B, C, h0 = ts
    return fn(x, dt, A, B, C, initial_state=h0 if use_h0 else None, resets=resets, **kw)


def grads(out, ts):
    y, s = out
    loss = (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum() + (s * 0.3).sum()
    return torch.autograd.grad(loss, [t for t in ts], allow_unused=True)


@pytest.mark.parametrize("T", [1, 7, 37, 64, 130])
@pytest.mark.parametrize("use_h0", [False, True])
def test_chunked_equals_references_fwd_bwd(T, use_h0):
    ts = make(T=T)
    ref = run(ssd_recurrent, ts, use_h0)
    quad = run(ssd_quadratic, ts, use_h0)
    fast = run(ssd_chunked, ts, use_h0, chunk_size=16)
    for o in (quad, fast):
        assert_close(o[0], ref[0], msg="y")
        assert_close(o[1], ref[1], msg="final state")
    g_ref, g_fast = grads(ref, ts), grads(fast, ts)
    for name, a, b in zip("x dt A B C h0".split(), g_fast, g_ref):
        if b is None:
            assert a is None or not use_h0
            continue
        assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"grad {name}")


def test_bf16_loose():
    ts = make(T=50, dtype=torch.bfloat16, grad=False)
    ref = run(ssd_recurrent, [t.float() if t.is_floating_point() else t for t in ts], True)
    fast = run(ssd_chunked, ts, True, chunk_size=16)
    assert fast[0].dtype == torch.bfloat16 and fast[1].dtype == torch.float32
    assert_close(fast[0], ref[0], rtol=3e-2, atol=3e-2)


def test_resets_equal_separate_runs():
    x, dt, A, B, C, h0 = make(b=1, T=40, grad=False)
    cut = 17
    resets = torch.zeros(1, 40, dtype=torch.bool)
    resets[0, cut] = True
    for fn in (ssd_recurrent, ssd_quadratic, lambda *a, **k: ssd_chunked(*a, chunk_size=8, **k)):
        y, s = fn(x, dt, A, B, C, initial_state=h0, resets=resets)
        y1, _ = fn(x[:, :cut], dt[:, :cut], A, B[:, :cut], C[:, :cut], initial_state=h0)
        y2, s2 = fn(x[:, cut:], dt[:, cut:], A, B[:, cut:], C[:, cut:])
        assert_close(y, torch.cat([y1, y2], 1))
        assert_close(s, s2)


def test_resets_gradients_finite():
    ts = make(T=33)
    resets = torch.rand(2, 33) < 0.2
    resets[:, 0] = True
    g_fast = grads(run(ssd_chunked, ts, True, resets=resets, chunk_size=8), ts)
    g_ref = grads(run(ssd_recurrent, ts, True, resets=resets), ts)
    for a, b in zip(g_fast, g_ref):
        assert torch.isfinite(a).all()
        assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("inplace", [False, True])
def test_step_chain_equals_recurrent(inplace):
    x, dt, A, B, C, h0 = make(T=9, grad=False)
    y_ref, s_ref = ssd_recurrent(x, dt, A, B, C, initial_state=h0)
    s = h0.clone()
    for t in range(9):
        y, s2 = ssd_step(x[:, t], dt[:, t], A, B[:, t], C[:, t], s, inplace=inplace)
        assert (s2.data_ptr() == s.data_ptr()) == inplace          # in place: the state buffer is reused
        s = s2
        assert_close(y, y_ref[:, t])
    assert_close(s, s_ref)


def test_segsum_stable_and_exponents_nonpositive():
    a = -torch.rand(3, 50) * 10
    s = segsum(a)
    assert torch.isneginf(s.triu(1)[s.triu(1) != 0]).all()
    lower = s[torch.tril(torch.ones(50, 50, dtype=torch.bool)).expand_as(s)]
    assert (lower <= 0).all()
    explicit = torch.stack([torch.stack([a[:, j + 1:i + 1].sum(-1) for j in range(50)], -1) for i in range(50)], -2)
    assert_close(torch.where(torch.isinf(s), 0, s), torch.where(torch.isinf(s), 0, explicit))


def test_long_sequence_strong_decay_finite():
    x, dt, A, B, C, h0 = make(b=1, T=4096, h=2, p=4, g=1, n=8, grad=False)
    y, s = ssd_chunked(x, dt * 20, A, B, C, chunk_size=64)
    assert torch.isfinite(y).all() and torch.isfinite(s).all()
