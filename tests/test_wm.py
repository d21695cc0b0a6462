"""Wonderful Matrices (Shi et al., 2024): RoPE-SSD, inner-function attention, dynamic masks, CDMoE, routed
MoE, the Cheems / Doge / Jamba presets' building blocks: reference vs fast forms, cache and padding behaviour,
MoE invariants and config errors."""
import pytest
import torch
import torch.nn.functional as F

from conftest import assert_close
from hybridlm import CausalLM, ModelConfig, presets
from hybridlm.context import SeqContext
from hybridlm.errors import ConfigError
from hybridlm.layers.cdmoe import CDMoE
from hybridlm.layers.init import initialised
from hybridlm.layers.rope_ssd import RopeSSD
from hybridlm.layers.routed_moe import RoutedMoE
from hybridlm.layers.wm_attention import WMAttention
from hybridlm.ops.attention import attention, attention_mask
from hybridlm.ops.moe import route_topk, routed_experts_ref
from hybridlm.ops.rope import apply_rope, rope_cos_sin
from hybridlm.ops.wm import (inner_function_values, inner_function_values_ref, key_weighted_attention_ref,
                             topk_key_mask, topk_key_mask_ref)

SMALL = dict(d_model=64, n_heads=4, vocab_size=97, ssd_headdim=16, ssd_d_state=16, ssd_chunk_size=8,
             max_seq_len=128, wm_cdmoe_experts=64, wm_cdmoe_topk=6, wm_cdmoe_dret=16, moe_experts=4,
             wm_inner_dret=16, wm_inner_values=6)


def model(layout: str, **kw) -> CausalLM:
    torch.manual_seed(0)
    m = CausalLM(ModelConfig(layout=layout, **{**SMALL, **kw})).eval()
    with torch.no_grad():  # move the learned mask parameters off their neutral init so they matter
        for name, p in m.named_parameters():
            if name.endswith((".A", "pos_mask", "v_table")):
                p.add_(0.5 * torch.randn_like(p))
    return m


# --- ops: reference vs fast ---------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3, 6])
def test_inner_function_values_match_reference(k):
    x = torch.randn(2, 7, 3, 8, requires_grad=True)
    g = torch.randn(2, 7, 3, 6, requires_grad=True)
    table = torch.randn(3, 6, 8, requires_grad=True)
    out, ref = inner_function_values(x, g, table, k), inner_function_values_ref(x, g, table, k)
    assert_close(out, ref)
    w = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad((out * w).sum(), [x, g, table]),
                    torch.autograd.grad((ref * w).sum(), [x, g, table])):
        assert_close(a, b)


@pytest.mark.parametrize("k", [1, 3, 5, 40])
def test_topk_key_mask_matches_reference(k):
    B, H, T, S = 2, 3, 6, 11
    bias = torch.randint(0, 4, (B, H, S)).float()          # few distinct values: many ties
    km = torch.ones(B, S, dtype=torch.bool)
    km[1, :3] = False
    visible = attention_mask(T, S, causal=True, window=7, key_mask=km)
    keep = topk_key_mask(bias, visible, k)
    assert torch.equal(keep, topk_key_mask_ref(bias, visible, k))
    assert torch.equal(keep.sum(-1), visible.expand(B, H, T, S).sum(-1).clamp(max=k))


@pytest.mark.parametrize("Hk", [4, 2])
def test_position_mask_is_attention_on_scaled_values(Hk):
    """(L ∘ softmax(QKᵀ)) V == softmax(QKᵀ) (L ⊙ V) for a per-key weight L (eq. 4), forward and backward."""
    q = torch.randn(2, 9, 4, 8, requires_grad=True)
    k, v = torch.randn(2, 9, Hk, 8, requires_grad=True), torch.randn(2, 9, Hk, 8, requires_grad=True)
    L = torch.rand(2, 9, Hk, requires_grad=True) + 0.5
    km = torch.ones(2, 9, dtype=torch.bool)
    km[0, :2] = False
    ref = key_weighted_attention_ref(q, k, v, L, key_mask=km)
    out = attention(q, k, v * L.unsqueeze(-1), key_mask=km)
    assert_close(out, ref)
    w = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad((out * w).sum(), [q, k, v, L]),
                    torch.autograd.grad((ref * w).sum(), [q, k, v, L])):
        assert_close(a, b, rtol=1e-4)


# --- RoPE on C and B ----------------------------------------------------------------------------------------
def test_rope_cb_score_depends_only_on_position_difference():
    c, b = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(i, j):
        ci = apply_rope(c, *rope_cos_sin(torch.tensor([[i]]), 16))
        bj = apply_rope(b, *rope_cos_sin(torch.tensor([[j]]), 16))
        return (ci * bj).sum()

    for i, j in [(5, 2), (9, 9), (40, 3)]:
        for shift in (1, 17, 100):
            assert_close(score(i + shift, j + shift), score(i, j))
    assert max((score(5 + d, 2) - score(5, 2)).abs() for d in range(1, 8)) > 1e-2   # it does depend on t - s


def test_rope_ssd_is_shift_invariant_and_has_no_conv_or_d():
    layer = initialised(RopeSSD(32, layer_idx=0, d_state=16, expand=1, headdim=8, chunk_size=4))
    assert not hasattr(layer, "D") and not hasattr(layer, "conv")
    assert (layer.A_log.exp() > 0).all()                    # A = -exp(A_log) < 0: a real decay
    x = torch.randn(2, 13, 32)
    pos = torch.arange(13).expand(2, 13)
    y0 = layer(x, ctx=SeqContext(positions=pos))
    y1 = layer(x, ctx=SeqContext(positions=pos + 37))      # every C·B score is relative (appendix A)
    assert_close(y1, y0, atol=1e-5)
    conv = initialised(RopeSSD(32, layer_idx=0, d_state=16, expand=1, headdim=8, chunk_size=4, position="conv"))
    conv.load_state_dict(layer.state_dict(), strict=False)   # same projections: only the position source differs
    assert {n for n, _ in conv.named_parameters()} - {n for n, _ in layer.named_parameters()} == \
        {"conv.weight", "conv.bias", "D"}
    assert not torch.allclose(conv(x, ctx=SeqContext(positions=pos)), y0)


# --- every new option: decode == full forward, chunked prefill, padding ------------------------------------
CASES = {
    "A-dt": ("(AM)*2", dict(wm_dyn_mask="dt", qk_norm=True, residual_scale=True)),
    "A-dt-keep-gqa": ("(AM)*2", dict(wm_dyn_mask="dt", wm_keep_window=4, n_kv_heads=2)),
    "A-dt-keep-window": ("(AM)*2", dict(wm_dyn_mask="dt", wm_keep_window=3, window=6)),
    "A-dt-window": ("(AM)*2", dict(wm_dyn_mask="dt", window=5, n_kv_heads=2)),
    "A-position": ("(AM)*2", dict(wm_dyn_mask="position", n_kv_heads=2)),
    "F-position-window": ("(FM)*2", dict(wm_dyn_mask="position", window=4)),
    "F": ("(FM)*2", dict()),
    "F-position": ("(FM)*2", dict(wm_dyn_mask="position")),
    "F-dt-keep": ("(FM)*2", dict(wm_dyn_mask="dt", wm_keep_window=5, wm_inner_topk=1)),
    "S-rope": ("S S A", dict(wm_ssd_rope=True)),
    "S-rope-conv": ("S S A", dict(wm_ssd_rope=True, wm_ssd_position="conv")),
    "E-doge": ("(AE)*2", dict(wm_cdmoe_form="doge", wm_cdmoe_heads=2)),
    "E-sum": ("(SE)*2", dict(wm_cdmoe_form="sum", wm_cdmoe_heads=2)),
    "E-compose": ("(SE)*2", dict(wm_cdmoe_form="compose", wm_ssd_rope=True)),
    "O-shared": ("(AO)*2", dict(moe_shared=True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_chunked_prefill_and_padding(case):
    layout, kw = CASES[case]
    m = model(layout, **kw)
    ids = torch.randint(0, 97, (2, 21))
    full = m(ids).logits
    cache = m.make_cache(2)
    parts = [m(ids[:, :6], cache=cache).logits, m(ids[:, 6:13], cache=cache).logits]
    parts += [m(ids[:, t:t + 1], cache=cache).logits for t in range(13, 21)]
    assert_close(torch.cat(parts, 1), full, atol=2e-5, msg=f"{case} decode")
    pad = torch.randint(0, 97, (2, 5))
    lmask = torch.cat([torch.zeros(2, 5), torch.ones(2, 21)], 1).long()
    assert_close(m(torch.cat([pad, ids], 1), attention_mask=lmask).logits[:, 5:], full, atol=2e-5,
                 msg=f"{case} left")
    rmask = torch.cat([torch.ones(2, 21), torch.zeros(2, 5)], 1).long()
    assert_close(m(torch.cat([ids, pad], 1), attention_mask=rmask).logits[:, :21], full, atol=2e-5,
                 msg=f"{case} right")
    # decode after a left-padded prompt: the cache's key mask hides the padding as the full forward does
    seq, cache = torch.cat([pad, ids], 1), m.make_cache(2)
    parts = [m(seq[:, :11], attention_mask=lmask[:, :11], cache=cache).logits]
    parts += [m(seq[:, t:t + 1], attention_mask=lmask[:, t:t + 1], cache=cache).logits for t in range(11, 26)]
    assert_close(torch.cat(parts, 1)[:, 5:], full, atol=2e-5, msg=f"{case} padded decode")


def test_windowed_wm_attention_caches_a_ring():
    """With a window, WM attention keeps only the last `window` keys (and dt biases), as plain attention does."""
    m = model("(AM)*2", wm_dyn_mask="dt", window=5, n_kv_heads=2)
    cache = m.make_cache(2)
    m(torch.randint(0, 97, (2, 9)), cache=cache)
    before = cache.nbytes
    for _ in range(12):
        m(torch.randint(0, 97, (2, 1)), cache=cache)
    ring = [c for c in cache.layers if c is not None]
    assert cache.nbytes == before and all(c.k.shape[1] == 5 for c in ring)
    assert ring[0].v.shape[-1] == ring[0].k.shape[-1] + 1           # the dt bias rides as one more value channel


def test_keep_window_one_attends_to_the_top_bias_key():
    """With keep_window = 1 each query's attention output is the value of its visible key with the
    largest dynamic-mask bias (ties: the latest)."""
    torch.manual_seed(0)
    att = initialised(WMAttention(32, 2, 2, 16, layer_idx=0, max_seq_len=64, dyn_mask="dt", keep_window=1))
    with torch.no_grad():
        att.A.fill_(-1.0)
    x = torch.randn(1, 9, 32)
    seen = {}
    att.out.register_forward_pre_hook(lambda mod, a: seen.__setitem__("y", a[0]))
    att(x, ctx=SeqContext(positions=torch.arange(9)[None]))
    v = att.qkv(x)[..., 64:].view(1, 9, 2, 16)
    b = torch.exp(att.A * F.softplus(att.dt_proj(v.flatten(2))))          # [1, 9, 2]
    y = seen["y"].view(1, 9, 2, 16)
    for t in range(9):
        for h in range(2):
            best = max(range(t + 1), key=lambda s: (b[0, s, h].item(), s))
            assert_close(y[0, t, h], v[0, best, h])


def test_dt_mask_starts_neutral_and_position_mask_scales_values():
    """A = 0 makes the Doge bias a constant (plain attention); the paper's mask starts at ones."""
    plain = model("(AM)*2")
    for mask in ("dt", "position"):
        m = CausalLM(ModelConfig(layout="(AM)*2", wm_dyn_mask=mask, **SMALL)).eval()
        state = {k: v for k, v in m.state_dict().items() if k in plain.state_dict()}
        plain.load_state_dict(state)
        ids = torch.randint(0, 97, (2, 12))
        assert_close(m(ids).logits, plain(ids).logits, atol=1e-5, msg=mask)


# --- mixture of experts ---------------------------------------------------------------------------------------
def _cdmoe_dense_ref(moe: CDMoE, x: torch.Tensor) -> torch.Tensor:
    """All n_keys² product scores, dense top-k, every expert evaluated, selection as a dense mask."""
    N, d = x.shape
    phi = moe.shared(x)
    z = x if moe.form in ("doge", "sum") else phi
    if moe.form == "doge":
        sx, sy = moe.router(z).view(N, 2, moe.heads, moe.n_keys).unbind(1)
    else:
        q = moe.queries(z).view(N, 2, moe.heads, moe.d_ret // 2)
        sx, sy = torch.einsum("nphr,hkpr->pnhk", q, moe.keys).unbind(0)
    allsc = (sx[..., :, None] + sy[..., None, :]).flatten(-2)             # [N, h, E]
    top, ids = allsc.topk(moe.top_k, -1)
    h = z @ moe.down_embed.weight.t()                                      # [N, E] every expert
    if moe.form == "doge":
        w = torch.zeros_like(allsc).scatter(-1, ids, torch.softmax(top, -1))
        coef = (F.silu(h)[:, None, :] * w).sum(1)
    else:
        sel = torch.zeros_like(allsc).scatter(-1, ids, 1.0)
        coef = (F.silu(h[:, None, :] * allsc) * sel).sum(1)
    return coef @ moe.up_embed.weight + phi


@pytest.mark.parametrize("form", ["doge", "sum", "compose"])
def test_cdmoe_matches_dense_reference_and_is_per_token(form):
    torch.manual_seed(0)
    moe = initialised(CDMoE(32, 48, num_experts=49, top_k=5, heads=2, d_ret=8, form=form))
    for emb in (moe.down_embed, moe.up_embed):
        torch.nn.init.normal_(emb.weight, std=0.3)
    x = torch.randn(2, 6, 32)
    y = moe(x)
    assert_close(y.view(12, 32), _cdmoe_dense_ref(moe, x.view(12, 32)), atol=1e-5)
    x2 = x.clone()
    x2[0, 4] += 1.0                                         # perturb one token: no other output moves
    y2 = moe(x2)
    changed = (y2 - y).abs().amax(-1) > 0
    assert changed[0, 4] and changed.sum() == 1


@pytest.mark.parametrize("form", ["doge", "sum", "compose"])
def test_cdmoe_gradients_match_dense_reference(form):
    torch.manual_seed(1)
    moe = initialised(CDMoE(16, 24, num_experts=36, top_k=4, heads=2, d_ret=8, form=form)).double()
    for emb in (moe.down_embed, moe.up_embed):
        torch.nn.init.normal_(emb.weight, std=0.3)
    x = torch.randn(10, 16, dtype=torch.float64, requires_grad=True)
    gy = torch.randn(10, 16, dtype=torch.float64)
    leaves = [x, *moe.parameters()]
    grads = torch.autograd.grad(moe(x), leaves, gy)
    grads_ref = torch.autograd.grad(_cdmoe_dense_ref(moe, x), leaves, gy)
    for (name, _), a, b in zip([("x", x), *moe.named_parameters()], grads, grads_ref):
        assert_close(a, b, msg=name)


def test_cdmoe_gradients_reach_exactly_the_selected_experts():
    torch.manual_seed(0)
    moe = initialised(CDMoE(16, 24, num_experts=64, top_k=3, heads=1, form="doge"))
    x = torch.randn(5, 16)
    _, ids = moe.retrieve(x)
    moe(x).pow(2).sum().backward()
    got = set(moe.down_embed.weight.grad.abs().sum(-1).nonzero().flatten().tolist())
    assert got == set(ids.flatten().tolist())
    assert set(moe.up_embed.weight.grad.abs().sum(-1).nonzero().flatten().tolist()) == got
    assert moe.router.weight.grad.abs().sum() > 0          # the router learns through the softmax weights


def test_routed_moe_reference_independence_gradients_and_aux_loss():
    torch.manual_seed(0)
    moe = initialised(RoutedMoE(16, 24, num_experts=6, top_k=2, shared_expert=True, init_std=0.2))
    x = torch.randn(3, 5, 16)
    y = moe(x)
    xf = x.view(15, 16)
    weights, ids, _ = route_topk(moe.router(xf), 2)
    ref = routed_experts_ref(xf, moe.w_gate, moe.w_up, moe.w_down, ids, weights) + moe.shared(xf)
    assert_close(y.view(15, 16), ref, atol=1e-6)
    x2 = x.clone()
    x2[1, 2] -= 2.0
    changed = (moe(x2) - y).abs().amax(-1) > 1e-6
    assert changed[1, 2] and changed.sum() == 1
    moe.zero_grad()
    y = moe(x)
    (y.pow(2).sum() + moe.aux_loss).backward()
    used = set(ids.flatten().tolist())
    assert set(moe.w_gate.grad.abs().sum((1, 2)).nonzero().flatten().tolist()) == used
    with torch.no_grad():
        moe.router.weight.zero_()                          # uniform router: aux loss is exactly 0
    moe(x)
    assert abs(moe.aux_loss.item()) < 1e-6
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0] = 50.0                      # collapsed router: every token prefers expert 0
    moe(x.abs() + 1)
    assert moe.aux_loss.item() > 1.9                       # E · (½ · 1) - 1 = 2 for top-2 of 6


def test_model_sums_moe_aux_loss():
    m = model("(AO)*2").train()
    ids = torch.randint(0, 97, (2, 16))
    out = m(ids, labels=ids, return_logits=True)
    assert out.aux_loss is not None and out.aux_loss.requires_grad
    ce = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert_close(out.loss, ce + 0.01 * out.aux_loss, atol=1e-6)


# --- models and layouts ---------------------------------------------------------------------------------------
TABLE2 = ["SMSMSMSMSMSMSMA", "SE SMSMSMSMSMSMA", "SMSMSMSMSMSMSMAE", "SE SMSMSMSMSMSMAE",
          "SM SE SE SE SE SE SE AE", "SE SE SE SE SE SE SE AE"]


@pytest.mark.parametrize("layout", TABLE2)
def test_table2_layouts_build_and_run(layout):
    m = model(layout, wm_ssd_rope=True, wm_cdmoe_form="compose")
    assert len(m.blocks) == len(layout.replace(" ", ""))
    assert m(torch.randint(0, 97, (1, 9))).logits.shape == (1, 9, 97)


def test_cheems_cache_is_dominated_by_its_attention_layer():
    cfg = presets.get("cheems", n_layers=1, **{**SMALL, "max_seq_len": 512, "ssd_d_state": 32})
    assert cfg.layout == "((SE)*7 FE)*1"
    m = CausalLM(cfg).eval()
    cache = m.make_cache(1)
    with torch.no_grad():
        m(torch.randint(0, 97, (1, 400)), cache=cache)
    slots = [c for c in cache.layers if c is not None]
    attn = [c.nbytes for c in slots if hasattr(c, "k")]
    ssd = [c.nbytes for c in slots if not hasattr(c, "k")]
    assert len(attn) == 1 and len(ssd) == 7
    assert attn[0] > sum(ssd)                              # 1 attention layer outweighs 7 SSD states
    with torch.no_grad():
        m(torch.randint(0, 97, (1, 1)), cache=cache)
    assert sum(c.nbytes for c in slots if not hasattr(c, "k")) == sum(ssd)   # SSD state does not grow


def test_presets_are_configured_as_described():
    doge = presets.get("doge")
    assert doge.wm_dyn_mask == "dt" and doge.residual_scale and doge.qk_norm and doge.layout == "(AE)*4"
    assert doge.wm_cdmoe_experts == 16384 and doge.wm_cdmoe_topk == 64
    assert presets.get("doge-dense").layout == "(AM)*4"
    cheems = presets.get("cheems")
    assert cheems.wm_ssd_rope and cheems.wm_dyn_mask == "position" and cheems.layout == "((SE)*7 FE)*3"
    assert "O" in presets.get("jamba-ssd").layout and "S" in presets.get("jamba-ssd").layout


def test_bad_configs_give_clear_errors():
    with pytest.raises(ConfigError, match="perfect square"):
        ModelConfig(layout="AE", wm_cdmoe_experts=1000)
    with pytest.raises(ConfigError, match="wm_cdmoe_topk"):
        ModelConfig(layout="AE", wm_cdmoe_experts=64, wm_cdmoe_topk=65)
    with pytest.raises(ConfigError, match="moe_topk"):
        ModelConfig(layout="AO", moe_experts=4, moe_topk=5)
    with pytest.raises(ConfigError, match="wm_keep_window must be between"):
        ModelConfig(layout="AM", wm_dyn_mask="dt", wm_keep_window=4096, max_seq_len=2048)
    with pytest.raises(ConfigError, match="wm_keep_window must be between"):
        ModelConfig(layout="FM", wm_dyn_mask="dt", wm_keep_window=0)
    with pytest.raises(ConfigError, match="needs wm_dyn_mask='dt'"):
        ModelConfig(layout="AM", wm_keep_window=16)
    with pytest.raises(ConfigError, match="wm_dyn_mask must be"):
        ModelConfig(layout="AM", wm_dyn_mask="static")
    with pytest.raises(ConfigError, match="n_kv_heads\\*head_dim"):
        ModelConfig(layout="FM", d_model=64, n_heads=4, n_kv_heads=2)
    with pytest.raises(ConfigError, match="wm_inner_topk"):
        ModelConfig(layout="FM", wm_inner_values=2, wm_inner_topk=3)
    with pytest.raises(ConfigError, match="wm_cdmoe_form"):
        ModelConfig(layout="AE", wm_cdmoe_form="mixture")
    with pytest.raises(ConfigError, match="ssd_d_state must be even"):
        ModelConfig(layout="S", wm_ssd_rope=True, ssd_d_state=15)
    with pytest.raises(ConfigError, match="wm_ssd_position must be rope or conv"):
        ModelConfig(layout="S", wm_ssd_rope=True, wm_ssd_position="alibi")
    with pytest.raises(ConfigError, match="perfect square"):
        presets.get("doge", wm_cdmoe_experts=100 * 101)
