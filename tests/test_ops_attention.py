import pytest
import torch

from conftest import assert_close
from hybridlm.ops.attention import attention, attention_ref
from hybridlm.ops.norm import gated_rms_norm, rms_norm
from hybridlm.ops.rope import apply_rope, apply_rope_ref, rope_cos_sin


def qkv(B=2, T=13, S=None, Hq=4, Hk=2, D=16, dtype=torch.float32):
    S = S or T
    q = torch.randn(B, T, Hq, D, dtype=dtype, requires_grad=True)
    k = torch.randn(B, S, Hk, D, dtype=dtype, requires_grad=True)
    v = torch.randn(B, S, Hk, D, dtype=dtype, requires_grad=True)
    return q, k, v


CASES = [
    dict(),
    dict(window=4),
    dict(key_mask="left"),
    dict(key_mask="right"),
    dict(bias=True),
    dict(causal=False),
    dict(segments=True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(c) or "causal")
@pytest.mark.parametrize("T,S,Hk", [(1, 1, 4), (13, 13, 2), (5, 21, 1), (1, 9, 2), (11, 16, 2)])
def test_sdpa_equals_reference_fwd_bwd(case, T, S, Hk):
    q, k, v = qkv(T=T, S=S, Hk=Hk)
    kw = dict(causal=case.get("causal", True), window=case.get("window"))
    if "key_mask" in case:
        km = torch.ones(2, S, dtype=torch.bool)
        if case["key_mask"] == "left":
            km[0, : S // 2] = False
        else:
            km[1, S - S // 3:] = False
        kw["key_mask"] = km
    if case.get("bias"):
        kw["bias"] = torch.randn(2, 4, T, S, requires_grad=True)
    if case.get("segments"):
        if T != S:
            pytest.skip("segments are for training (no cache)")
        seg = (torch.arange(T) >= T // 2).long().expand(2, T)
        kw["segment_ids"] = (seg, seg)
    ref = attention_ref(q, k, v, **kw)
    out = attention(q, k, v, **kw)
    assert_close(out, ref)
    w = torch.randn_like(ref)
    g1 = torch.autograd.grad((ref * w).sum(), [q, k, v])
    g2 = torch.autograd.grad((out * w).sum(), [q, k, v])
    for a, b in zip(g2, g1):
        assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("T,S,window", [(11, 16, None), (8, 16, None), (5, 21, None), (13, 13, 4), (5, 21, 6)])
def test_bottom_right_causal_without_a_mask_tensor(monkeypatch, T, S, window):
    """The CPU forms of a bottom-right causal (a cache, a context-parallel rank) and of a sliding window that build
    no [T, S] mask: zero queries in front (2T >= S) and the online-softmax form (2T < S or a window, with a mask
    over MASK_BYTES) equal the reference."""
    import hybridlm.ops.attention as A
    q, k, v = qkv(T=T, S=S, Hk=2)
    ref = A.attention_ref(q, k, v, window=window)
    monkeypatch.setattr(A, "MASK_BYTES", 0)
    monkeypatch.setattr(A, "attention_mask", lambda *a, **k: pytest.fail("built a mask"))
    out = A.attention(q, k, v, window=window)
    assert_close(out, ref)
    w = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad((out * w).sum(), [q, k, v]), torch.autograd.grad((ref * w).sum(), [q, k, v])):
        assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_bf16_loose():
    q, k, v = qkv(T=20)
    ref = attention_ref(q, k, v)
    out = attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert_close(out, ref, rtol=3e-2, atol=3e-2)


def test_fully_masked_rows_are_zero():
    q, k, v = qkv(T=6)
    km = torch.ones(2, 6, dtype=torch.bool)
    km[0, :3] = False
    out = attention(q, k, v, key_mask=km)
    assert torch.isfinite(out).all() and out[0, :3].abs().max() == 0


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dim", [16, 8])
def test_rope_equals_rotation_matrix(interleaved, dim):
    x = torch.randn(2, 11, 3, 16)
    pos = torch.randint(0, 500, (2, 11))
    cos, sin = rope_cos_sin(pos, dim)
    assert_close(apply_rope(x, cos, sin, interleaved=interleaved),
                 apply_rope_ref(x, pos, dim, interleaved=interleaved))


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_scores_depend_only_on_offset(interleaved):
    q, k = torch.randn(1, 1, 1, 32), torch.randn(1, 1, 1, 32)

    def score(i, j):
        cq = rope_cos_sin(torch.tensor([[i]]), 32)
        ck = rope_cos_sin(torch.tensor([[j]]), 32)
        return (apply_rope(q, *cq, interleaved=interleaved) * apply_rope(k, *ck, interleaved=interleaved)).sum()
    assert_close(score(10, 3), score(107, 100), atol=1e-4)


def test_rms_norms():
    x = torch.randn(3, 5, 12)
    w = torch.randn(12)
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert_close(rms_norm(x, w), ref)
    z = torch.randn(3, 5, 12)
    g = x * torch.nn.functional.silu(z)
    parts = g.view(3, 5, 3, 4)
    ref = (parts / torch.sqrt(parts.pow(2).mean(-1, keepdim=True) + 1e-6)).view(3, 5, 12) * w
    assert_close(gated_rms_norm(x, z, w, group_size=4), ref)


@pytest.mark.parametrize("Hq,Hk,Hv", [(8, 8, 8), (8, 2, 2), (8, 1, 8), (4, 1, 1)])   # MHA, GQA, shared keys, MQA
def test_decode_attention_reads_heads_unexpanded(Hq, Hk, Hv):
    from hybridlm.ops.attention import decode_attention
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 1, Hq, 16), torch.randn(2, 37, Hk, 16), torch.randn(2, 37, Hv, 12)
    ref = attention_ref(q, k.repeat_interleave(Hq // Hk, 2), v.repeat_interleave(Hq // Hv, 2), causal=False)
    torch.testing.assert_close(decode_attention(q, k, v), ref, rtol=1e-5, atol=1e-5)
    ring = torch.randn(2, 64, Hk, 16)[:, :37]                  # a view of a larger cache buffer
    torch.testing.assert_close(decode_attention(q, ring, v), decode_attention(q, ring.clone(), v))
