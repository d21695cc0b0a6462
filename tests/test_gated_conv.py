"""The gated short convolution `C` (LFM2): the layer equals an explicit reference (forward and gradients, float64
tight, float32, bf16 loose), decodes like its full forward (chunked prefill, odd lengths), ignores padding, stops at
document resets, and refuses impossible sizes at config time."""
import pytest
import torch

from conftest import assert_close, decode_logits, packed_logits, padded_logits
from hybridlm.context import SeqContext
from hybridlm.errors import ConfigError
from hybridlm.layers.gated_conv import GatedShortConv
from hybridlm.layers.init import initialised
from hybridlm.models import CausalLM, ModelConfig
from hybridlm.ops.conv import causal_conv1d_ref


def reference(m: GatedShortConv, x):
    """out(c ⊙ conv(b ⊙ h)) with the conv as an explicit sum over taps."""
    d = m.d_model
    p = x @ m.in_proj.weight.t() + (m.in_proj.bias if m.in_proj.bias is not None else 0)
    b, c, h = p[..., :d], p[..., d:2 * d], p[..., 2 * d:]
    u = causal_conv1d_ref(b * h, m.conv.weight, m.conv.bias)
    return m.out_proj(c * u)


def ctx_for(B, T):
    return SeqContext(positions=torch.arange(T).expand(B, T), pad_mask=None, key_mask=None, resets=None,
                      segment_ids=None)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("T", [1, 2, 3, 4, 17])
def test_layer_equals_reference(dtype, tol, T):
    m = initialised(GatedShortConv(24, layer_idx=0, kernel=3, bias=True)).to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(2, T, 24, dtype=dtype, requires_grad=True)
    y, ref = m(x, ctx=ctx_for(2, T)), reference(m, x)
    assert_close(y.float(), ref.float(), atol=tol, rtol=tol)
    if dtype != torch.bfloat16:
        g = torch.randn_like(y)
        got = torch.autograd.grad(y, [x, m.conv.weight, m.in_proj.weight], g)
        want = torch.autograd.grad(ref, [x, m.conv.weight, m.in_proj.weight], g)
        for a, b in zip(got, want):
            assert_close(a, b, atol=tol, rtol=tol)


def small(**kw):
    kw = dict(layout="(CM)*2 AM C", vocab_size=61, d_model=32, n_heads=4, n_kv_heads=2, qk_norm=True, max_seq_len=64,
              **kw)
    return CausalLM(ModelConfig(**kw)).eval()


@pytest.mark.parametrize("kernel", [1, 3, 4])
def test_decode_equals_full_forward(kernel):
    m = small(d_conv=kernel, conv_bias=True)
    ids = torch.randint(0, 61, (2, 13))
    with torch.no_grad():
        full = m(ids).logits
        assert_close(decode_logits(m, ids, 1), full, atol=1e-4)
        assert_close(decode_logits(m, ids, 2, 7), full, atol=1e-4)   # chunks shorter than the tail, then longer


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_leaves_real_positions(side):
    m = small(conv_bias=True)
    ids, pad = torch.randint(0, 61, (2, 11)), torch.randint(0, 61, (2, 4))
    with torch.no_grad():
        assert_close(padded_logits(m, ids, pad, side), m(ids).logits, atol=1e-4)


def test_resets_equal_separate_runs():
    m = small()
    assert_close(*packed_logits(m, torch.randint(0, 61, (1, 5)), torch.randint(0, 61, (1, 8))), atol=1e-4)


def test_cache_holds_only_the_conv_tail():
    m = small(d_conv=3)                                # LFM2's kernel: a tail of 2 inputs
    cache = m.make_cache(1)
    with torch.no_grad():
        m(torch.randint(0, 61, (1, 9)), cache=cache)
    slot = cache.layers[0]
    assert slot.state is None and slot.conv.shape == (1, 2, 32)


def test_impossible_sizes_fail_at_config_time():
    with pytest.raises(ConfigError, match="d_conv"):
        ModelConfig(layout="CM", d_model=32, d_conv=0)
    with pytest.raises(ConfigError, match="d_conv"):
        ModelConfig(layout="AM C", d_model=32, n_heads=2, layer_overrides={2: {"conv_kernel": 0}})
