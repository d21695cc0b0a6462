"""Tests for hybridlm.ops.moe: each fast op against its dense reference, plus MoE invariants."""

import pytest
import torch
import torch.nn.functional as F

from hybridlm.layers.init import initialised
from hybridlm.ops.moe import (
    expert_neurons,
    expert_neurons_ref,
    load_balancing_loss,
    product_key_topk,
    product_key_topk_ref,
    route_topk,
    routed_experts,
    routed_experts_ref,
)

DT = torch.float64  # reference comparisons in double so tolerances can be tight


# --------------------------------------------------------------------------- product keys


@pytest.mark.parametrize(
    "n_keys,k", [(8, 1), (8, 5), (8, 8), (8, 13), (8, 64), (16, 64), (5, 24), (128, 64), (128, 200)]
)
def test_product_key_topk_matches_ref(n_keys, k):
    g = torch.Generator().manual_seed(n_keys * 100 + k)
    sx = torch.randn(7, 3, n_keys, generator=g, dtype=DT)
    sy = torch.randn(7, 3, n_keys, generator=g, dtype=DT)
    s, ids = product_key_topk(sx, sy, k)
    s_ref, ids_ref = product_key_topk_ref(sx, sy, k)
    assert s.shape == ids.shape == (7, 3, k) and ids.dtype == torch.long
    torch.testing.assert_close(s.sort(-1).values, s_ref.sort(-1).values)  # order along k is free
    assert torch.equal(ids.sort(-1).values, ids_ref.sort(-1).values)
    # ids decode to the scores they claim
    torch.testing.assert_close(s, sx.gather(-1, ids // n_keys) + sy.gather(-1, ids % n_keys))


@pytest.mark.parametrize("rows,n_keys,k,dtype", [
    (1100, 128, 64, torch.float32),   # CPU rows split across threads for numpy's argsort
    (4, 300, 16, DT),                 # rows longer than 256: torch.topk ranks them
    (64, 16, 24, torch.bfloat16),     # ranked in float32, summed in the input dtype
])
def test_product_key_topk_ranking_paths(rows, n_keys, k, dtype):
    g = torch.Generator().manual_seed(rows)
    sx, sy = (torch.randn(rows, 1, n_keys, generator=g).to(dtype) for _ in range(2))
    s, ids = product_key_topk(sx, sy, k)
    s_ref, ids_ref = product_key_topk_ref(sx, sy, k)
    torch.testing.assert_close(s.sort(-1).values, s_ref.sort(-1).values)
    if dtype != torch.bfloat16:  # bf16 sums tie often; any of the tied experts is correct
        assert torch.equal(ids.sort(-1).values, ids_ref.sort(-1).values)


def test_product_key_topk_gradients():
    g = torch.Generator().manual_seed(0)
    sx = torch.randn(6, 2, 8, generator=g, dtype=DT, requires_grad=True)
    sy = torch.randn(6, 2, 8, generator=g, dtype=DT, requires_grad=True)
    w = torch.randn(64, generator=g, dtype=DT)  # a weight per expert id: order-free loss
    s, ids = product_key_topk(sx, sy, 10)
    gx, gy = torch.autograd.grad((s * w[ids]).sum(), (sx, sy))
    s_ref, ids_ref = product_key_topk_ref(sx, sy, 10)
    gx_ref, gy_ref = torch.autograd.grad((s_ref * w[ids_ref]).sum(), (sx, sy))
    torch.testing.assert_close(gx, gx_ref)
    torch.testing.assert_close(gy, gy_ref)


def test_product_key_topk_with_ties():
    # a zero-initialised router scores every expert equally: any k distinct experts are correct
    s, ids = product_key_topk(torch.zeros(4, 1, 8), torch.zeros(4, 1, 8), 20)
    assert (s == 0).all()
    assert ((ids >= 0) & (ids < 64)).all()
    assert all(row.unique().numel() == 20 for row in ids.view(4, 20))


def test_product_key_topk_rejects_too_large_k():
    with pytest.raises(AssertionError):
        product_key_topk(torch.randn(2, 1, 4), torch.randn(2, 1, 4), 17)


# --------------------------------------------------------------------------- CDMoE experts


def _neuron_inputs(N=24, d=12, E=40, k=6, seed=0, unique=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, d, generator=g, dtype=DT)
    down = torch.randn(E, d, generator=g, dtype=DT)
    up = torch.randn(E, d, generator=g, dtype=DT)
    if unique:  # distinct experts per token, as product-key retrieval gives
        ids = torch.rand(N, E, generator=g).argsort(-1)[:, :k]
    else:
        ids = torch.randint(0, E, (N, k), generator=g)
    gates = torch.rand(N, k, generator=g, dtype=DT)
    return x, down, up, ids, gates


@pytest.mark.parametrize("unique", [True, False])
@pytest.mark.parametrize("act", [F.silu, F.gelu, torch.relu])
@pytest.mark.parametrize("weighting", ["gates", "scale", "both"])
def test_expert_neurons_matches_ref(unique, act, weighting):
    x, down, up, ids, gates = _neuron_inputs(unique=unique)
    scale = torch.randn(gates.shape, generator=torch.Generator().manual_seed(5), dtype=DT)
    if weighting == "gates":
        scale = None
    elif weighting == "scale":
        gates = None
    leaves = [t.requires_grad_() for t in (x, down, up, gates, scale) if t is not None]
    gy = torch.randn(x.shape, dtype=DT)
    y = expert_neurons(x, down, up, ids, gates, act=act, scale=scale)
    grads = torch.autograd.grad(y, leaves, gy)
    y_ref = expert_neurons_ref(x, down, up, ids, gates, act=act, scale=scale)
    grads_ref = torch.autograd.grad(y_ref, leaves, gy)
    torch.testing.assert_close(y, y_ref)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b)


def test_expert_neurons_ref_is_the_dense_formula():
    # the gathered reference against every expert on every token with a dense selection mask
    x, down, up, ids, gates = _neuron_inputs(unique=False)
    w = torch.zeros(x.shape[0], down.shape[0], dtype=DT).scatter_add(1, ids, gates)  # repeats add up
    dense = (F.silu(x @ down.t()) * w) @ up
    torch.testing.assert_close(expert_neurons_ref(x, down, up, ids, gates), dense)


def test_expert_neurons_gradcheck():
    x, down, up, ids, gates = _neuron_inputs(N=5, d=4, E=9, k=3)
    scale = torch.randn(gates.shape, generator=torch.Generator().manual_seed(1), dtype=DT)
    inputs = tuple(t.requires_grad_() for t in (x, down, up, gates, scale))
    assert torch.autograd.gradcheck(
        lambda a, b, c, g, s: expert_neurons(a, b, c, ids, g, scale=s), inputs
    )


def test_expert_neurons_narrow_sort_keys():
    # > 256 and > 32768 experts take the int16 and int32 sort keys; few tokens keep the dense ref cheap
    for E in (300, 40000):
        x, down, up, ids, gates = _neuron_inputs(N=4, d=3, E=E, k=5, seed=E)
        leaves = [t.requires_grad_() for t in (x, down, up, gates)]
        y = expert_neurons(x, down, up, ids, gates)
        y_ref = expert_neurons_ref(x, down, up, ids, gates)
        torch.testing.assert_close(y, y_ref)
        for a, b in zip(torch.autograd.grad(y.sum(), leaves), torch.autograd.grad(y_ref.sum(), leaves)):
            torch.testing.assert_close(a, b)


def test_expert_neurons_grads_only_on_selected_rows():
    x, down, up, ids, gates = _neuron_inputs(N=6, E=64, k=3)
    down.requires_grad_()
    up.requires_grad_()
    expert_neurons(x, down, up, ids, gates).square().sum().backward()
    selected = torch.zeros(64, dtype=torch.bool)
    selected[ids.reshape(-1)] = True
    for grad in (down.grad, up.grad):
        assert (grad[~selected] == 0).all()
        assert (grad[selected].abs().sum(-1) > 0).all()


def test_expert_neurons_without_grad_and_float32():
    x, down, up, ids, gates = (t.float() if t.is_floating_point() else t for t in _neuron_inputs())
    with torch.no_grad():
        y = expert_neurons(x, down, up, ids, gates)
    torch.testing.assert_close(y, expert_neurons_ref(x, down, up, ids, gates), rtol=1e-4, atol=1e-4)


def test_expert_neurons_bf16_input_with_float32_tables():
    """Under autocast x arrives in bf16 while the tables stay float32 (mixed-precision training of cheems)."""
    x, down, up, ids, gates = (t.float() if t.is_floating_point() else t for t in _neuron_inputs())
    xb = x.bfloat16().requires_grad_()
    y = expert_neurons(xb, down, up, ids, gates)
    y.sum().backward()
    torch.testing.assert_close(y, expert_neurons_ref(xb.detach().float(), down, up, ids, gates), rtol=1e-4, atol=1e-4)
    assert xb.grad.dtype == torch.bfloat16


# --------------------------------------------------------------------------- routed experts


def _routed_inputs(N=20, d=8, f=6, E=5, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, d, generator=g, dtype=DT)
    w_gate = torch.randn(E, d, f, generator=g, dtype=DT) / d**0.5
    w_up = torch.randn(E, d, f, generator=g, dtype=DT) / d**0.5
    w_down = torch.randn(E, f, d, generator=g, dtype=DT) / f**0.5
    w_router = torch.randn(d, E, generator=g, dtype=DT)
    return x, w_gate, w_up, w_down, w_router


@pytest.mark.parametrize("k", [1, 2, 5])
def test_routed_experts_matches_ref(k):
    x, w_gate, w_up, w_down, w_router = _routed_inputs(k=k)
    leaves = [t.requires_grad_() for t in (x, w_gate, w_up, w_down, w_router)]
    weights, ids, _ = route_topk(x @ w_router, k)
    gy = torch.randn(x.shape, dtype=DT)
    y = routed_experts(x, w_gate, w_up, w_down, ids, weights)
    grads = torch.autograd.grad(y, leaves, gy, retain_graph=True)  # router graph is shared
    y_ref = routed_experts_ref(x, w_gate, w_up, w_down, ids, weights)
    grads_ref = torch.autograd.grad(y_ref, leaves, gy)
    torch.testing.assert_close(y, y_ref)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b)


def test_routed_experts_under_bf16_autocast():
    """float32 tokens and weights, bf16 autocast (mixed-precision training): bf16 out, the reference's values."""
    x, w_gate, w_up, w_down, w_router = (t.float() for t in _routed_inputs(k=2))
    weights, ids, _ = route_topk(x @ w_router, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = routed_experts(x, w_gate, w_up, w_down, ids, weights)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), routed_experts_ref(x, w_gate, w_up, w_down, ids, weights), atol=0.1, rtol=0.05)


def test_routed_experts_unbalanced_and_unused_experts():
    x, w_gate, w_up, w_down, _ = _routed_inputs(N=9, E=6, k=2)
    ids = torch.tensor([[0, 3]] * 7 + [[3, 4]] * 2)  # experts 1, 2, 5 unused; expert 3 gets 9
    weights = torch.rand(9, 2, dtype=DT)
    torch.testing.assert_close(
        routed_experts(x, w_gate, w_up, w_down, ids, weights),
        routed_experts_ref(x, w_gate, w_up, w_down, ids, weights),
    )


def test_route_topk():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, -1.0, 4.0, 0.0]])
    w, ids, probs = route_topk(logits, 2)
    assert torch.equal(ids, torch.tensor([[1, 3], [0, 2]]))
    torch.testing.assert_close(probs, logits.softmax(-1))
    torch.testing.assert_close(w.sum(-1), torch.ones(2))
    torch.testing.assert_close(w[:, 0] / w[:, 1], torch.exp(torch.tensor([1.0, 1.0])))
    w_raw, _, _ = route_topk(logits, 2, norm_topk=False)
    torch.testing.assert_close(w_raw, probs.gather(-1, ids))


def test_load_balancing_loss():
    N, E, k = 32, 8, 2
    uniform = torch.full((N, E), 1.0 / E)
    balanced = (torch.arange(N * k) % E).view(N, k)  # every expert gets N·k/E slots
    assert load_balancing_loss(uniform, balanced, E).abs() < 1e-6
    collapsed_probs = torch.zeros(N, E)
    collapsed_probs[:, 0] = 1.0
    collapsed_ids = torch.zeros(N, k, dtype=torch.long)
    collapsed = load_balancing_loss(collapsed_probs, collapsed_ids, E)
    assert collapsed > 0
    torch.testing.assert_close(collapsed, torch.tensor(E - 1.0))
    # it is differentiable through the probabilities
    logits = torch.randn(N, E, requires_grad=True)
    _, ids, probs = route_topk(logits, k)
    load_balancing_loss(probs, ids, E).backward()
    assert logits.grad.abs().sum() > 0


# --------------------------------------------------------------------------- token independence


def _cdmoe_pipeline(x, w_router, down, up, n_keys, k):
    """Router projection -> product keys -> softmax gates -> expert neurons (as CDMoE does it)."""
    sx, sy = (x @ w_router).view(x.shape[0], 2, 1, n_keys).unbind(1)
    scores, ids = product_key_topk(sx, sy, k)
    return expert_neurons(x, down, up, ids[:, 0], scores[:, 0].softmax(-1))


def _routed_pipeline(x, w_router, w_gate, w_up, w_down, k):
    weights, ids, _ = route_topk(x @ w_router, k)
    return routed_experts(x, w_gate, w_up, w_down, ids, weights)


@pytest.mark.parametrize("form", ["cdmoe", "routed"])
def test_tokens_are_independent(form):
    g = torch.Generator().manual_seed(1)
    N, d, j = 16, 8, 5
    x = torch.randn(N, d, generator=g, dtype=DT)
    if form == "cdmoe":
        n_keys, k = 6, 7
        w_router = torch.randn(d, 2 * n_keys, generator=g, dtype=DT)
        down, up = torch.randn(2, n_keys**2, d, generator=g, dtype=DT)
        fn = lambda x: _cdmoe_pipeline(x, w_router, down, up, n_keys, k)  # noqa: E731
    else:
        _, w_gate, w_up, w_down, w_router = _routed_inputs(d=d, E=4, seed=2)
        fn = lambda x: _routed_pipeline(x, w_router, w_gate, w_up, w_down, 2)  # noqa: E731
    y = fn(x)
    x2 = x.clone()
    x2[j] = torch.randn(d, generator=g, dtype=DT) * 3  # also reroutes token j
    y2 = fn(x2)
    others = torch.arange(N) != j
    torch.testing.assert_close(y2[others], y[others], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(y2[j], y[j])
    # and through autograd: d y[j] / d x[i] == 0 for i != j
    xg = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(fn(xg)[j].sum(), xg)
    assert (gx[others] == 0).all() and gx[j].abs().sum() > 0


# --------------------------------------------------------------------------- router variants of the public MoE hybrids


def _deepseek_route_ref(logits, bias, k, n_group, topk_group, norm, scale):
    """DeepSeek-V3's group-limited sigmoid routing written out per token (the form Kimi-Linear and Nemotron-H use)."""
    N, E = logits.shape
    weights, ids = [], []
    for n in range(N):
        s = logits[n].double().sigmoid()
        choice = s + bias.double()
        groups = choice.view(n_group, E // n_group)
        gscore = groups.sort(-1, descending=True).values[:, :2].sum(-1)
        keep = set(gscore.argsort(descending=True)[:topk_group].tolist())
        allowed = torch.tensor([e // (E // n_group) in keep for e in range(E)])
        pick = choice.masked_fill(~allowed, float("-inf")).argsort(descending=True)[:k]
        w = s[pick]
        w = w / w.sum() if norm else w
        weights.append(w * scale)
        ids.append(pick)
    return torch.stack(weights), torch.stack(ids)


@pytest.mark.parametrize("n_group,topk_group,norm", [(1, 1, True), (4, 2, True), (4, 1, False)])
def test_route_topk_sigmoid_groups_bias_scale(n_group, topk_group, norm):
    g = torch.Generator().manual_seed(3)
    logits, bias = torch.randn(9, 16, generator=g), torch.randn(16, generator=g) * 0.3
    w, ids, probs = route_topk(logits, 3, score="sigmoid", bias=bias, n_group=n_group, topk_group=topk_group,
                               norm_topk=norm, scale=2.5)
    w_ref, ids_ref = _deepseek_route_ref(logits, bias, 3, n_group, topk_group, norm, 2.5)
    order, order_ref = ids.sort(-1), ids_ref.sort(-1)
    assert torch.equal(order.values, order_ref.values)
    torch.testing.assert_close(w.gather(1, order.indices).double(), w_ref.gather(1, order_ref.indices))
    torch.testing.assert_close(probs.sum(-1), torch.ones(9))


def test_routed_moe_matches_transformers_routers():
    """Our router and experts against transformers' own blocks: Nemotron-H's sigmoid/group/bias router with
    non-gated squared-ReLU experts, and Jamba's unnormalised softmax top-2."""
    transformers = pytest.importorskip("transformers")
    from hybridlm.layers.routed_moe import RoutedMoE
    from transformers.models.jamba.modeling_jamba import JambaSparseMoeBlock
    torch.manual_seed(0)
    d, h, E = 16, 12, 8
    cfg = transformers.JambaConfig(hidden_size=d, intermediate_size=h, num_experts=E, num_experts_per_tok=2)
    theirs = JambaSparseMoeBlock(cfg)
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ours = initialised(RoutedMoE(d, h, num_experts=E, top_k=2, norm_topk=False))
    gate, up = theirs.experts.gate_up_proj.detach().chunk(2, dim=1)          # [E, 2h, d] -> [E, h, d] each
    ours.load_state_dict({"router.weight": theirs.router.weight.detach(), "w_gate": gate.transpose(1, 2),
                          "w_up": up.transpose(1, 2), "w_down": theirs.experts.down_proj.detach().transpose(1, 2)})
    x = torch.randn(2, 5, d)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter
    ncfg = transformers.NemotronHConfig(hidden_size=d, n_routed_experts=E, num_experts_per_tok=3, n_group=4,
                                        topk_group=2, norm_topk_prob=True, routed_scaling_factor=1.7)
    router = NemotronHTopkRouter(ncfg)
    torch.nn.init.normal_(router.weight, std=0.5)
    router.e_score_correction_bias.normal_(std=0.1)
    _, w_ref, ids_ref = router(x)
    w, ids, _ = route_topk(x.view(-1, d) @ router.weight.t(), 3, score="sigmoid", bias=router.e_score_correction_bias,
                           n_group=4, topk_group=2, norm_topk=True, scale=1.7)
    order, order_ref = ids.sort(-1), ids_ref.sort(-1)
    assert torch.equal(order.values, order_ref.values)
    torch.testing.assert_close(w.gather(1, order.indices), w_ref.gather(1, order_ref.indices))


def test_routed_moe_plain_experts_and_gated_shared_expert():
    from hybridlm.layers.mlp import ACTIVATIONS
    from hybridlm.layers.routed_moe import RoutedMoE
    torch.manual_seed(0)
    moe = initialised(RoutedMoE(8, 6, num_experts=4, top_k=2, shared_expert=True, gated=False, act="relu",
                                shared_gate=True, shared_hidden=10, init_std=0.3))
    assert moe.w_gate is None and moe.shared.w_in.weight.shape == (10, 8)
    x = torch.randn(7, 8)
    weights, ids, _ = route_topk(moe.router(x), 2)
    ref = routed_experts_ref(x, None, moe.w_up, moe.w_down, ids, weights, act=ACTIVATIONS["relu"])
    ref = ref + torch.sigmoid(moe.shared_gate(x)) * moe.shared(x)
    torch.testing.assert_close(moe(x), ref)
    fast = routed_experts(x, None, moe.w_up, moe.w_down, ids, weights, act=ACTIVATIONS["relu"])
    torch.testing.assert_close(fast, ref - torch.sigmoid(moe.shared_gate(x)) * moe.shared(x))
