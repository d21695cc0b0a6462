"""The `K` letter (Kimi Delta Attention, layers/kda.py): decode = full forward with chunked prefill, padding on either
side leaves real positions unchanged, packed documents = separate runs, strong gates, bf16, gradients, sizes refused
at config time; NoPE MLA (`L` under pos_embedding="none") in the same checks."""
import pytest
import torch

from conftest import assert_close, decode_logits, packed_logits, padded_logits
from hybridlm import CausalLM, ModelConfig
from hybridlm.errors import ConfigError
from hybridlm.layers.init import initialised
from hybridlm.layers.kda import KimiDeltaAttention

SMALL = dict(vocab_size=61, d_model=32, n_heads=2, max_seq_len=128, mlp_hidden=48)


def model(layout, **kw):
    torch.manual_seed(0)
    m = CausalLM(ModelConfig(layout=layout, **{**SMALL, **kw}))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():   # non-trivial values everywhere (norm weights and biases start at ones/zeros)
        for name, p in m.named_parameters():
            if p.dim() == 1 and not name.endswith(("A_log", "dt_bias")):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return m.eval()


LAYOUTS = {"K": dict(), "KM-heads3": dict(kda_heads=3, kda_head_dim=8, kda_rank=5),
           "KM-LM-nope": dict(pos_embedding="none", mla_q_lora_rank=0, mla_rope_dim=3)}
LAYOUT_STR = {"K": "KK", "KM-heads3": "(KM)*2", "KM-LM-nope": "KM LM"}


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_decode_equals_full_forward(case):
    m = model(LAYOUT_STR[case], **LAYOUTS[case])
    ids = torch.randint(0, 61, (2, 23))
    with torch.no_grad():
        full = m(ids).logits
        assert_close(decode_logits(m, ids, 1, 9, 16), full, atol=2e-5, msg=case)


@pytest.mark.parametrize("case", sorted(LAYOUTS))
@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_leaves_real_positions_unchanged(case, side):
    m = model(LAYOUT_STR[case], **LAYOUTS[case])
    ids = torch.randint(0, 61, (2, 17))
    with torch.no_grad():
        full = m(ids).logits
        assert_close(padded_logits(m, ids, torch.randint(0, 61, (2, 6)), side), full, atol=2e-5, msg=case)


def test_left_padded_generation_equals_single_rows():
    from conftest import assert_batch_generates_like_single
    m = model("KM LM", pos_embedding="none")
    assert_batch_generates_like_single(m, torch.randint(0, 61, (1, 12)), torch.randint(0, 61, (1, 7)), 5)


def test_packed_documents_equal_separate_runs():
    m = model("KM LM", pos_embedding="none")
    assert_close(*packed_logits(m, torch.randint(0, 61, (1, 13)), torch.randint(0, 61, (1, 10))), atol=2e-5)


def test_strong_gates_stay_finite_and_forget():
    m = model("K")
    layer = m.blocks[0].mixer
    with torch.no_grad():
        layer.A_log.fill_(6.0)            # decay exp(-e^6 · softplus(~20)): the state is forgotten every token
        layer.dt_bias.fill_(20.0)
        layer.b_proj.weight.mul_(50)      # β saturates at 0 or 1
    ids = torch.randint(0, 61, (2, 30))
    with torch.no_grad():
        full = m(ids).logits
        assert torch.isfinite(full).all()
        assert_close(decode_logits(m, ids, 11), full, atol=2e-5)
        # with the state forgotten, each position depends on the conv window only: the last 4 tokens
        last = m(ids[:, -4:]).logits[:, -1]
        assert_close(last, full[:, -1], atol=1e-4)


def test_layer_formula_one_token():
    """One token from an empty state: S = β k vᵀ, o = scale · β (q·k) v (the gate cannot act yet)."""
    torch.manual_seed(0)
    layer = initialised(KimiDeltaAttention(16, layer_idx=0, n_heads=2, head_dim=4, d_conv=2)).eval()
    from hybridlm.context import SeqContext
    x = torch.randn(1, 1, 16)
    y = layer(x, ctx=SeqContext(positions=torch.zeros(1, 1, dtype=torch.long)))
    qkv = torch.nn.functional.silu(layer.qkv(x) * layer.conv.weight[:, -1]).view(1, 1, 3, 2, 4)
    q, k, v = qkv.unbind(2)
    q = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    k = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    beta = torch.sigmoid(layer.b_proj(x))
    o = 4 ** -0.5 * beta[..., None] * (q * k).sum(-1, keepdim=True) * v
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.norm_eps) * layer.norm_weight
    o = o * torch.sigmoid(layer.g_b(layer.g_a(x)).view(1, 1, 2, 4))
    assert_close(y, layer.o_proj(o.reshape(1, 1, 8)), atol=1e-6)


def test_bf16_trains_and_state_is_float32():
    m = model("KM LM", pos_embedding="none").train()
    ids = torch.randint(0, 61, (2, 24))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = m(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    grads = {n: p.grad for n, p in m.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), \
        [n for n, g in grads.items() if g is None]
    kda = [n for n in grads if ".mixer." in n and n.startswith("blocks.0.")]
    assert all(grads[n].abs().sum() > 0 for n in kda), kda             # every KDA parameter gets a gradient
    cache = m.make_cache(2)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        m(ids[:, :20], cache=cache)
        m(ids[:, 20:21], cache=cache)
    assert cache.layers[0].state.dtype == torch.float32 and cache.layers[0].state.shape == (2, 2, 16, 16)


def test_float64_decode_and_padding_tight():
    m = model("KM LM", pos_embedding="none").double()
    ids = torch.randint(0, 61, (2, 21))
    with torch.no_grad():
        full = m(ids).logits
        assert full.dtype == torch.float64
        assert_close(decode_logits(m, ids, 7), full, atol=1e-10, rtol=1e-10)
        assert_close(padded_logits(m, ids, torch.randint(0, 61, (2, 4))), full, atol=1e-10, rtol=1e-10)


def test_bfloat16_weights_close_to_float32():
    m = model("KM")
    ids = torch.randint(0, 61, (2, 19))
    with torch.no_grad():
        ref = m(ids).logits
        got = m.to(torch.bfloat16)(ids).logits.float()
    assert torch.isfinite(got).all()
    assert_close(got, ref, atol=2e-2, rtol=0)             # 5.6e-3 seen (logits up to 0.68)


def test_impossible_sizes_fail_at_config_time():
    with pytest.raises(ConfigError, match="kda_heads"):
        ModelConfig(layout="KM", **{**SMALL, "n_heads": 3})               # 32 not divisible by 3 heads
    with pytest.raises(ConfigError, match="kda_heads must be >= 1"):
        ModelConfig(layout="KM", kda_heads=0, **SMALL)
    with pytest.raises(ConfigError, match="d_conv"):
        ModelConfig(layout="KM", d_conv=0, **SMALL)
    with pytest.raises(ConfigError, match="kda_rank"):
        ModelConfig(layout="KM", kda_rank=-1, **SMALL)
    with pytest.raises(ConfigError, match="mla_rope_dim"):
        ModelConfig(layout="LM", mla_rope_dim=3, **SMALL)                 # rotated: must be even
    ModelConfig(layout="KM", n_heads=3, kda_head_dim=8, **{k: v for k, v in SMALL.items() if k != "n_heads"})
    ModelConfig(layout="LM", mla_rope_dim=3, pos_embedding="none", **SMALL)   # NoPE: any size


def test_cache_bytes_constant_in_context():
    m = model("KM")
    c = m.make_cache(1)
    with torch.no_grad():
        m(torch.randint(0, 61, (1, 8)), cache=c)
        n8 = c.nbytes
        m(torch.randint(0, 61, (1, 30)), cache=c)
    assert c.nbytes == n8 == 2 * 16 * 16 * 4 + 3 * 96 * 4       # float32 state + conv tail (3 taps of 3·H·D)
