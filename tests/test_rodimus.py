"""Rodimus* (He et al., 2025): the product-decay GLA op, the Rodimus mixer against an explicit
token loop of eq. 11, shared-key and sliding-window attention with a bounded cache, two-hop blocks, presets."""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_batch_generates_like_single, assert_close, assert_trains, decode_logits, padded_logits
from hybridlm import CausalLM, InferenceCache, ModelConfig, presets
from hybridlm.cache import WindowKVCache
from hybridlm.context import SeqContext
from hybridlm.errors import ConfigError
from hybridlm.layers.attention import Attention
from hybridlm.layers.init import initialised
from hybridlm.layers.mamba2 import Mamba2
from hybridlm.layers.rodimus import Rodimus
from hybridlm.ops.conv import causal_conv1d_ref
from hybridlm.ops.gla import gla_chunked
from hybridlm.ops.gla_product import gla_product_chunked, gla_product_recurrent, gla_product_step

SMALL = dict(d_model=32, n_heads=4, vocab_size=61, rodimus_d_state=8, max_seq_len=512)


def model(layout: str, **kw) -> CausalLM:
    return CausalLM(ModelConfig(layout=layout, **{**SMALL, **kw})).eval()


def ctx_for(x: torch.Tensor) -> SeqContext:
    B, T = x.shape[:2]
    return SeqContext(positions=torch.arange(T).expand(B, T))


# ---------------------------------------------------------------------------------------------------- op
def _gla_inputs(B, T, H, K, V, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(B, T, H, K, generator=g, dtype=dtype), torch.randn(B, T, H, K, generator=g, dtype=dtype)
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    la = -F.softplus(torch.randn(B, T, H, K, generator=g, dtype=dtype))
    lb = -F.softplus(torch.randn(B, T, H, V, generator=g, dtype=dtype) - 1)
    return [t.requires_grad_() for t in (q, k, v, la, lb)]


@pytest.mark.parametrize("T", [1, 7, 19, 40])
@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_product_decay_chunked_equals_recurrence(T, with_init, dtype):
    ins = _gla_inputs(2, T, 2, 5, 6, dtype)
    s0 = torch.randn(2, 2, 5, 6, dtype=dtype) if with_init else None
    outs = [fn(*ins, initial_state=s0) for fn in (gla_product_recurrent, gla_product_chunked)]
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    grads = []
    for o, S in outs:
        assert_close(o, outs[0][0], atol=tol, rtol=tol)
        assert_close(S, outs[0][1], atol=tol, rtol=tol)
        grads.append(torch.autograd.grad(o.sin().sum() + S.square().sum(), ins))
    for ga, gb in zip(*grads):
        assert_close(gb, ga, atol=tol * 10, rtol=tol * 10)


def test_product_decay_resets_equal_separate_runs_and_step_chain():
    q, k, v, la, lb = (t.detach() for t in _gla_inputs(1, 23, 2, 4, 3))
    resets = torch.zeros(1, 23, dtype=torch.bool)
    resets[0, 9] = True
    o, S = gla_product_chunked(q, k, v, la, lb, resets=resets)
    o1, _ = gla_product_recurrent(*(t[:, :9] for t in (q, k, v, la, lb)))
    o2, S2 = gla_product_recurrent(*(t[:, 9:] for t in (q, k, v, la, lb)))
    assert_close(o, torch.cat([o1, o2], 1), atol=1e-12)
    assert_close(S, S2, atol=1e-12)
    state = torch.zeros(1, 2, 4, 3, dtype=torch.float64)
    for t in range(9, 23):
        ot, state = gla_product_step(q[:, t], k[:, t], v[:, t], la[:, t], lb[:, t], state)
        assert_close(ot, o[:, t], atol=1e-12)


def test_product_decay_without_value_decay_is_gla():
    q, k, v, la, _ = (t.detach() for t in _gla_inputs(2, 30, 1, 4, 6))
    a = gla_product_chunked(q, k, v, la, torch.zeros_like(v))
    b = gla_chunked(q, k, v, la)
    assert_close(a[0], b[0], atol=1e-12)
    assert_close(a[1], b[1], atol=1e-12)


# ---------------------------------------------------------------------------------------------------- R layer
def rodimus_loop(layer: Rodimus, x: torch.Tensor) -> torch.Tensor:
    """Eq. 11 token by token, written from the paper's flow with the layer's parameters."""
    n = layer.d_state
    xi, z = layer.fc(x).chunk(2, -1)
    xc = F.silu(causal_conv1d_ref(xi, layer.conv.weight, layer.conv.bias))
    q, k = layer.qk_proj(xc).split(n, -1)
    gh, th = layer.gate_proj(xc).split(n, -1)
    g, tau = F.softplus(gh + layer.g_bias), torch.sigmoid(th + layer.tau_bias)
    alpha, alpha_hat = torch.exp(-g * tau), g ** tau
    beta_hat = torch.sigmoid(layer.beta_up(layer.beta_down(xi)))
    khat = k / k.norm(dim=-1, keepdim=True) * alpha_hat
    u = beta_hat * xi
    S = x.new_zeros(x.shape[0], n, layer.d_inner)
    outs = []
    for t in range(x.shape[1]):
        S = alpha[:, t, :, None] * S + khat[:, t, :, None] * u[:, t, None, :]
        outs.append((q[:, t, None, :] / math.sqrt(n) @ S).squeeze(1) + layer.residual_weight * xc[:, t])
    o = torch.stack(outs, 1) * F.silu(z)
    y = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.norm_eps) * layer.norm_weight
    return layer.out_proj(y)


def test_rodimus_layer_equals_explicit_recurrence():
    layer = initialised(Rodimus(16, layer_idx=0, d_state=8, chunk_size=8)).double()
    with torch.no_grad():  # wider gates than the init so decays and input gates really vary
        layer.gate_proj.weight.normal_(0, 0.5)
        layer.beta_up.weight.normal_(0, 0.5)
    x = torch.randn(2, 21, 16, dtype=torch.float64)
    # float64 throughout except ops.norm.gated_rms_norm, which normalises in float32
    assert_close(layer(x, ctx=ctx_for(x)), rodimus_loop(layer, x), atol=1e-6, rtol=1e-6)


def test_rodimus_init():
    layer = initialised(Rodimus(256, layer_idx=0, d_state=64))
    dt = F.softplus(layer.g_bias)
    assert dt.min() >= 1e-4 - 1e-7 and dt.max() <= 0.1 + 1e-6                 # g-bias = softplus⁻¹(dt)
    tau = torch.sigmoid(layer.tau_bias)
    assert tau.min() >= 1 / 16 - 1e-6 and tau.max() <= 0.9 + 1e-6             # τ-bias = logit(U(1/16, 0.9))
    assert layer.rank == 16 and layer.beta_down.out_features == 16            # ℓ = max(d/64, 16)
    assert torch.equal(layer.residual_weight, torch.ones(512))
    # the model-wide N(0, 0.02) re-init keeps the released xavier init (gain 2^-2.5) of the gate projections
    m = model("R", d_model=256, rodimus_d_state=64)
    bound = 2 ** -2.5 * math.sqrt(6 / (512 + 128))
    assert m.blocks[0].mixer.gate_proj.weight.abs().max() <= bound + 1e-6
    assert m.blocks[0].mixer.gate_proj.weight.std() < 0.02


VARIANTS = [dict(), dict(rodimus_use_g=False), dict(rodimus_use_tau=False), dict(rodimus_use_beta_hat=False),
            dict(rodimus_use_g=False, rodimus_use_tau=False), dict(rodimus_product_decay=True)]


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: ",".join(kw) or "full")
def test_rodimus_variants_decode_chunks_padding(kw):
    m = model("RR", rodimus_chunk_size=8, **kw)
    ids = torch.randint(0, 61, (2, 27))
    full = m(ids).logits
    assert_close(decode_logits(m, ids, 10, 20), full, atol=2e-5, msg=str(kw))
    assert_close(padded_logits(m, ids, torch.randint(0, 61, (2, 5))), full, atol=2e-5, msg=f"{kw} left pad")


@pytest.mark.parametrize("kw", VARIANTS[1:], ids=lambda kw: ",".join(kw))
def test_rodimus_ablations_train(kw):
    assert_trains(model("RR", **kw), torch.randint(0, 61, (4, 24)), 10, drop=0.3)


def test_rodimus_state_half_of_mamba2():
    """Paper's claim (section 4.3): at n = 64 the Rodimus state is half of Mamba-2's at d_state 128."""
    x = torch.randn(1, 5, 256)
    caches = []
    for layer in map(initialised, (Rodimus(256, layer_idx=0, d_state=64), Mamba2(256, layer_idx=0, d_state=128))):
        c = InferenceCache(1, 1)
        layer(x, ctx=ctx_for(x), cache=c)
        caches.append(c.layers[0])
    rod, mamba = caches
    assert rod.state.dtype == mamba.state.dtype == torch.float32
    assert rod.state.nbytes * 2 == mamba.state.nbytes                  # 64 × 512 vs 8 heads × 64 × 128


# ---------------------------------------------------------------------------------------------------- attention
def test_shared_key_equals_mha_with_tied_key_weights():
    H, D, d = 4, 8, 32
    ska = Attention(d, H, H, D, layer_idx=0, n_k_heads=1)
    mha = Attention(d, H, H, D, layer_idx=0)
    with torch.no_grad():
        wq, wk, wv = ska.qkv.weight.split((H * D, D, H * D))
        mha.qkv.weight.copy_(torch.cat([wq, wk.repeat(H, 1), wv]))
        mha.out.weight.copy_(ska.out.weight)
    x = torch.randn(2, 13, d)
    assert_close(ska(x, ctx=ctx_for(x)), mha(x, ctx=ctx_for(x)), atol=1e-6)
    assert ska.qkv.weight.shape[0] == (2 * H + 1) * D
    # its KV cache holds one key head and all value heads
    m = model("AM", attn_shared_key=True)
    cache = m.make_cache(1)
    m(torch.randint(0, 61, (1, 9)), cache=cache)
    assert cache.layers[0].k.shape[2] == 1 and cache.layers[0].v.shape[2] == 4


def test_window_cache_is_bounded():
    c = WindowKVCache(5)
    seen = []
    for T in (3, 1, 4, 1, 9, 1, 1):
        k = torch.randn(2, T, 1, 4)
        keys, vals = c.update(k, k + 1)
        seen.append(k)
        allk = torch.cat(seen, 1)
        P = min(allk.shape[1] - T, 4)                       # window - 1 past keys at most
        assert torch.equal(keys, allk[:, allk.shape[1] - T - P:])
        assert torch.equal(vals, keys + 1)
        assert c.k.shape[1] == 5 and c.nbytes == 2 * 2 * 5 * 4 * 4
    for _ in range(7):  # decode steps read the ring in slot order; `order` gives each slot's place in time
        k = torch.randn(2, 1, 1, 4)
        keys, vals, order = c.step(k, k + 1)
        seen.append(k)
        last = torch.cat(seen, 1)[:, -5:]
        assert torch.equal(keys[:, order.argsort()], last) and torch.equal(vals, keys + 1)


@pytest.mark.parametrize("shared_key", [False, True])
def test_sliding_window_decode_equals_full_forward(shared_key):
    m = model("WM WM", swa_window=6, attn_shared_key=shared_key)
    ids = torch.randint(0, 61, (2, 31))
    full = m(ids).logits
    cache = m.make_cache(2)
    assert_close(decode_logits(m, ids, 4, 19, cache=cache), full, atol=2e-5)
    assert all(c.k.shape[1] == 6 for c in cache.layers if c is not None)
    # the window really limits attention: a full-causal model with the same weights differs
    wide = model("WM WM", swa_window=100, attn_shared_key=shared_key)
    wide.load_state_dict(m.state_dict())
    assert (wide(ids).logits[:, 6:] - full[:, 6:]).abs().max() > 1e-3
    assert_close(wide(ids).logits[:, :6], full[:, :6], atol=1e-5)


def test_sliding_window_left_padded_generation():
    m = model("[RWM]*2", swa_window=4, attn_shared_key=True)
    a, b = torch.randint(0, 61, (1, 9)), torch.randint(0, 61, (1, 5))
    assert_batch_generates_like_single(m, a, b, 7)


# ---------------------------------------------------------------------------------------------------- two-hop
def test_two_hop_block_formula():
    m = model("[RWM]", swa_window=3)
    blk = m.blocks[0]
    x = torch.randn(2, 11, 32)
    ctx = ctx_for(x)
    h = blk.mixer(blk.norm1(x), ctx=ctx)
    a = blk.attn(blk.norm2(x + h), ctx=ctx)
    assert_close(blk(x, ctx, None), x + h + blk.ffn(blk.norm3(a + x + h)), atol=1e-6)
    assert_close(blk.branch(x, ctx, None) + x, blk(x, ctx, None), atol=1e-6)
    assert m.num_layers == 3


def test_packed_documents_equal_separate_runs():
    for layout in ("RR", "[RWM]*2"):
        m = model(layout, swa_window=5, rodimus_chunk_size=8)
        a, b = torch.randint(0, 61, (1, 13)), torch.randint(0, 61, (1, 10))
        resets = torch.zeros(1, 23, dtype=torch.bool)
        resets[0, 13] = True
        packed = m(torch.cat([a, b], 1), resets=resets).logits
        assert_close(packed, torch.cat([m(a).logits, m(b).logits], 1), atol=2e-5, msg=layout)


@pytest.mark.parametrize("layout,match", [("[RM]", "missing its attention"), ("[RW]", "missing its MLP"),
                                          ("[RW]*2 M", "missing its MLP"), ("[WM]", "missing its attention"),
                                          ("[RWMM]", "wrong structure"), ("[RMW]", "wrong structure")])
def test_two_hop_structure_errors(layout, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(layout=layout, **SMALL)


def test_bad_options_give_clear_errors():
    with pytest.raises(ConfigError, match="swa_window must be >= 1"):
        ModelConfig(layout="WM", swa_window=0, **SMALL)
    with pytest.raises(ConfigError, match="window must be >= 1"):
        ModelConfig(layout="AM", window=0, **SMALL)
    with pytest.raises(ConfigError, match="width m"):
        ModelConfig(layout="R", rodimus_rank=65, **SMALL)           # m = 2 · 32
    with pytest.raises(ConfigError, match="needs rodimus_use_beta_hat"):
        ModelConfig(layout="R", rodimus_product_decay=True, rodimus_use_beta_hat=False, **SMALL)
    with pytest.raises(ConfigError, match="swa_window"):
        presets.get("rodimus++", swa_window=-3)
    ModelConfig(layout="R", rodimus_rank=64, **SMALL)                # ℓ = m is allowed


# ---------------------------------------------------------------------------------------------------- presets
@pytest.mark.parametrize("name", ["rodimus", "rodimus++"])
def test_cache_bytes_constant_in_context(name):
    m = CausalLM(presets.get(name, n_layers=2, **SMALL, swa_window=16)).eval()
    sizes = []
    for ctx_len in (20, 150, 400):
        cache = m.make_cache(1)
        ids = torch.randint(0, 61, (1, ctx_len))
        with torch.inference_mode():
            for i in range(0, ctx_len, 128):
                m(ids[:, i:i + 128], cache=cache)
            m(ids[:, :1], cache=cache)
        sizes.append(cache.nbytes)
    assert len(set(sizes)) == 1, sizes


def test_preset_sizes_match_the_paper():
    with torch.device("meta"):
        wt = CausalLM(presets.get("rodimus-wt103"))
        pp = CausalLM(presets.get("rodimus++-wt103"))
    assert round(wt.num_parameters() / 1e6, 2) == 46.68                 # table 1: Rodimus 46.68M
    assert abs(pp.num_parameters() / 1e6 - 48.45) < 1.0                   # table 1: Rodimus++ 48.45M
    big = presets.get("rodimus++-1.3b")
    assert big.layout == "[RWM]*24" and big.n_heads == 16 and big.attn_head_dim == 128 and big.swa_window == 1024
    assert presets.get("rodimus-125m").layout == "R*24"                  # GPT-3's 12 layers doubled (E.2)


def test_product_decay_long_strong_decay_stays_finite():
    T = 16384
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, T, 1, 16, generator=g) for _ in range(2))
    v = torch.randn(1, T, 1, 16, generator=g)
    la = (-5 * (0.5 + torch.rand(1, T, 1, 16, generator=g))).requires_grad_()
    lb = (-20 * torch.rand(1, T, 1, 16, generator=g)).requires_grad_()   # below the e^-8 floor too
    o, S = gla_product_chunked(q, k, v, la, lb)
    (o.square().mean() + S.square().mean()).backward()
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert torch.isfinite(la.grad).all() and torch.isfinite(lb.grad).all()
    with torch.no_grad():  # the last tokens against the recurrence run from a zero state (strong decay forgets)
        o_ref, _ = gla_product_recurrent(q[:, -64:], k[:, -64:], v[:, -64:], la[:, -64:], lb[:, -64:].clamp(min=-8))
    assert_close(o[:, -16:], o_ref[:, -16:], atol=1e-4)


def test_rodimus_bf16_autocast_trains():
    m = model("[RWM] R", swa_window=4).train()
    ids = torch.randint(0, 61, (2, 40))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = m(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
    cache = m.make_cache(2)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        m(ids[:, :30], cache=cache)
        m(ids[:, 30:31], cache=cache)
    assert cache.layers[0].state.dtype == torch.float32
