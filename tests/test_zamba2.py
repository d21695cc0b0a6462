"""Zamba2: the `Z` letter (shared transformer over concat(stream, embeddings) feeding the next letter) and the
converter from transformers' Zamba2ForCausalLM (logits within 1e-4 on perturbed random weights, padding, greedy
generate, the directory conversion, the preset's twin, refused options)."""
import pytest
import torch

from conftest import assert_close, decode_logits, packed_logits, padded_logits
from hybridlm import CausalLM
from hybridlm.errors import ConfigError
from hybridlm.models import ModelConfig

V = 61
SMALL = dict(d_model=32, n_heads=4, vocab_size=V, ssd_headdim=16, ssd_d_state=8, ssd_chunk_size=8, mlp_hidden=48,
             mlp_act="gelu", max_seq_len=128, norm_eps=1e-5, zamba_adapter_rank=4, ssd_dt_limit=(1e-3, float("inf")))


def zmodel(layout="S Z@0 S*2 Z@1 S Z@0 S", **kw):
    torch.manual_seed(0)
    m = CausalLM(ModelConfig(layout=layout, **{**SMALL, **kw}))
    with torch.no_grad():                                   # the output projection and adapters start non-trivial
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m.eval()


LETTER_CASES = {"rope-adapters": dict(zamba_attn_adapter=True), "nope-gqa": dict(pos_embedding="none", n_kv_heads=2)}


@pytest.mark.parametrize("case", sorted(LETTER_CASES))
def test_decode_equals_forward(case):
    m = zmodel(**LETTER_CASES[case])
    ids = torch.randint(0, V, (2, 19))
    with torch.no_grad():
        assert_close(decode_logits(m, ids, 7, 9), m(ids).logits, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_leaves_real_positions(side):
    m = zmodel(zamba_attn_adapter=True)
    ids, pad = torch.randint(0, V, (2, 13)), torch.randint(0, V, (2, 5))
    with torch.no_grad():
        assert_close(padded_logits(m, ids, pad, side), m(ids).logits, atol=2e-5, rtol=1e-5)


def test_resets_equal_separate_runs():
    m = zmodel(zamba_attn_adapter=True)
    assert_close(*packed_logits(m, torch.randint(0, V, (1, 9)), torch.randint(0, V, (1, 12))), atol=2e-5)


def test_sharing_and_per_occurrence_parts():
    m = zmodel(zamba_attn_adapter=True)
    z0, z1, z2 = (b.feed for b in m.blocks if hasattr(b, "feed"))
    assert z0.qkv.weight is z2.qkv.weight and z0.norm_in.weight is z2.norm_in.weight and z0.w_in.weight is z2.w_in.weight
    assert z0.qkv.weight is not z1.qkv.weight
    assert z0.proj.weight is not z2.proj.weight and z0.mlp_adapter.down.weight is not z2.mlp_adapter.down.weight
    assert z0.qkv_adapters[0].up.weight is not z2.qkv_adapters[0].up.weight
    assert (z0.layer_idx, z2.layer_idx) == (1, 6)             # own cache slots


def test_z_with_a_zero_output_projection_is_absent():
    """A Z whose output projection is zero leaves the model as if it were absent (that its output feeds the next
    layer's input, not the stream, is what test_logits_match checks against transformers' Zamba2)."""
    m = zmodel()
    plain = CausalLM(ModelConfig(layout="S S S S S", **SMALL)).eval()
    ours = {k: v for k, v in m.state_dict().items() if ".feed." not in k}
    plain.load_state_dict({k.replace(".block.", "."): v for k, v in ours.items()})
    ids = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        for b in m.blocks:
            if hasattr(b, "feed"):
                b.feed.proj.weight.zero_()
        assert_close(m(ids).logits, plain(ids).logits, atol=1e-6)


@pytest.mark.parametrize("layout, kw, msg", [
    ("S Z", {}, "each Z must be followed by a letter"),
    ("S Z Z S", {}, "each Z must be followed by a letter"),
    ("S Z [RWM]", {}, "each Z must be followed by a letter"),
    ("{ZS}M", {}, "Z cannot sit inside a block"),
    ("[ZWM] S", {}, "Z cannot sit inside a block"),
    ("Z S", dict(n_heads=5), "2·d_model"),
    ("Z S", dict(zamba_adapter_rank=0, zamba_attn_adapter=True), "zamba_attn_adapter needs zamba_adapter_rank"),
    ("Z S", dict(pos_embedding="learned"), "pos_embedding"),
])
def test_impossible_configs_fail_at_config_time(layout, kw, msg):
    with pytest.raises(ConfigError, match=msg):
        ModelConfig(layout=layout, **{**SMALL, **kw})


# --- transformers ------------------------------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")
from hybridlm.hf import config_from_transformers  # noqa: E402
from hf_checks import (assert_directory_converts, assert_greedy_matches, assert_left_padding_matches,  # noqa: E402
                       assert_logits_match, assert_twin_is_preset)


def zamba2(tie=True, types=("mamba", "hybrid", "mamba", "hybrid", "hybrid"), **kw):
    base = dict(vocab_size=V, hidden_size=32, num_hidden_layers=len(types), layers_block_type=list(types),
                mamba_d_state=8, n_mamba_heads=4, num_attention_heads=4, num_mem_blocks=2,
                use_shared_attention_adapter=True, adapter_rank=4, intermediate_size=48, chunk_size=8,
                use_mem_rope=True, tie_word_embeddings=tie, max_position_embeddings=128,
                rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                pad_token_id=None, bos_token_id=None, eos_token_id=None)
    base.update(kw)
    torch.manual_seed(0)
    m = transformers.Zamba2ForCausalLM(transformers.Zamba2Config(**base))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():                        # noise on every parameter (norms are ones, D ones, A_log arange)
        for p in m.parameters():
            p.add_((0.3 if p.dim() == 1 else 0.1) * torch.randn(p.shape, generator=g))
    return m.eval()


CASES = {
    "tied-2blocks-adapters-rope": dict(),
    "untied-1block": dict(tie=False, num_mem_blocks=1),
    "gqa-norope-noattnadapter-bias": dict(num_key_value_heads=2, use_shared_attention_adapter=False,
                                          use_mem_rope=False, add_bias_linear=True),
    "groups-silu-3blocks": dict(mamba_ngroups=2, hidden_act="silu", num_mem_blocks=3,
                                types=("hybrid", "mamba", "hybrid", "hybrid", "mamba", "hybrid")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match(case):
    assert_logits_match(zamba2(**CASES[case]))


def test_layouts():
    assert config_from_transformers(zamba2().config).layout == "S Z@0 S*2 Z@1 S Z@0 S"
    assert config_from_transformers(zamba2(tie=False).config).layout == "(SZS)*2 ZS"
    assert config_from_transformers(transformers.Zamba2Config()).layout == \
        "(S*6 Z@0)*7 S*5 Z@0 S*4 Z@0 S*3"


def test_left_padding_matches():
    assert_left_padding_matches(zamba2())


def test_greedy_generate_matches():
    assert_greedy_matches(zamba2(), n=8)


def test_directory_conversion_and_info(tmp_path, capsys):
    ours = assert_directory_converts(zamba2(), tmp_path, capsys, "S Z@0 S*2 Z@1 S Z@0 S")
    z = [b.feed for b in ours.blocks if hasattr(b, "feed")]
    assert z[0].qkv.weight is z[2].qkv.weight                 # the shared block is one tensor again


def test_twin_is_the_preset():
    for d, n in ((64, 12), (128, 7)):
        assert_twin_is_preset("zamba2", d, n)


@pytest.mark.parametrize("kw, msg", [
    (dict(use_long_context=True), "use_long_context"),
    (dict(attention_dropout=0.1), "attention_dropout"),
    (dict(hidden_act="gelu_new"), "hidden_act 'gelu_new'"),
    (dict(rms_norm_eps=1e-6), "rms_norm_eps"),
    (dict(num_key_value_heads=2), "use_shared_attention_adapter with num_key_value_heads"),
    (dict(use_mem_rope=True, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
     "rope_type 'linear'"),
])
def test_refused_options_are_named(kw, msg):
    base = dict(vocab_size=V, hidden_size=32, num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "mamba"],
                n_mamba_heads=4, num_attention_heads=4, use_shared_attention_adapter=True, adapter_rank=4)
    with pytest.raises(ConfigError, match=msg):
        config_from_transformers(transformers.Zamba2Config(**{**base, **kw}))


def test_mamba_headdim_other_than_the_split_is_refused():
    cfg = transformers.Zamba2Config(vocab_size=V, hidden_size=32, num_hidden_layers=2, n_mamba_heads=4,
                                    layers_block_type=["mamba", "hybrid"], num_attention_heads=4)
    cfg.mamba_headdim = 8                                  # transformers' mixer would use it; ours splits d_inner
    with pytest.raises(ConfigError, match="mamba_headdim 8"):
        config_from_transformers(cfg)
