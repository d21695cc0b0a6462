"""Lightning-indexer training (DeepSeek-V3.2): the KL target is the main attention's head-mean distribution, the
KL matches its written-out form, the detach keeps the two losses apart, the warm-up stage freezes all but the
indexers and attends densely, the indexer learns (its parameters move, its KL falls), and its captured
attention mass is measured against a by-hand computation."""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_close, decode_logits
from hybridlm import CausalLM, ConfigError, presets
from hybridlm.context import SeqContext
from hybridlm.layers.attention import Attention, norm_and_rope
from hybridlm.layers.indexer import IndexedAttention
from hybridlm.ops.indexer_loss import attention_target, attention_target_ref, indexer_kl, indexer_kl_ref
from hybridlm.train.stages import apply_stage


def sparse_model(topk=6, **kw):
    cfg = presets.get("deepseek-sparse", **{**dict(n_layers=2, d_model=48, n_heads=4, vocab_size=61, dsa_topk=topk),
                                            **kw})
    return CausalLM(cfg)


def indexers(m):
    return [mod for mod in m.modules() if isinstance(mod, IndexedAttention)]


def split_params(m):
    ix = {id(p) for layer in indexers(m) for p in layer.indexer.parameters()}
    return [p for p in m.parameters() if id(p) in ix], [p for p in m.parameters() if id(p) not in ix]


# --- ops ------------------------------------------------------------------------------------------------------
def _masks(kind, B, T, S):
    if kind == "keys":
        km = torch.ones(B, S, dtype=torch.bool)
        km[0, :3] = False
        return dict(key_mask=km)
    if kind == "segments":
        seg = torch.tensor([[0] * 4 + [1] * (T - 4), [0] * T])
        return dict(segment_ids=(seg, seg))
    if kind == "bias":
        keep = torch.rand(B, T, S) < 0.5
        return dict(bias=torch.zeros(B, 1, T, S).masked_fill(~keep.unsqueeze(1), float("-inf")))
    return {}


@pytest.mark.parametrize("kind", ["causal", "keys", "segments", "bias"])
@pytest.mark.parametrize("Hk", [4, 1])
def test_target_is_head_summed_l1_normalised_attention_by_hand(kind, Hk):
    B, T, H, D = 2, 11, 4, 8
    q, k = torch.randn(B, T, H, D), torch.randn(B, T, Hk, D)
    kw = _masks(kind, B, T, T)
    got = attention_target(q, k, scale=0.3, chunk=4, **kw)
    assert_close(got, attention_target_ref(q, k, scale=0.3, **kw), atol=1e-6)
    want = torch.zeros(B, T, T)
    for b in range(B):
        for t in range(T):
            vis = [s for s in range(t + 1)
                   if (kind != "keys" or kw["key_mask"][b, s]) and
                   (kind != "segments" or kw["segment_ids"][0][b, s] == kw["segment_ids"][0][b, t]) and
                   (kind != "bias" or math.isfinite(kw["bias"][b, 0, t, s]))]
            for h in range(H):
                logits = torch.stack([q[b, t, h] @ k[b, s, h * Hk // H] * 0.3 for s in vis]) if vis else None
                if logits is not None:
                    want[b, t, vis] += torch.softmax(logits, 0)          # summed over heads ...
            if vis:
                want[b, t] /= want[b, t].sum()                           # ... then L1-normalised per query
    assert_close(got, want, atol=1e-6)


def test_kl_equals_written_out_form_forward_and_backward():
    B, T, S = 2, 5, 7
    target = torch.softmax(torch.randn(B, T, S), -1)
    scores = torch.randn(B, T, S)
    drop = torch.rand(B, T, S) < 0.3
    drop[1, 2] = True                                     # a query with no selected key at all
    target = target.masked_fill(drop, 0.0)
    target = target / target.sum(-1, keepdim=True).clamp_min(1e-9)
    scores = scores.masked_fill(drop, float("-inf")).requires_grad_(True)
    got = indexer_kl(target, scores)
    ref_scores = scores.detach().clone().requires_grad_(True)
    want = indexer_kl_ref(target, ref_scores)
    by_hand = []
    for b in range(B):
        for t in range(T):
            sel = ~drop[b, t]
            if sel.any():
                q = torch.softmax(scores.detach()[b, t][sel], 0)
                p = target[b, t][sel]
                by_hand.append(sum(float(pi * math.log(pi / qi)) for pi, qi in zip(p, q) if pi > 0))
    assert_close(got, torch.tensor(sum(by_hand) / len(by_hand)), atol=1e-6)
    assert_close(got, want, atol=1e-6)
    got.backward()
    want.backward()
    assert torch.isfinite(scores.grad).all()
    assert_close(scores.grad, ref_scores.grad.nan_to_num(0.0), atol=1e-7)
    assert float(indexer_kl(target, torch.log(target).masked_fill(drop, float("-inf")))) < 1e-6   # q = p: zero


# --- layers ---------------------------------------------------------------------------------------------------
def test_attention_need_weights_returns_the_probabilities_it_attends_with():
    attn = Attention(32, 4, 2, 8, layer_idx=0)
    B, T = 2, 9
    x = torch.randn(B, T, 32)
    ctx = SeqContext(positions=torch.arange(T).expand(B, T))
    y, p = attn(x, ctx=ctx, need_weights=True)
    assert_close(y, attn(x, ctx=ctx))
    q, k, _ = attn.qkv(x).split((32, 16, 16), -1)
    q, k = norm_and_rope(attn, q.view(B, T, 4, 8), k.view(B, T, 2, 8), ctx)
    logits = torch.einsum("bthd,bshd->bhts", q, k.repeat_interleave(2, 2)) / 8 ** 0.5
    want = torch.softmax(logits.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")), -1)
    assert_close(p, want.mean(1), atol=1e-6)
    assert_close(p.sum(-1), torch.ones(B, T), atol=1e-6)


@pytest.mark.parametrize("mode", ["expanded", "absorbed"])
def test_mla_weights_agree_between_execution_paths(mode):
    m = sparse_model(topk=5).eval()
    layer = indexers(m)[0]
    x = torch.randn(2, 13, 48)
    ctx = SeqContext(positions=torch.arange(13).expand(2, 13))
    layer.attn.mode = "expanded"
    _, ref = layer.attn(x, ctx=ctx, need_weights=True)
    layer.attn.mode = mode
    y, p = layer.attn(x, ctx=ctx, need_weights=True)
    assert_close(p, ref, atol=1e-5)
    assert_close(p.sum(-1), torch.ones(2, 13), atol=1e-5)


def test_training_forward_equals_inference_forward():
    """The KL path attends exactly as the inference path does (same top-k, same output)."""
    m = sparse_model(topk=5)
    ids = torch.randint(0, 61, (2, 20))
    m.eval()
    want = m(ids).logits
    m.train()
    out = m(ids, return_logits=True)
    assert out.indexer_kl is not None and out.indexer_kl.item() > 0
    assert_close(out.logits, want, atol=1e-5)
    m.eval()
    assert m(ids, labels=ids).indexer_kl is None           # evaluation: no KL, validation loss is the LM loss


# --- the two losses stay apart ----------------------------------------------------------------------------------
def test_sparse_stage_detach_lm_loss_skips_indexer_kl_skips_main_model():
    torch.manual_seed(0)
    m = sparse_model(topk=5).train()
    ids = torch.randint(0, 61, (2, 24))
    out = m(ids, labels=ids, return_logits=True)
    lm = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert_close(out.loss, lm + m.config.dsa_kl_weight * out.indexer_kl, atol=1e-5)
    ix, main = split_params(m)
    g_lm = torch.autograd.grad(lm, ix + main, retain_graph=True, allow_unused=True)
    assert all(g is None for g in g_lm[:len(ix)])                  # the LM loss never reaches the indexer
    assert sum(g is not None for g in g_lm[len(ix):]) > 0.9 * len(main)
    g_kl = torch.autograd.grad(out.indexer_kl, ix + main, allow_unused=True)
    assert all(g is None for g in g_kl[len(ix):])                  # the KL never reaches the main model
    assert all(g is not None and g.abs().sum() > 0 for g in g_kl[:len(ix)])


def test_warmup_freezes_all_but_indexers_and_attends_densely():
    torch.manual_seed(0)
    m = sparse_model(topk=4)
    ids = torch.randint(0, 61, (2, 24))
    m.eval()
    dense = CausalLM(m.config.replace(dsa_topk=24))
    dense.load_state_dict(m.state_dict())
    want = dense.eval()(ids).logits
    apply_stage(m, "indexer-warmup")
    ix, main = split_params(m)
    assert all(p.requires_grad for p in ix) and not any(p.requires_grad for p in main)
    m.train()
    out = m(ids, labels=ids, return_logits=True)
    assert_close(out.logits, want, atol=1e-5)                      # the main attention sees every key
    out.loss.backward()
    assert all(p.grad is None for p in main) and all(p.grad is not None for p in ix)
    apply_stage(m, "full")
    assert not indexers(m)[0].dense
    with pytest.raises(ConfigError, match="no `I` layer"):
        apply_stage(CausalLM(presets.get("deepseek-mla", n_layers=1, d_model=32, n_heads=2, vocab_size=61)),
                    "indexer-warmup")
    with pytest.raises(ConfigError, match="dsa_kl_weight must be > 0"):
        apply_stage(sparse_model(dsa_kl_weight=0.0), "indexer-warmup")


@pytest.mark.parametrize("stage", ["indexer-warmup", "full"])
def test_indexer_learns_its_parameters_move_and_its_kl_falls(stage):
    torch.manual_seed(0)
    m = sparse_model(topk=6)
    apply_stage(m, stage)
    ix, _ = split_params(m)
    init = [p.detach().clone() for p in ix]
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 61, (4, 32))
    m.train()
    kls = []
    for _ in range(20):
        out = m(ids, labels=ids)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        kls.append(out.indexer_kl.item())
    assert all((p - b).abs().max() > 1e-3 for p, b in zip(ix, init))
    if stage == "indexer-warmup":       # a fixed target: the KL falls
        assert kls[-1] < 0.5 * kls[0], kls
    else:                               # the target sharpens as the model learns (the KL of a random model to
        with torch.no_grad():           # near-uniform attention starts near 0): compare with the indexer at init
            trained = m(ids, labels=ids).indexer_kl
            for p, b in zip(ix, init):
                p.copy_(b)
            assert trained < 0.8 * m(ids, labels=ids).indexer_kl, kls


def test_untrained_indexer_with_zero_weight_stays_at_init():
    m = sparse_model(topk=6, dsa_kl_weight=0.0)
    ix, _ = split_params(m)
    before = [p.detach().clone() for p in ix]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ids = torch.randint(0, 61, (2, 24))
    for _ in range(3):
        out = m.train()(ids, labels=ids)
        assert out.indexer_kl is None
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ix, before))


def test_after_indexer_training_decode_equals_forward_and_checkpointing_keeps_gradients():
    torch.manual_seed(0)
    m = sparse_model(topk=5)
    ids = torch.randint(0, 61, (2, 22))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(3):
        out = m.train()(ids, labels=ids)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    m.eval()
    assert_close(decode_logits(m, ids, 7), m(ids).logits, atol=2e-5)
    # activation checkpointing recomputes the block, KL included: the same loss and gradients
    m.train()
    grads = []
    for ckpt in (False, True):
        m.gradient_checkpointing = ckpt
        m.zero_grad()
        m(ids, labels=ids).loss.backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads):
        assert_close(a, b, atol=1e-6)


# --- captured attention mass (eval/attention_recall.py) -----------------------------------------------------------
def test_captured_mass_by_hand_and_monotone_in_k():
    import numpy as np

    from hybridlm.data.tokenizer import ByteTokenizer
    from hybridlm.eval.attention_recall import captured_mass
    from hybridlm.layers.indexer import LightningIndexer
    torch.manual_seed(0)
    m = sparse_model(topk=5, n_layers=1, vocab_size=257).eval()
    ids = np.random.default_rng(0).integers(0, 256, 20)                # one window
    got = captured_mass(m, ids, ByteTokenizer(), seq_len=20, doc_mask=False)
    # by hand: the one `I` layer's input is the normed embedding; its dense head-mean attention, its top-5 keys
    layer = indexers(m)[0]
    x = torch.as_tensor(ids[:20])[None]
    h = m.blocks[0].norm(m.embed(x))
    ctx = SeqContext(positions=torch.arange(20)[None])
    q_lat = layer.attn.query_latent(h)
    scores = layer.indexer(h, q_lat, ctx)
    keep = LightningIndexer.select(scores, 5)
    _, p = layer.attn(h, ctx=ctx, need_weights=True, q_latent=q_lat)
    want = (p * keep).sum(-1)[0, 5:]                               # queries 5.. see more than 5 keys
    assert got["queries"] == 15 and got["k"] == 5
    assert_close(torch.tensor(got["mass"]), want.mean(), atol=1e-5)
    assert_close(torch.tensor(got["oracle"]), p.topk(5, dim=-1).values.sum(-1)[0, 5:].mean(), atol=1e-5)
    assert got["random"] < got["oracle"] and got["mass"] <= got["oracle"] + 1e-6
    assert_close(torch.tensor(got["random"]), (5 / torch.arange(6, 21).float()).mean(), atol=1e-6)
    masses = []
    for k in (3, 8, 14):
        layer.indexer.topk = k
        masses.append(captured_mass(m, ids, ByteTokenizer(), seq_len=20, doc_mask=False)["mass"])
    assert masses[0] <= masses[1] <= masses[2] <= 1.0 + 1e-6        # a larger top-k keeps a superset of keys
    with pytest.raises(Exception, match="needs `I` layers"):
        captured_mass(CausalLM(presets.get("deepseek-mla", n_layers=1, d_model=32, n_heads=2, vocab_size=257)), ids,
                      ByteTokenizer(), seq_len=20)
