"""ops/flex.py: flex_attention with mask_mods / score_mods = the explicit `attention_ref` for every mask kind.
CPU flex_attention (torch 2.13) runs forward only and eagerly without a compile; gradients and the compiled
kernel are checked on CUDA (and one compiled CPU forward, marked slow: its first compile takes minutes)."""
import warnings

import pytest
import torch

from conftest import assert_close
from hybridlm.errors import ConfigError, InputError
from hybridlm.ops import flex
from hybridlm.ops.attention import attention, attention_ref
from hybridlm.ops.wm import topk_key_mask

pytestmark = [pytest.mark.skipif(not flex.flex_available(), reason="torch without flex_attention"),
              pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]
CUDA = torch.cuda.is_available()


def _inputs(B=2, T=13, S=21, Hq=4, Hk=2, D=16, Dv=None, dtype=torch.float32, device="cpu"):
    q = torch.randn(B, T, Hq, D, device=device, dtype=dtype)
    k = torch.randn(B, S, Hk, D, device=device, dtype=dtype)
    v = torch.randn(B, S, Hk, Dv or D, device=device, dtype=dtype)
    return q, k, v


def _masks(kind, B, T, S, device="cpu"):
    """Mask keyword sets of ops.attention: every kind alone and combined."""
    key_mask = torch.rand(B, S, device=device) > 0.3
    key_mask[:, -1] = True
    ids = (torch.rand(B, S, device=device) < 0.15).long().cumsum(1)
    seg = (ids[:, -T:], ids)
    return {
        "causal": dict(causal=True),
        "none": dict(causal=False),
        "key_mask": dict(causal=True, key_mask=key_mask),
        "window": dict(causal=True, window=5),
        "segments": dict(causal=True, segment_ids=seg),
        "noncausal_keymask": dict(causal=False, key_mask=key_mask),
        "all": dict(causal=True, key_mask=key_mask, window=6, segment_ids=seg),
    }[kind]


KINDS = ["causal", "none", "key_mask", "window", "segments", "noncausal_keymask", "all"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(2, 13, 21, 4, 2), (1, 7, 7, 3, 3), (2, 1, 9, 4, 1), (1, 130, 130, 2, 1)])
def test_flex_matches_ref(kind, shape):
    B, T, S, Hq, Hk = shape
    q, k, v = _inputs(B, T, S, Hq, Hk)
    m = _masks(kind, B, T, S)
    assert_close(flex.flex_attention(q, k, v, **m), attention_ref(q, k, v, **m), 1e-5, 1e-5, msg=kind)


def test_flex_value_dim_scale_and_dense_bias():
    q, k, v = _inputs(Dv=8)
    bias = torch.randn(2, 1, 13, 21)                     # broadcast over heads: never expanded in memory
    m = dict(causal=True, window=7, bias=bias, scale=0.3)
    assert_close(flex.flex_attention(q, k, v, **m), attention_ref(q, k, v, **m), 1e-5, 1e-5)


def test_flex_rows_without_keys_are_zero():
    q, k, v = _inputs(B=1, T=4, S=6)
    key_mask = torch.tensor([[False, False, False, True, True, True]])   # the first query (key 2) sees nothing
    out = flex.flex_attention(q, k, v, key_mask=key_mask)
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0]))
    assert_close(out, attention_ref(q, k, v, key_mask=key_mask), 1e-5, 1e-5)


def test_flex_bf16_loose():
    q, k, v = _inputs(dtype=torch.bfloat16)
    m = _masks("all", 2, 13, 21)
    out = flex.flex_attention(q, k, v, **m)
    assert out.dtype == torch.bfloat16
    assert_close(out, attention_ref(q.float(), k.float(), v.float(), **m), 3e-2, 3e-2)


def _wm_reference(q, k, v, key_bias, keep, **m):
    """The WM dt mask as WMAttention._bias builds it: a dense [B, Hq, T, S] bias with -inf outside the top-k."""
    B, T, Hq, _ = q.shape
    S, Hk = k.shape[1], k.shape[2]
    from hybridlm.ops.attention import attention_mask
    bias = key_bias.transpose(1, 2)                                            # [B, Hk, S]
    full = bias[:, :, None, :].expand(B, Hk, T, S)
    if keep is not None:
        vis = attention_mask(T, S, causal=m.get("causal", True), window=m.get("window"),
                             key_mask=m.get("key_mask"), segment_ids=m.get("segment_ids"))
        keep_mask = topk_key_mask(bias, vis, keep) | ~vis
        full = full.masked_fill(~keep_mask, float("-inf"))
    return attention_ref(q, k, v, bias=full.repeat_interleave(Hq // Hk, 1), **m)


@pytest.mark.parametrize("kind", ["causal", "key_mask", "window", "segments", "all"])
@pytest.mark.parametrize("keep", [None, 1, 4, 50])
def test_flex_wm_key_bias_topk(kind, keep):
    B, T, S, Hq, Hk = 2, 11, 19, 4, 2
    q, k, v = _inputs(B, T, S, Hq, Hk)
    m = _masks(kind, B, T, S)
    key_bias = torch.randn(B, S, Hk)
    key_bias[:, ::3] = 0.5                              # ties at the k-th value: later keys win, as topk_key_mask
    out = flex.flex_attention(q, k, v, key_bias=key_bias, keep_topk=keep, **m)
    assert_close(out, _wm_reference(q, k, v, key_bias, keep, **m), 1e-5, 1e-5, msg=f"{kind} {keep}")


def test_flex_topk_threshold_chunks(monkeypatch):
    """The threshold search in small query chunks = in one chunk."""
    key_bias = torch.randn(2, 30, 2).round()
    m = dict(causal=True, window=None, key_mask=None, segment_ids=None)
    whole = flex.topk_threshold(key_bias, 17, 5, **m)
    monkeypatch.setattr(flex, "_CHUNK", 2 * 2 * 30 * 3)                       # three queries a chunk
    parts = flex.topk_threshold(key_bias, 17, 5, **m)
    assert torch.equal(whole[0], parts[0]) and torch.equal(whole[1], parts[1])


@pytest.mark.parametrize("kind", ["causal", "key_mask", "segments"])
def test_flex_indexer_topk(kind):
    B, T, S, Hq = 2, 9, 70, 4                       # S > 64: two bitset words
    q, k, v = _inputs(B, T, S, Hq, 1)
    m = _masks(kind, B, T, S)
    scores = torch.randn(B, T, S)
    top = scores.topk(12, dim=-1).indices           # some selected keys are in the future: the mask hides them
    keep = torch.zeros(B, T, S, dtype=torch.bool).scatter_(-1, top, True)
    bias = torch.zeros(B, 1, T, S).masked_fill(~keep[:, None], float("-inf"))
    out = flex.flex_attention(q, k, v, index_topk=top, **m)
    assert_close(out, attention_ref(q, k, v, bias=bias, **m), 1e-5, 1e-5)


def test_flex_bitset():
    idx = torch.tensor([[[0, 63, 64, 127, 5]]])
    bits = flex.index_bitset(idx, 130)
    got = [s for s in range(130) if (int(bits[0, 0, s // 64]) >> (s % 64)) & 1]
    assert got == [0, 5, 63, 64, 127]
    with pytest.raises(InputError):
        flex.index_bitset(torch.tensor([[[130]]]), 130)


def test_flex_bad_input():
    q, k, v = _inputs(Hq=3, Hk=2)
    with pytest.raises(InputError):
        flex.flex_attention(q, k, v)
    q, k, v = _inputs()
    with pytest.raises(InputError):
        flex.flex_attention(q, k, v, keep_topk=2)


def test_dispatch_switch(monkeypatch):
    """attention() on CPU goes through flex only with HYBRIDLM_FLEX=1 and no gradient; the result is the same."""
    q, k, v = _inputs()
    m = _masks("all", 2, 13, 21)
    calls = []
    real = flex.flex_attention
    monkeypatch.setattr(flex, "flex_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.delenv("HYBRIDLM_FLEX", raising=False)
    base = attention(q, k, v, **m)
    assert not calls
    monkeypatch.setenv("HYBRIDLM_FLEX", "1")
    assert_close(attention(q, k, v, **m), base, 1e-5, 1e-5)
    assert len(calls) == 1
    attention(q, k[:, :13], v[:, :13])              # plain causal T == S: SDPA's own kernels
    attention(q, k, v, causal=False)                # unmasked: SDPA
    assert len(calls) == 1
    qg = q.clone().requires_grad_()
    attention(qg, k, v, **m).sum().backward()       # CPU flex has no backward: the SDPA path
    assert len(calls) == 1
    attention(q[:, :1], k, v, key_mask=m["key_mask"], window=6)   # one query row (decoding): SDPA
    assert len(calls) == 1
    monkeypatch.setenv("HYBRIDLM_FLEX", "0")
    attention(q, k, v, **m)
    assert len(calls) == 1
    monkeypatch.setenv("HYBRIDLM_FLEX", "yes")
    with pytest.raises(ConfigError):
        attention(q, k, v, **m)


@pytest.mark.slow
def test_flex_compiled_cpu():
    """The compiled block mask and kernel (what CUDA runs) on CPU: one mask combination, WM top-k included."""
    q, k, v = _inputs()
    m = _masks("all", 2, 13, 21)
    key_bias = torch.randn(2, 21, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = flex.flex_attention(q, k, v, key_bias=key_bias, keep_topk=3, compiled=True, **m)
    assert_close(out, _wm_reference(q, k, v, key_bias, 3, **m), 1e-5, 1e-5)


@pytest.mark.skipif(not CUDA, reason="needs CUDA: CPU flex_attention has no backward")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_cuda_grads(kind, dtype):
    B, T, S, Hq, Hk = 2, 67, 131, 4, 2
    q, k, v = _inputs(B, T, S, Hq, Hk, D=64, dtype=dtype, device="cuda")
    key_bias = torch.randn(B, S, Hk, device="cuda")
    m = _masks(kind, B, T, S, device="cuda")
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    grads = []
    for fn in (lambda *t: flex.flex_attention(*t[:3], key_bias=t[3], keep_topk=9, **m),
               lambda *t: _wm_reference(*t[:3], t[3], 9, **m)):
        ts = [t.detach().clone().requires_grad_() for t in (q, k, v, key_bias)]
        out = fn(*ts)
        out.float().square().sum().backward()
        grads.append([out] + [t.grad for t in ts])
    for a, b in zip(*grads):
        assert_close(a, b, tol, tol, msg=kind)


MODELS = {   # layout, config: the layers whose masks reach flex (padding, windows, documents, the WM dt mask)
    "A-window-gqa": ("(AM)*2", dict(window=5, n_kv_heads=2)),
    "A-dt-keep-gqa": ("(AM)*2", dict(wm_dyn_mask="dt", wm_keep_window=4, n_kv_heads=2)),
    "A-dt-keep-window": ("(AM)*2", dict(wm_dyn_mask="dt", wm_keep_window=3, window=6)),
    "F-dt-keep": ("(FM)*2", dict(wm_dyn_mask="dt", wm_keep_window=5, wm_inner_topk=1, wm_inner_values=6,
                                 wm_inner_dret=16)),
}


@pytest.mark.parametrize("case", sorted(MODELS))
def test_models_with_flex_match_sdpa(case, monkeypatch):
    """HYBRIDLM_FLEX=1 (flex on CPU for inference) changes no logit: packed documents, left padding, and a
    chunked prefill + decode through the cache."""
    from hybridlm import CausalLM, ModelConfig
    layout, kw = MODELS[case]
    m = CausalLM(ModelConfig(layout=layout, d_model=64, n_heads=4, vocab_size=97, max_seq_len=64, **kw)).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(".A"):
                p.add_(0.5 * torch.randn_like(p))       # off the neutral init: the dt bias matters
    ids = torch.randint(0, 97, (2, 17))
    resets = torch.zeros(2, 17, dtype=torch.bool)
    resets[0, 6] = resets[1, 11] = True
    mask = torch.ones(2, 17, dtype=torch.long)
    mask[1, :4] = 0

    def run():
        with torch.no_grad():
            cache = m.make_cache(2)
            dec = [m(ids[:, :9], attention_mask=mask[:, :9], cache=cache).logits]
            dec += [m(ids[:, t:t + 1], attention_mask=mask[:, t:t + 1], cache=cache).logits for t in range(9, 17)]
            return [m(ids, resets=resets).logits, m(ids, attention_mask=mask).logits, torch.cat(dec, 1)]

    monkeypatch.setenv("HYBRIDLM_FLEX", "0")
    base = run()
    monkeypatch.setenv("HYBRIDLM_FLEX", "1")
    calls, real = [], flex.flex_attention
    monkeypatch.setattr(flex, "flex_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    got = run()
    assert calls and (not kw.get("wm_keep_window") or any(c.get("keep_topk") for c in calls))
    for a, b, what in zip(got, base, ("documents", "padding", "decode")):
        assert_close(a[mask.bool()] if what != "documents" else a, b[mask.bool()] if what != "documents" else b,
                     2e-5, 2e-5, msg=f"{case} {what}")
