"""Letter G (Gated DeltaNet, Qwen3-Next's linear attention) and the attention output gate: the layer equals the
token recurrence written out, decode equals the full forward (with chunked prefill), padding leaves real positions
unchanged, packed documents equal separate runs, impossible sizes fail at config time."""
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close, assert_trains, decode_logits, packed_logits, padded_logits

from hybridlm import CausalLM, ModelConfig, presets
from hybridlm.context import SeqContext
from hybridlm.errors import ConfigError
from hybridlm.layers.gated_deltanet import GatedDeltaNet
from hybridlm.layers.init import initialised
from hybridlm.ops.delta_rule import delta_rule_recurrent

SMALL = dict(d_model=64, vocab_size=61, n_heads=4, head_dim=16, gdn_chunk_size=8)
CASES = {
    "one-group": dict(layout="(GM)*2", gdn_k_heads=2, gdn_k_dim=16),
    "groups": dict(layout="GM GO AM", gdn_k_heads=2, gdn_v_heads=4, gdn_k_dim=16, gdn_v_dim=8, moe_experts=4,
                   n_kv_heads=2, qk_norm=True, rope_dim=8, attn_output_gate=True),
    "mqa-gate": dict(layout="G A", gdn_k_heads=1, gdn_v_heads=3, n_kv_heads=1, attn_output_gate=True),
}


def model(case, **kw):
    torch.manual_seed(0)
    return CausalLM(ModelConfig(**{**SMALL, **CASES[case], **kw})).eval()


def test_layer_equals_written_out_recurrence():
    torch.manual_seed(0)
    layer = initialised(GatedDeltaNet(32, layer_idx=0, k_heads=2, v_heads=4, k_dim=8, v_dim=4, d_conv=3, chunk_size=4))
    x = torch.randn(2, 11, 32)
    ctx = SeqContext(positions=torch.arange(11).expand(2, 11))
    with torch.no_grad():
        y = layer(x, ctx=ctx)
        # by hand: projections per key head, conv over [q; k; v], silu, l2norm, groups, delta rule, gated norm
        qkvz = layer.in_proj_qkvz(x).view(2, 11, 2, -1)
        q, k, v, z = qkvz.split((8, 8, 8, 8), -1)
        b, a = layer.in_proj_ba(x).view(2, 11, 2, 4).split((2, 2), -1)
        u = torch.cat((q.flatten(2), k.flatten(2), v.flatten(2)), -1).transpose(1, 2)
        u = F.silu(F.conv1d(F.pad(u, (2, 0)), layer.conv.weight.unsqueeze(1), groups=u.shape[1])).transpose(1, 2)
        q, k, v = u.split((16, 16, 16), -1)
        q, k = (F.normalize(t.reshape(2, 11, 2, 8), dim=-1).repeat_interleave(2, 2) for t in (q, k))
        g = -layer.A_log.exp() * F.softplus(a.reshape(2, 11, 4) + layer.dt_bias)
        o, _ = delta_rule_recurrent(q, k, v.reshape(2, 11, 4, 4), torch.sigmoid(b.reshape(2, 11, 4)), g)
        o = F.rms_norm(o, (4,), layer.norm_weight, 1e-6) * F.silu(z.reshape(2, 11, 4, 4))
        ref = layer.out_proj(o.flatten(2))
    assert_close(y, ref, 1e-4, 1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_equals_forward(case):
    m = model(case)
    ids = torch.randint(0, 61, (2, 21))
    with torch.no_grad():
        full = m(ids).logits
        assert_close(decode_logits(m, ids, 5, 14), full, 1e-4, 1e-4)
        assert_close(decode_logits(m, ids, 9), full, 1e-4, 1e-4)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_leaves_real_positions(case, side):
    m = model(case)
    ids, pad = torch.randint(0, 61, (2, 17)), torch.randint(0, 61, (2, 5))
    with torch.no_grad():
        assert_close(padded_logits(m, ids, pad, side), m(ids).logits, 1e-4, 1e-4)


def test_left_padded_generation_equals_single():
    from conftest import assert_batch_generates_like_single
    m = model("groups")
    assert_batch_generates_like_single(m, torch.randint(0, 61, (1, 13)), torch.randint(0, 61, (1, 6)), 5)


@pytest.mark.parametrize("case", ["one-group", "groups"])
def test_packed_documents_equal_separate_runs(case):
    m = model(case)
    assert_close(*packed_logits(m, torch.randint(0, 61, (1, 10)), torch.randint(0, 61, (1, 13))), 1e-4, 1e-4)


def test_chunk_size_does_not_change_the_function():
    ids = torch.randint(0, 61, (2, 40))
    with torch.no_grad():
        ref = model("groups", gdn_chunk_size=64)(ids).logits
        assert_close(model("groups", gdn_chunk_size=5)(ids).logits, ref, 1e-4, 1e-4)


def test_output_gate_is_sigmoid_of_the_q_rows():
    """With the gate rows of qkv zeroed, sigmoid(0) = 1/2 halves the attention output of an ungated layer."""
    torch.manual_seed(0)
    gated = CausalLM(ModelConfig(**SMALL, layout="A", attn_output_gate=True)).eval()
    plain = CausalLM(ModelConfig(**SMALL, layout="A")).eval()
    H, D = 4, 16
    with torch.no_grad():
        w = gated.blocks[0].mixer.qkv.weight
        w[: 2 * H * D].view(H, 2, D, -1)[:, 1] = 0
        sd = gated.state_dict()
        q = w[: 2 * H * D].view(H, 2, D, -1)[:, 0].reshape(H * D, -1)
        sd_plain = {**sd, "blocks.0.mixer.qkv.weight": torch.cat([q, w[2 * H * D:]])}
        sd_plain["blocks.0.mixer.out.weight"] = sd["blocks.0.mixer.out.weight"] / 2
        plain.load_state_dict(sd_plain)
        ids = torch.randint(0, 61, (1, 9))
        assert_close(gated(ids).logits, plain(ids).logits, 1e-5, 1e-5)


def test_trains():
    m = model("groups")
    assert_trains(m, torch.randint(0, 61, (2, 24)), 12, 0.3)


def test_impossible_sizes_fail_at_config_time():
    with pytest.raises(ConfigError, match="gdn_v_heads .* multiple of gdn_k_heads"):
        ModelConfig(**SMALL, layout="GM", gdn_k_heads=2, gdn_v_heads=3)
    with pytest.raises(ConfigError, match="d_conv"):
        ModelConfig(**SMALL, layout="GM", d_conv=0)
    with pytest.raises(ConfigError, match="gdn_k_dim"):
        ModelConfig(**SMALL, layout="GM", gdn_k_dim=0)
    with pytest.raises(ConfigError, match="attn_output_gate"):
        ModelConfig(**SMALL, layout="AM", attn_output_gate=True, wm_dyn_mask="dt")


def test_preset_builds_and_decodes():
    cfg = presets.get("qwen3-next", n_layers=4, d_model=128, vocab_size=61)
    assert cfg.layout == "(GO)*3 AO" and cfg.rope_dim == 16 and cfg.gdn_v_heads == 2
    torch.manual_seed(0)
    m = CausalLM(cfg.replace(gdn_chunk_size=8)).eval()
    ids = torch.randint(0, 61, (1, 19))
    with torch.no_grad():
        assert_close(decode_logits(m, ids, 11), m(ids).logits, 1e-4, 1e-4)


def test_bfloat16_model_is_close_and_keeps_a_float32_state():
    m = model("groups")
    ids = torch.randint(0, 61, (2, 19))
    with torch.no_grad():
        ref = m(ids).logits
        m16 = m.to(torch.bfloat16)
        cache = m16.make_cache(2)
        got = m16(ids, cache=cache).logits
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert cache.layers[0].state.dtype == torch.float32
    assert_close(got.float(), ref, 0.05, 0.1)
