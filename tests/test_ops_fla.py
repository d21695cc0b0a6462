"""The FLA adapters (ops/fla.py) on a CPU: each adapter's mapping, run with FLA's pure-PyTorch naive forms in place of
its Triton kernels, equals our own reference op (forward, final state and every gradient, float32, <= 1e-5 relative),
with initial states, resets (packed documents -> FLA's cu_seqlens) and groups; and the CUDA dispatch picks FLA."""
import warnings

import pytest
import torch
import torch.nn.functional as F

with warnings.catch_warnings():       # fla warns that Triton has no GPU here: its naive forms are what we use
    warnings.simplefilter("ignore")
    pytest.importorskip("fla.ops.simple_gla.naive")
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    from fla.ops.gla.naive import naive_recurrent_gla
    from fla.ops.kda.naive import naive_recurrent_kda
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

from hybridlm.ops import fla                                         # noqa: E402
from hybridlm.ops.delta_rule import delta_rule_recurrent             # noqa: E402
from hybridlm.ops.gla import gla_recurrent                           # noqa: E402
from hybridlm.ops.ssd import ssd_recurrent                           # noqa: E402

TOL = 1e-5


def varlen(naive):
    """FLA's varlen contract around a naive form that has none: with cu_seqlens the batch is one row of N
    segments, each run from its own initial state (initial_state [N, ...]); final states [N, ...]."""
    def kernel(*ins, initial_state=None, output_final_state=True, cu_seqlens=None, cu_seqlens_cpu=None, **kw):
        if cu_seqlens is None:
            return naive(*ins, initial_state=initial_state, output_final_state=True, **kw)
        assert ins[0].shape[0] == 1 and torch.equal(cu_seqlens.cpu(), cu_seqlens_cpu)
        outs, states = [], []
        for i, (a, b) in enumerate(zip(cu_seqlens_cpu[:-1].tolist(), cu_seqlens_cpu[1:].tolist())):
            o, s = naive(*(t[:, a:b] for t in ins), initial_state=None if initial_state is None else
                         initial_state[i:i + 1], output_final_state=True, **kw)
            outs.append(o)
            states.append(s)
        return torch.cat(outs, 1), torch.cat(states, 0)
    return kernel


def gla_naive(q, k, v, g, *, scale, **kw):
    """naive_recurrent_gla has no scale argument (it uses 1/sqrt(K)): fold ours into q."""
    return naive_recurrent_gla(q * (scale * q.shape[-1] ** 0.5), k, v, g, **kw)


def gdr_naive(q, k, v, g, beta, **kw):
    """naive_recurrent_gated_delta_rule takes (beta, g) where chunk_gated_delta_rule takes (g, beta), and has no
    GVA: value head j reads key head j // (HV / H) in the chunk kernel (naive_recurrent_kda's rule too)."""
    r = v.shape[2] // q.shape[2]
    return naive_recurrent_gated_delta_rule(q.repeat_interleave(r, 2), k.repeat_interleave(r, 2), v, beta, g, **kw)


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _check(adapter, reference, inputs, seed=7):
    """adapter(*inputs) against reference(*inputs): output, final state and the gradients of every input."""
    results = []
    for fn in (adapter, reference):
        xs = [x.detach().clone().requires_grad_(x.is_floating_point()) if x is not None else None for x in inputs]
        o, s = fn(*xs)
        gen = torch.Generator().manual_seed(seed)
        loss = (o * torch.randn(o.shape, generator=gen)).sum() + (s * torch.randn(s.shape, generator=gen)).sum()
        loss.backward()
        results.append((o.detach(), s.detach(), [x.grad for x in xs if x is not None and x.requires_grad]))
    (oa, sa, ga), (orf, sr, gr) = results
    assert _rel(oa, orf) <= TOL, ("output", _rel(oa, orf))
    assert _rel(sa, sr) <= TOL, ("final state", _rel(sa, sr))
    assert len(ga) == len(gr)
    for i, (a, b) in enumerate(zip(ga, gr)):
        assert a is not None and _rel(a, b) <= TOL, (f"grad of input {i}", _rel(a, b))


def _resets(b, T, gen, first=False):
    r = torch.rand(b, T, generator=gen) < 0.15
    r[:, 0] = first
    if b > 1:
        r[1, 0] = True            # a row that starts a document: its initial state is dropped
    return r


CASES = [dict(init=False, resets=False), dict(init=True, resets=False), dict(init=True, resets=True),
         dict(init=False, resets=True)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"init{int(c['init'])}-resets{int(c['resets'])}")
def test_ssd_adapter(case):
    gen = torch.Generator().manual_seed(0)
    b, T, h, p, g, n = 2, 23, 4, 5, 2, 6              # 2 groups of B/C shared by 2 heads each
    x = torch.randn(b, T, h, p, generator=gen)
    dt = F.softplus(torch.randn(b, T, h, generator=gen) - 1)
    A = -torch.rand(h, generator=gen) * 2 - 0.2
    B, C = torch.randn(b, T, g, n, generator=gen), torch.randn(b, T, g, n, generator=gen)
    h0 = torch.randn(b, h, p, n, generator=gen) if case["init"] else None
    r = _resets(b, T, gen) if case["resets"] else None
    kernel = varlen(naive_recurrent_simple_gla)
    _check(lambda *a: fla.ssd_fla(*a[:5], initial_state=a[5], resets=r, kernel=kernel),
           lambda *a: ssd_recurrent(*a[:5], initial_state=a[5], resets=r), [x, dt, A, B, C, h0])


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"init{int(c['init'])}-resets{int(c['resets'])}")
def test_gla_adapter(case):
    gen = torch.Generator().manual_seed(1)
    b, T, h, K, V = 2, 21, 2, 8, 6
    q, k = torch.randn(b, T, h, K, generator=gen), torch.randn(b, T, h, K, generator=gen) * K ** -0.5
    v = torch.randn(b, T, h, V, generator=gen)
    w = F.logsigmoid(torch.randn(b, T, h, K, generator=gen)) / 4
    h0 = torch.randn(b, h, K, V, generator=gen) if case["init"] else None
    r = _resets(b, T, gen) if case["resets"] else None
    kernel = varlen(gla_naive)
    _check(lambda q, k, v, w, s: fla.gla_fla(q, k, v, w, scale=0.3, initial_state=s, resets=r, kernel=kernel),
           lambda q, k, v, w, s: gla_recurrent(q, k, v, w, scale=0.3, initial_state=s, resets=r), [q, k, v, w, h0])


def _delta_inputs(gen, per_channel, b=2, T=19, hk=2, H=4, K=8, V=6):
    q = F.normalize(torch.randn(b, T, hk, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(b, T, hk, K, generator=gen), dim=-1)
    v = torch.randn(b, T, H, V, generator=gen)
    beta = torch.rand(b, T, H, generator=gen)
    g = F.logsigmoid(torch.randn(b, T, H, *((K,) if per_channel else ()), generator=gen)) / 4
    return q, k, v, beta, g, torch.randn(b, H, K, V, generator=gen)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"init{int(c['init'])}-resets{int(c['resets'])}")
@pytest.mark.parametrize("letter", ["G", "K"])
def test_delta_rule_adapter(letter, case):
    """G: chunk_gated_delta_rule with 2 key heads shared by 4 value heads (FLA's GVA); K: chunk_kda (its naive
    form also takes fewer key heads)."""
    gen = torch.Generator().manual_seed(2)
    q, k, v, beta, g, h0 = _delta_inputs(gen, per_channel=letter == "K")
    h0 = h0 if case["init"] else None
    r = _resets(q.shape[0], q.shape[1], gen) if case["resets"] else None
    kernel = varlen(naive_recurrent_kda if letter == "K" else gdr_naive)
    _check(lambda *a: fla.delta_rule_fla(*a[:5], scale=0.4, initial_state=a[5], resets=r, kernel=kernel),
           lambda *a: delta_rule_recurrent(*a[:5], scale=0.4, initial_state=a[5], resets=r), [q, k, v, beta, g, h0])


def test_mamba_adapter_maps_resets_to_seq_idx():
    """mamba_chunk_scan_combined's contract (seq_idx: state passing stops where it changes), written with our
    reference: the adapter's seq_idx and initial-state mapping give our op's result."""
    def mamba_like(x, dt, A, B, C, *, chunk_size, initial_states, seq_idx, return_final_states):
        assert return_final_states and seq_idx.dtype == torch.int32
        starts = torch.ones_like(seq_idx, dtype=torch.bool)
        starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
        starts[:, 0] = seq_idx[:, 0] != 0
        return ssd_recurrent(x, dt, A, B, C, initial_state=initial_states, resets=starts)
    gen = torch.Generator().manual_seed(3)
    b, T, h, p, g, n = 2, 17, 2, 4, 1, 5
    ins = [torch.randn(b, T, h, p, generator=gen), F.softplus(torch.randn(b, T, h, generator=gen)),
           -torch.rand(h, generator=gen) - 0.1, torch.randn(b, T, g, n, generator=gen),
           torch.randn(b, T, g, n, generator=gen), torch.randn(b, h, p, n, generator=gen)]
    r = _resets(b, T, gen)
    _check(lambda *a: fla.ssd_mamba(*a[:5], initial_state=a[5], resets=r, kernel=mamba_like),
           lambda *a: ssd_recurrent(*a[:5], initial_state=a[5], resets=r), ins)


def test_varlen_table():
    r = torch.tensor([[False, False, True, False], [True, False, False, True]])
    cu, cu_cpu, first, last = fla.varlen(r)
    assert cu_cpu.tolist() == [0, 2, 4, 7, 8] and torch.equal(cu, cu_cpu)
    assert first.tolist() == [0, 2] and last.tolist() == [1, 3]


def test_cuda_dispatch_picks_fla(monkeypatch):
    """Each op sends CUDA tensors to its FLA adapter when fla is present and trusted; HYBRIDLM_FLA=0 and CPU tensors
    keep our own path (the device checks are mocked: there is no GPU here)."""
    from hybridlm.ops import delta_rule, gla, ssd
    called = []
    for name in ("ssd_fla", "gla_fla", "delta_rule_fla"):
        monkeypatch.setattr(fla, name, lambda *a, _n=name, **kw: called.append(_n) or ("fla", None))
    monkeypatch.setattr(fla, "_cuda", lambda *ts: True)
    monkeypatch.setattr(fla, "trusted", lambda index: True)
    gen = torch.Generator().manual_seed(4)
    x, dt, A, B, C = (torch.randn(1, 8, 2, 4, generator=gen), torch.rand(1, 8, 2, generator=gen), -torch.rand(2),
                      torch.randn(1, 8, 1, 4, generator=gen), torch.randn(1, 8, 1, 4, generator=gen))
    q, k, v, beta, g, _ = _delta_inputs(gen, per_channel=False, b=1, T=8)
    w = F.logsigmoid(torch.randn(1, 8, 2, 8, generator=gen))
    calls = [lambda: ssd.ssd_chunked(x, dt, A, B, C), lambda: gla.gla_chunked(q, k, k, w),
             lambda: delta_rule.delta_rule(q, k, v, beta, g)]
    for fn in calls:
        assert fn()[0] == "fla"
    assert called == ["ssd_fla", "gla_fla", "delta_rule_fla"]
    monkeypatch.setenv("HYBRIDLM_FLA", "0")
    assert all(fn()[0] != "fla" for fn in calls) and len(called) == 3
    monkeypatch.delenv("HYBRIDLM_FLA")
    monkeypatch.setattr(fla, "_cuda", lambda *ts: False)          # CPU tensors: our PyTorch forms
    assert all(fn()[0] != "fla" for fn in calls) and len(called) == 3
    monkeypatch.setattr(fla, "_cuda", lambda *ts: True)
    monkeypatch.setattr(fla, "trusted", lambda index: False)      # Hopper with a Triton FLA refuses
    assert all(fn()[0] != "fla" for fn in calls) and len(called) == 3
