"""The gated delta rule: the chunked WY form equals the token recurrence (forward and gradients of q, k, v, beta,
log_decay and the initial state) for the scalar (Gated DeltaNet) and per-channel (KDA) gates, with resets, odd
lengths, several chunk sizes and strong gates; float64 tight, bf16 loose."""
import pytest
import torch
import torch.nn.functional as F

from hybridlm.errors import InputError
from hybridlm.ops.delta_rule import delta_rule, delta_rule_chunked, delta_rule_recurrent, delta_rule_step

B, H, K, V = 2, 2, 16, 8


def make_inputs(T, *, per_channel, strong=False, seed=0, dtype=torch.float32):
    """q, k (L2-normalised, as callers pass them), v, beta, log_decay, initial_state."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g)
    k = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    v = torch.randn(B, T, H, V, generator=g)
    shape = (B, T, H, K) if per_channel else (B, T, H)
    if strong:   # log-decays down to about -20, betas pushed to 0 and 1
        log_decay = -20 * torch.rand(shape, generator=g) ** 2
        beta = torch.sigmoid(12 * torch.randn(B, T, H, generator=g))
    else:
        log_decay = -F.softplus(2 * torch.randn(shape, generator=g) - 1)
        beta = torch.rand(B, T, H, generator=g)
    s0 = torch.randn(B, H, K, V, generator=g)
    return [x.to(dtype) for x in (q, k, v, beta, log_decay, s0)]


def run(fn, q, k, v, beta, g, s0=None, *, seed=1, **kw):
    """Forward + backward of a random linear functional of (o, final state); returns (o, state, grads)."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, beta, g)]
    s0_leaf = None if s0 is None else s0.detach().clone().requires_grad_()
    o, state = fn(*leaves, initial_state=s0_leaf, **kw)
    gen = torch.Generator().manual_seed(seed)
    go, gs = torch.randn(o.shape, generator=gen), torch.randn(state.shape, generator=gen)
    ((o.double() * go.double()).sum() + (state.double() * gs.double()).sum()).backward()
    return o.detach(), state.detach(), [x.grad for x in leaves] + ([] if s0_leaf is None else [s0_leaf.grad])


def assert_same(a, b, tol=1e-4):
    for name, x, y in zip(["o", "state"], a[:2], b[:2]):
        torch.testing.assert_close(x.double(), y.double(), rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
    for name, x, y in zip(["q", "k", "v", "beta", "log_decay", "initial_state"], a[2], b[2]):
        torch.testing.assert_close(x.double(), y.double(), rtol=tol, atol=tol, msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("T", [1, 7, 64, 65, 130])
def test_chunked_equals_recurrent(T, per_channel):
    q, k, v, beta, g, s0 = make_inputs(T, per_channel=per_channel)
    ref = run(delta_rule_recurrent, q, k, v, beta, g, s0)
    assert_same(run(delta_rule_chunked, q, k, v, beta, g, s0), ref)
    assert_same(run(delta_rule_chunked, q, k, v, beta, g, None), run(delta_rule_recurrent, q, k, v, beta, g, None))


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 8, 20, 32, 128])
def test_chunk_sizes(chunk_size, per_channel):
    q, k, v, beta, g, s0 = make_inputs(70, per_channel=per_channel)
    ref = run(delta_rule_recurrent, q, k, v, beta, g, s0, scale=0.3)
    assert_same(run(delta_rule_chunked, q, k, v, beta, g, s0, scale=0.3, chunk_size=chunk_size), ref)


@pytest.mark.parametrize("per_channel", [False, True])
def test_strong_gates(per_channel):
    q, k, v, beta, g, s0 = make_inputs(130, per_channel=per_channel, strong=True)
    ref = run(delta_rule_recurrent, q, k, v, beta, g, s0)
    out = run(delta_rule_chunked, q, k, v, beta, g, s0, chunk_size=32)
    assert all(torch.isfinite(x).all() for x in (out[0], out[1], *out[2]))
    assert_same(out, ref)


@pytest.mark.parametrize("per_channel", [False, True])
def test_float64_tight(per_channel):
    q, k, v, beta, g, s0 = make_inputs(100, per_channel=per_channel, dtype=torch.float64)
    ref = run(delta_rule_recurrent, q, k, v, beta, g, s0)
    out = run(delta_rule_chunked, q, k, v, beta, g, s0, chunk_size=32)
    assert out[1].dtype == torch.float64
    assert_same(out, ref, tol=1e-10)


@pytest.mark.parametrize("per_channel", [False, True])
def test_bf16_loose(per_channel):
    q, k, v, beta, g, s0 = make_inputs(70, per_channel=per_channel)
    o_ref, s_ref = delta_rule_recurrent(q, k, v, beta, g, initial_state=s0)
    lo = [x.bfloat16() for x in (q, k, v, beta, g)]
    o, s = delta_rule_chunked(*lo, initial_state=s0)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    torch.testing.assert_close(o.float(), o_ref, rtol=0.05, atol=0.1)
    torch.testing.assert_close(s, s_ref, rtol=0.05, atol=0.1)


@pytest.mark.parametrize("per_channel", [False, True])
def test_resets_equal_separate_runs(per_channel):
    q, k, v, beta, g, s0 = make_inputs(90, per_channel=per_channel)
    cuts = [0, 5, 6, 40, 64, 90]                    # documents of 5, 1, 34, 24, 26 tokens (one starts at a chunk)
    resets = torch.zeros(B, 90, dtype=torch.bool)
    resets[:, cuts[1:-1]] = True
    o, S = delta_rule_chunked(q, k, v, beta, g, initial_state=s0, resets=resets, chunk_size=16)
    o_rec, S_rec = delta_rule_recurrent(q, k, v, beta, g, initial_state=s0, resets=resets)
    torch.testing.assert_close(o, o_rec, rtol=1e-4, atol=1e-4)
    for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        parts = [x[:, a:b] for x in (q, k, v, beta, g)]
        o_doc, S_doc = delta_rule_recurrent(*parts, initial_state=s0 if i == 0 else None)
        torch.testing.assert_close(o[:, a:b], o_doc, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(S, S_doc, rtol=1e-4, atol=1e-4)
    # gradients with resets, per chunk size
    ref = run(delta_rule_recurrent, q, k, v, beta, g, s0, resets=resets)
    assert_same(run(delta_rule_chunked, q, k, v, beta, g, s0, resets=resets, chunk_size=16), ref)


@pytest.mark.parametrize("per_channel", [False, True])
def test_state_passing_and_step(per_channel):
    """Two chunked calls through the state = one call; a decode step continues a chunked prefill."""
    q, k, v, beta, g, s0 = make_inputs(50, per_channel=per_channel)
    o, S = delta_rule(q, k, v, beta, g, initial_state=s0)
    o1, S1 = delta_rule(*(x[:, :33] for x in (q, k, v, beta, g)), initial_state=s0)
    o2, S2 = delta_rule(*(x[:, 33:49] for x in (q, k, v, beta, g)), initial_state=S1)
    o3, S3 = delta_rule_step(*(x[:, 49] for x in (q, k, v, beta, g)), S2)
    torch.testing.assert_close(torch.cat([o1, o2, o3[:, None]], 1), o, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(S3, S, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("per_channel", [False, True])
def test_shared_key_heads(per_channel):
    """q, k with fewer heads than v (Qwen3-Next's value heads sharing key heads): value head j reads key head
    j // (H / Hk), the same as the recurrence on each key head repeated over its value heads (gradients summed)."""
    q, k, v, beta, g, s0 = make_inputs(33, per_channel=per_channel)
    q1, k1 = q[:, :, :1], k[:, :, :1]
    rep = lambda x: x.repeat_interleave(H, 2)
    ref = run(lambda q, k, *a, **kw: delta_rule_recurrent(rep(q), rep(k), *a, **kw), q1, k1, v, beta, g, s0)
    assert_same(run(delta_rule_chunked, q1, k1, v, beta, g, s0), ref)
    with pytest.raises(InputError, match="multiple"):
        delta_rule_chunked(q[:, :, :1].repeat(1, 1, 3, 1), k[:, :, :1].repeat(1, 1, 3, 1), v, beta, g)


def test_bad_inputs():
    q, k, v, beta, g, _ = make_inputs(8, per_channel=False)
    with pytest.raises(InputError, match="log_decay"):
        delta_rule_chunked(q, k, v, beta, g[..., None].expand(B, 8, H, 3))
    with pytest.raises(InputError, match="chunk_size"):
        delta_rule_chunked(q, k, v, beta, g, chunk_size=0)


def test_bench_runs():
    from hybridlm.bench.suites import op_case, op_speedups
    res = op_speedups([op_case("delta-kda", T=40, H=2, K=8, V=8)], repeats=1, log=lambda *a: None)["delta-kda T=40"]
    assert res["recurrent_s"] > 0 and res["chunked_s"] > 0
