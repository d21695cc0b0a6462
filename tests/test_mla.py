"""Multi-head latent attention (L) and lightning-indexer sparse attention (I): the two MLA execution paths agree
with each other and with a full forward, the latent cache has the predicted size, the indexer picks the true
top-k of its eq. 70 scores and masks the main attention with it, bad options fail at config time."""
import pytest
import torch

from conftest import assert_close, assert_trains, decode_logits, padded_logits
from hybridlm import CausalLM, InferenceCache, ModelConfig, presets
from hybridlm.context import SeqContext
from hybridlm.errors import ConfigError
from hybridlm.layers.attention import Attention
from hybridlm.layers.indexer import IndexedAttention, LightningIndexer
from hybridlm.layers.mla import MLA

D = 48


def mla(q_lora=24, **kw):
    m = MLA(D, 4, layer_idx=0, kv_lora_rank=20, q_lora_rank=q_lora, qk_nope_dim=10, rope_dim=6, v_dim=14, **kw)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))     # norm gains away from 1, larger scores
    return m.eval()


def ctx_for(B, start, T):
    return SeqContext(positions=torch.arange(start, start + T).expand(B, T))


def run_cached(m, x, split, *, mode):
    """Prefill x[:, :split] (expanded), then decode token by token with `mode`."""
    B, T, _ = x.shape
    cache = InferenceCache(B, 1)
    m.mode = "expanded"
    outs = [m(x[:, :split], ctx=ctx_for(B, 0, split), cache=cache)]
    m.mode = mode
    for t in range(split, T):
        outs.append(m(x[:, t:t + 1], ctx=ctx_for(B, t, 1), cache=cache))
    m.mode = "auto"
    return torch.cat(outs, 1), cache


@pytest.mark.parametrize("q_lora", [24, 0])
def test_absorbed_decode_equals_expanded_decode_equals_full_forward(q_lora):
    m = mla(q_lora)
    x = torch.randn(2, 23, D)
    full = m(x, ctx=ctx_for(2, 0, 23))
    absorbed, cache = run_cached(m, x, 9, mode="absorbed")
    expanded, _ = run_cached(m, x, 9, mode="expanded")
    assert_close(absorbed, full, atol=2e-5, msg="absorbed decode")
    assert_close(expanded, full, atol=2e-5, msg="expanded decode")
    # the absorbed form is exact for many queries at once too (causal mask in latent space)
    m.mode = "absorbed"
    assert_close(m(x, ctx=ctx_for(2, 0, 23)), full, atol=2e-5, msg="absorbed prefill")
    # only the latent and the roped key are cached: (kv_lora_rank + rope_dim) floats per token and row
    slot = cache.layers[0]
    assert slot.k.shape[-1] == 20 + 6 and slot.v.shape[-1] == 0
    assert cache.nbytes == 2 * 23 * (20 + 6) * 4


def test_absorbed_gradients_equal_expanded():
    m = mla()
    x = torch.randn(2, 11, D)
    grads = {}
    for mode in ("expanded", "absorbed"):
        m.mode = mode
        m.zero_grad()
        m(x, ctx=ctx_for(2, 0, 11)).square().sum().backward()
        grads[mode] = {n: p.grad.clone() for n, p in m.named_parameters()}
    for n, g in grads["expanded"].items():
        assert_close(grads["absorbed"][n], g, atol=1e-4, rtol=1e-4, msg=n)


def test_model_decode_uses_absorbed_path_and_cache_is_smaller_than_kv():
    kw = dict(n_layers=2, d_model=256, n_heads=8, vocab_size=97)
    mla_model = CausalLM(presets.get("deepseek-mla", **kw)).eval()
    tpp = CausalLM(presets.get("transformer++", **kw)).eval()
    assert all(m.mode == "auto" for m in mla_model.modules() if isinstance(m, MLA))
    ids = torch.randint(0, 97, (1, 40))
    sizes = {}
    for name, m in (("mla", mla_model), ("tpp", tpp)):
        cache = m.make_cache(1)
        m(ids, cache=cache)
        sizes[name] = cache.nbytes / (40 * 2)                       # bytes per token per layer
    # head_dim 32: latent 4·32 = 128, rope 16 -> 144 floats; K/V: 2 · 8 heads · 32 = 512 floats
    assert sizes["mla"] == (128 + 16) * 4 and sizes["tpp"] == 2 * 256 * 4
    assert sizes["tpp"] / sizes["mla"] == pytest.approx(512 / 144)


# ---------------------------------------------------------------------------------------------------
# lightning indexer

def indexer(topk, q_dim=D, heads=3, head_dim=12, rope_dim=4):
    ix = LightningIndexer(D, q_dim, heads, head_dim, rope_dim, topk)
    with torch.no_grad():
        for p in ix.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return ix.eval()


def test_indexer_scores_are_eq70_and_selection_is_the_true_topk():
    ix = indexer(topk=5)
    B, T = 2, 17
    x, q_in = torch.randn(B, T, D), torch.randn(B, T, D)
    key_mask = torch.ones(B, T, dtype=torch.bool)
    key_mask[1, :4] = False                                         # left padding on row 1
    ctx = SeqContext(positions=torch.arange(T).expand(B, T), key_mask=key_mask)
    scores = ix(x, q_in, ctx)
    # eq. 70 written out head by head
    from hybridlm.ops.rope import apply_rope
    cos, sin = ctx.rope(4, 10000.0)
    q = apply_rope(ix.wq(q_in).view(B, T, 3, 12), cos, sin)
    k = apply_rope(ix.k_norm(ix.wk(x)).unsqueeze(2), cos, sin)[:, :, 0]
    w = ix.w(x) / 3 ** 0.5
    ref = sum(w[:, :, h, None] * torch.relu(q[:, :, h] @ k.transpose(1, 2)) / 12 ** 0.5 for h in range(3))
    visible = torch.ones(T, T, dtype=torch.bool).tril() & key_mask[:, None, :]
    assert_close(scores[visible], ref[visible], atol=1e-5)
    assert torch.isinf(scores[~visible]).all()
    keep = ix.selection(x, q_in, ctx)
    assert (keep.sum(-1) == 5).all()
    for b in range(B):
        for t in range(T):
            vis = visible[b, t]
            n = int(vis.sum())
            chosen = keep[b, t] & vis
            assert int(chosen.sum()) == min(5, n)                  # as many real keys as exist, up to k
            if n > 5:                                               # every chosen score >= every dropped one
                assert scores[b, t][chosen].min() >= scores[b, t][vis & ~keep[b, t]].max()


def _indexed(base, topk):
    if base == "L":
        attn, q_dim = mla(), 24
    else:
        attn, q_dim = Attention(D, 4, 2, 12, layer_idx=0), D
    return IndexedAttention(attn, indexer(topk, q_dim=q_dim), layer_idx=0).eval()


@pytest.mark.parametrize("base", ["L", "A"])
def test_topk_at_least_T_is_dense_and_early_rows_are_dense(base):
    T = 21
    x = torch.randn(2, T, D)
    ctx = ctx_for(2, 0, T)
    layer = _indexed(base, topk=T)
    dense = layer.attn(x, ctx=ctx)
    assert_close(layer(x, ctx=ctx), dense, atol=1e-6)
    layer.indexer.topk = 8                                          # sparse now: rows t < 8 still see all keys
    sparse = layer(x, ctx=ctx)
    assert_close(sparse[:, :8], dense[:, :8], atol=1e-6)
    assert (sparse[:, 8:] - dense[:, 8:]).abs().max() > 1e-3


@pytest.mark.parametrize("base", ["L", "A"])
def test_sparse_attention_equals_attention_restricted_to_selected_keys(base):
    T = 19
    layer = _indexed(base, topk=6)
    x = torch.randn(2, T, D)
    ctx = ctx_for(2, 0, T)
    q_in = layer.attn.query_latent(x) if base == "L" else x
    keep = layer.indexer.selection(x, q_in, ctx)                   # (its top-k is checked above)
    assert keep.shape == (2, T, T) and (keep.sum(-1) == 6).all()
    bias = torch.zeros(keep.shape).masked_fill(~keep, float("-inf")).unsqueeze(1)
    assert_close(layer(x, ctx=ctx), layer.attn(x, ctx=ctx, bias=bias), atol=1e-6)


@pytest.mark.parametrize("base", ["L", "A"])
def test_sparse_prefill_then_decode_equals_full(base):
    T = 26
    layer = _indexed(base, topk=7)
    x = torch.randn(2, T, D)
    full = layer(x, ctx=ctx_for(2, 0, T))
    cache = InferenceCache(2, 1)
    outs = [layer(x[:, :5], ctx=ctx_for(2, 0, 5), cache=cache), layer(x[:, 5:13], ctx=ctx_for(2, 5, 8), cache=cache)]
    outs += [layer(x[:, t:t + 1], ctx=ctx_for(2, t, 1), cache=cache) for t in range(13, T)]
    assert_close(torch.cat(outs, 1), full, atol=2e-5)
    slot = cache.layers[0]
    assert slot.keys.length == T and slot.main.length == T        # the indexer's own small key cache
    assert cache.nbytes == slot.keys.nbytes + slot.main.nbytes > 0


def test_sparse_model_decode_padding_and_training():
    cfg = presets.get("deepseek-sparse", n_layers=2, d_model=64, n_heads=4, vocab_size=97, dsa_topk=6)
    m = CausalLM(cfg).eval()
    ids = torch.randint(0, 97, (2, 24))
    full = m(ids).logits
    assert_close(decode_logits(m, ids, 10), full, atol=2e-5)
    assert_close(padded_logits(m, ids[:1], torch.randint(0, 97, (1, 5))), full[:1], atol=2e-5)
    assert_trains(m, ids, 8, drop=0.3)


@pytest.mark.parametrize("bad, match", [
    (dict(layout="LM", mla_rope_dim=7), "mla_rope_dim .* even"),
    (dict(layout="LM", mla_rope_dim=0), "mla_rope_dim .* even"),
    (dict(layout="LM", mla_kv_lora_rank=0), "mla_kv_lora_rank"),
    (dict(layout="IM", dsa_topk=0), "dsa_topk must be >= 1"),
    (dict(layout="IM", dsa_head_dim=8, dsa_rope_dim=16), "dsa_rope_dim .* at most dsa_head_dim"),
    (dict(layout="IM", dsa_rope_dim=5), "dsa_rope_dim .* even"),
    (dict(layout="IM", dsa_attention="S"), "dsa_attention"),
    (dict(layout="IM", dsa_attention="A", window=8), "window must be None"),
    (dict(layout="IM", dsa_attention="A", rope_dim=7), "rope_dim"),
])
def test_bad_options_raise_config_errors(bad, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(d_model=64, n_heads=4, **bad)
