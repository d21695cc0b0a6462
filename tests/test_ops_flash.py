"""flash_attention must equal plain masked softmax attention (forward and all gradients).

Two independent references: an explicit masked softmax written here (computed in float64) and
torch's scaled_dot_product_attention (with an explicit bottom-right mask and repeated kv heads).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from hybridlm.errors import InputError
from hybridlm.ops.flash import _key_range, flash_attention


def visibility(B, T, S, *, causal, window, key_mask):
    """[B, 1, T, S] bool: which keys each query may see (queries are the last T key positions)."""
    pos_q = torch.arange(S - T, S)[:, None]
    pos_k = torch.arange(S)[None, :]
    vis = torch.ones(T, S, dtype=torch.bool)
    if causal:
        vis &= pos_k <= pos_q
    if window is not None:
        vis &= pos_k > pos_q - window
    vis = vis.expand(B, 1, T, S)
    if key_mask is not None:
        vis = vis & key_mask[:, None, None, :]
    return vis


def reference_attention(q, k, v, *, causal=True, key_mask=None, window=None, bias=None, scale=None):
    """Explicit softmax(q k^T * scale + bias) v with masking; rows with no visible key give 0."""
    B, T, Hq, D = q.shape
    S, Hk = k.shape[1], k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    k = k.repeat_interleave(Hq // Hk, dim=2)
    v = v.repeat_interleave(Hq // Hk, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q, k) * scale
    if bias is not None:
        s = s + bias
    s = s.masked_fill(~visibility(B, T, S, causal=causal, window=window, key_mask=key_mask), -math.inf)
    m = s.amax(dim=-1, keepdim=True).detach()
    m = m.masked_fill(m == -math.inf, 0.0)
    e = torch.exp(s - m)
    p = e / e.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    return torch.einsum("bhts,bshd->bthd", p, v)


def sdpa_attention(q, k, v, *, causal=True, key_mask=None, window=None, bias=None, scale=None):
    B, T, Hq, _ = q.shape
    S, Hk = k.shape[1], k.shape[2]
    vis = visibility(B, T, S, causal=causal, window=window, key_mask=key_mask)
    mask = torch.zeros(vis.shape, dtype=q.dtype).masked_fill(~vis, -math.inf)
    if bias is not None:
        mask = mask + bias
    k = k.repeat_interleave(Hq // Hk, dim=2)
    v = v.repeat_interleave(Hq // Hk, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
    )
    return out.transpose(1, 2)


# (name, dict of settings). pad: None | "left" | "right"; bias: None | "full" | "bcast".
CASES = [
    ("T1_S1", dict(T=1, S=1)),
    ("decode_T1_S37", dict(T=1, S=37, block=8)),
    ("T7", dict(T=7, S=7, block=4)),
    ("T33_gqa", dict(T=33, S=33, Hq=4, Hk=2, block=16)),
    ("T130_mqa_block128", dict(T=130, S=130, Hq=4, Hk=1, block=128)),
    ("T130_block48", dict(T=130, S=130, block=48)),
    ("cache_offset", dict(T=33, S=50, Hq=4, Hk=2, block=8)),
    ("noncausal", dict(T=33, S=50, causal=False, block=16)),
    ("right_pad", dict(T=33, S=33, pad="right", block=8)),
    ("left_pad", dict(T=33, S=33, pad="left", block=8)),
    ("left_pad_cache", dict(T=7, S=40, pad="left", block=8)),
    ("noncausal_pad", dict(T=20, S=33, causal=False, pad="left", block=8)),
    ("window", dict(T=33, S=40, window=5, block=8)),
    ("window_gqa_pad", dict(T=33, S=33, Hq=4, Hk=2, window=9, pad="left", block=7)),
    ("window_big", dict(T=33, S=33, window=100, block=16)),
    ("bias_full", dict(T=33, S=41, Hq=4, Hk=2, bias="full", block=7)),
    ("bias_bcast", dict(T=33, S=33, bias="bcast", block=16)),
    ("bias_window_pad", dict(T=33, S=45, window=12, pad="right", bias="full", block=8)),
    ("dv_ne_d", dict(T=17, S=17, D=16, Dv=24, block=8)),
    ("custom_scale", dict(T=17, S=17, scale=0.3, block=8)),
]


def make_case(cfg, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, T, S = cfg.get("B", 2), cfg["T"], cfg["S"]
    Hq, Hk = cfg.get("Hq", 2), cfg.get("Hk", 2)
    D = cfg.get("D", 16)
    Dv = cfg.get("Dv", D)
    q = torch.randn(B, T, Hq, D, generator=g)
    k = torch.randn(B, S, Hk, D, generator=g)
    v = torch.randn(B, S, Hk, Dv, generator=g)
    key_mask = None
    if cfg.get("pad"):
        key_mask = torch.ones(B, S, dtype=torch.bool)
        n_pad = [0, min(S - 1, 5)]  # batch 0 unpadded, batch 1 padded
        for b, n in enumerate(n_pad):
            if n:
                if cfg["pad"] == "left":
                    key_mask[b, :n] = False
                else:
                    key_mask[b, S - n :] = False
    bias = None
    if cfg.get("bias") == "full":
        bias = torch.randn(B, Hq, T, S, generator=g)
    elif cfg.get("bias") == "bcast":
        bias = torch.randn(1, 1, T, S, generator=g)
    tensors = dict(q=q, k=k, v=v, bias=bias)
    tensors = {n: (t.to(dtype).requires_grad_() if t is not None else None) for n, t in tensors.items()}
    kwargs = dict(
        causal=cfg.get("causal", True), key_mask=key_mask, window=cfg.get("window"), scale=cfg.get("scale")
    )
    return tensors, kwargs


def grads(out, tensors, dout):
    leaves = [t for t in tensors.values() if t is not None]
    return torch.autograd.grad(out, leaves, dout)


def has_empty_rows(cfg, kwargs):
    B, T, S = cfg.get("B", 2), cfg["T"], cfg["S"]
    vis = visibility(B, T, S, causal=kwargs["causal"], window=kwargs["window"], key_mask=kwargs["key_mask"])
    return bool((~vis.any(-1)).any())


@pytest.mark.parametrize("name,cfg", CASES, ids=[c[0] for c in CASES])
def test_matches_references_fp32(name, cfg):
    tensors, kwargs = make_case(cfg)
    out = flash_attention(**tensors, **kwargs, block_size=cfg.get("block", 128))
    dout = torch.randn_like(out)
    got = grads(out, tensors, dout)

    # Explicit reference in float64 on the same values.
    t64 = {n: (t.detach().double().requires_grad_() if t is not None else None) for n, t in tensors.items()}
    ref = reference_attention(**t64, **kwargs)
    ref_grads = grads(ref, t64, dout.double())
    torch.testing.assert_close(out, ref.float(), atol=1e-5, rtol=1e-5)
    for a, b in zip(got, ref_grads):
        torch.testing.assert_close(a, b.float(), atol=1e-5, rtol=1e-5)

    # SDPA returns NaN for rows without a visible key, so compare against it only where none exist.
    if not has_empty_rows(cfg, kwargs):
        t32 = {n: (t.detach().clone().requires_grad_() if t is not None else None) for n, t in tensors.items()}
        sd = sdpa_attention(**t32, **kwargs)
        sd_grads = grads(sd, t32, dout)
        torch.testing.assert_close(out, sd, atol=1e-5, rtol=1e-5)
        for a, b in zip(got, sd_grads):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["T33_gqa", "cache_offset", "window_gqa_pad", "bias_full", "T130_block48"])
def test_matches_references_bf16(name):
    cfg = dict(CASES)[name]
    tensors, kwargs = make_case(cfg, dtype=torch.bfloat16, seed=1)
    out = flash_attention(**tensors, **kwargs, block_size=cfg.get("block", 128))
    assert out.dtype == torch.bfloat16
    dout = torch.randn_like(out)
    got = grads(out, tensors, dout)
    for g, t in zip(got, [t for t in tensors.values() if t is not None]):
        assert g.dtype == t.dtype and g.shape == t.shape

    # fp32 reference on the bf16-rounded values: only our bf16 output/gradient rounding differs.
    t32 = {n: (t.detach().float().requires_grad_() if t is not None else None) for n, t in tensors.items()}
    ref = reference_attention(**t32, **kwargs)
    ref_grads = grads(ref, t32, dout.float())
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    for a, b in zip(got, ref_grads):
        torch.testing.assert_close(a.float(), b, atol=5e-2, rtol=5e-2)

    if not has_empty_rows(cfg, kwargs):
        tb = {n: (t.detach().clone().requires_grad_() if t is not None else None) for n, t in tensors.items()}
        sd = sdpa_attention(**tb, **kwargs)
        torch.testing.assert_close(out.float(), sd.float(), atol=3e-2, rtol=3e-2)
        for a, b in zip(got, grads(sd, tb, dout)):
            torch.testing.assert_close(a.float(), b.float(), atol=1e-1, rtol=5e-2)


def test_gradcheck_fp64_everything():
    cfg = dict(T=6, S=9, Hq=4, Hk=2, D=4, window=4, pad="left", bias="full")
    tensors, kwargs = make_case(cfg, dtype=torch.float64, seed=3)

    def fn(q, k, v, bias):
        return flash_attention(q, k, v, bias=bias, block_size=3, **kwargs)

    assert torch.autograd.gradcheck(fn, tuple(tensors.values()))


def test_empty_rows_are_zero_with_finite_grads():
    B, T, H, D = 2, 8, 2, 8
    q, k, v = (torch.randn(B, T, H, D, requires_grad=True) for _ in range(3))
    key_mask = torch.ones(B, T, dtype=torch.bool)
    key_mask[0, :3] = False  # left padding: the first 3 queries of batch 0 see nothing under causality
    key_mask[1] = False  # a fully padded sequence
    out = flash_attention(q, k, v, key_mask=key_mask, block_size=4)
    assert torch.isfinite(out).all()
    assert (out[0, :3] == 0).all() and (out[1] == 0).all()
    assert (out[0, 3:] != 0).any()
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (k.grad[1] == 0).all() and (v.grad[1] == 0).all()


def test_minus_inf_bias_acts_as_mask():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 10, 2, 8) for _ in range(3))
    key_mask = torch.rand(1, 10) > 0.3
    key_mask[0, 0] = True
    bias = torch.zeros(1, 1, 10, 10).masked_fill(~key_mask[:, None, None, :], -math.inf)
    torch.testing.assert_close(
        flash_attention(q, k, v, bias=bias, block_size=4),
        flash_attention(q, k, v, key_mask=key_mask, block_size=4),
    )


def test_block_size_invariance_and_noncontiguous_inputs():
    torch.manual_seed(0)
    B, T, H, D = 2, 45, 4, 8
    # [B, H, T, D] tensors viewed as [B, T, H, D]: non-contiguous inputs must work.
    q, k, v = (torch.randn(B, H, T, D).transpose(1, 2) for _ in range(3))
    outs = [flash_attention(q, k, v, window=10, block_size=bs) for bs in (1, 5, 16, 45, 1000)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=1e-6, rtol=1e-5)


def test_small_shapes_sweep():
    # Exhaustive small sweep so every tile/mask boundary alignment (block vs window vs offset) occurs.
    g = torch.Generator().manual_seed(0)
    for T in (1, 3, 5, 8):
        for extra in (0, 3):
            S = T + extra
            q = torch.randn(2, T, 2, 4, generator=g)
            k, v = torch.randn(2, S, 1, 4, generator=g), torch.randn(2, S, 1, 4, generator=g)
            key_mask = torch.rand(2, S, generator=g) > 0.3
            for causal, window in [(False, None), (True, None), (True, 1), (True, 2), (True, 3), (True, 5)]:
                for km in (None, key_mask):
                    ref = reference_attention(q, k, v, causal=causal, window=window, key_mask=km)
                    for bs in (1, 2, 3, 5):
                        out = flash_attention(q, k, v, causal=causal, window=window, key_mask=km, block_size=bs)
                        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5,
                                                   msg=lambda m: f"{T=} {S=} {causal=} {window=} {bs=}: {m}")


def test_fully_hidden_key_blocks_are_skipped():
    # Causal: query block [64, 128) of a 256-long sequence only needs keys [0, 128).
    assert _key_range(64, 128, 256, 256, causal=True, window=None) == (0, 128)
    # Window of 16: the same block needs keys [49, 128) only.
    assert _key_range(64, 128, 256, 256, causal=True, window=16) == (49, 128)
    # KV-cache offset: T=4 queries at key positions 96..99 of S=100.
    assert _key_range(0, 4, 4, 100, causal=True, window=None) == (0, 100)
    assert _key_range(0, 4, 4, 100, causal=True, window=8) == (89, 100)
    assert _key_range(0, 4, 4, 100, causal=False, window=None) == (0, 100)


def test_forward_memory_is_tiled():
    from hybridlm.bench.measure import peak_memory

    T, H, D, bs = 1024, 2, 16, 64
    q, k, v = (torch.randn(1, T, H, D) for _ in range(3))
    with torch.no_grad():
        peak = peak_memory(lambda: flash_attention(q, k, v, block_size=bs), what="tensors")["peak_bytes"]
    full_scores = H * T * T * 4
    assert peak < full_scores / 8, (peak, full_scores)


def test_bad_inputs():
    q = torch.randn(1, 4, 4, 8)
    k = torch.randn(1, 4, 3, 8)
    with pytest.raises(InputError):
        flash_attention(q, k, k)  # 4 query heads, 3 kv heads
    with pytest.raises(InputError):
        flash_attention(q, q[:, :2], q[:, :2])  # fewer keys than queries
    with pytest.raises(InputError):
        flash_attention(q, q, q, window=2, causal=False)
    with pytest.raises(InputError):
        flash_attention(q, q, q, key_mask=torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(InputError):
        flash_attention(q, q, q, bias=torch.zeros(1, 3, 4, 4))
