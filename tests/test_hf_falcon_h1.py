"""Cross-check against transformers' FalconH1ForCausalLM: converted to "({AS}M)*n" with every muP multiplier folded
into the weights, it gives the same logits (float32, 1e-4) for each SSD output form (no norm, norm then gate, gate
then norm), GQA, several SSD groups, biases, tied embeddings; with left padding; the same greedy generations; from a
saved directory; the preset equals its transformers twin; options we cannot mirror are refused by name."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from hybridlm.errors import ConfigError  # noqa: E402
from hybridlm.hf import to_state_dict  # noqa: E402
from hybridlm.hf.convert import config_from_transformers  # noqa: E402
from hf_checks import (assert_directory_converts, assert_greedy_matches, assert_left_padding_matches,  # noqa: E402
                       assert_logits_match, assert_twin_is_preset)

VOCAB = 97
MULTIPLIERS = dict(embedding_multiplier=1.7, lm_head_multiplier=0.6, mlp_multipliers=[0.8, 1.3], key_multiplier=0.7,
                   attention_in_multiplier=1.2, attention_out_multiplier=0.9, ssm_in_multiplier=1.1,
                   ssm_out_multiplier=0.8, ssm_multipliers=[0.5, 1.5, 0.75, 1.25, 0.9])


def falcon(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, mamba_d_ssm=96, mamba_n_heads=6, mamba_d_head=16,
                mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=8,
                rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                pad_token_id=None, bos_token_id=None, eos_token_id=None, **MULTIPLIERS)
    base.update(kw)
    torch.manual_seed(0)
    model = transformers.FalconH1ForCausalLM(transformers.FalconH1Config(**base))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every parameter perturbed: ones/zeros inits (norms, D, dt_bias, biases) hide mapping bugs
        for _, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g) if p.dim() == 1
                    else 0.15 * torch.randn(p.shape, generator=g))
    return model.eval()


CASES = {
    "gate-only-gqa-groups": dict(),
    "norm-then-gate": dict(mamba_rms_norm=True, mamba_norm_before_gate=True),
    "gate-then-norm-mha": dict(mamba_rms_norm=True, mamba_norm_before_gate=False, num_key_value_heads=4),
    "biases-tied-mqa": dict(tie_word_embeddings=True, attention_bias=True, mamba_proj_bias=True, mlp_bias=True,
                            num_key_value_heads=1),
    "out-bias-only-one-group": dict(projectors_bias=True, mamba_n_groups=1, mamba_conv_bias=False),
}


def max_diff(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match(case):
    assert_logits_match(falcon(**CASES[case]))


def test_left_padding():
    assert_left_padding_matches(falcon(), pads=(5, 0, 9))


def test_greedy_generate_matches():
    assert_greedy_matches(falcon(mamba_rms_norm=True))


def test_config_mapping_and_multipliers_folded():
    hf = falcon(tie_word_embeddings=True)
    cfg, sd = to_state_dict(hf)
    assert cfg.layout == "({AS}M)*2" and cfg.ssd_d_inner == 96 and cfg.ssd_headdim == 16 and cfg.ssd_ngroups == 2
    assert cfg.ssd_norm == "gate" and cfg.kv_heads == 2 and cfg.embed_scale == pytest.approx(1.7 / 0.6)
    w = hf.state_dict()
    assert torch.allclose(sd["blocks.1.mixer.w_out.weight"], w["model.layers.0.feed_forward.down_proj.weight"] * 1.3)
    k = sd["blocks.0.mixer.0.qkv.weight"][64:96]
    assert torch.allclose(k, w["model.layers.0.self_attn.k_proj.weight"] * (1.2 * 0.7))
    dt = sd["blocks.0.mixer.1.in_proj.weight"][-6:]
    assert torch.allclose(dt, w["model.layers.0.mamba.in_proj.weight"][-6:] * (1.1 * 0.9))


def test_refused_options_name_themselves():
    for kw, what in [(dict(time_step_limit=(0.0, 10.0)), "time_step_limit"),
                     (dict(hidden_act="gelu"), "activation 'gelu'"),
                     (dict(hidden_act="relu2"), "activation 'relu2'"),        # the conv follows hidden_act: SiLU only
                     (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}), "rope_type")]:
        cfg = transformers.FalconH1Config(**{**dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                                    mamba_d_ssm=128, mamba_n_heads=8), **kw})
        with pytest.raises(ConfigError, match=what):
            config_from_transformers(cfg)


def test_directory_conversion_and_info(tmp_path, capsys):
    assert_directory_converts(falcon(), tmp_path, capsys, "({AS}M)*2  (6 layers: 2 A, 2 M, 2 S)")


@pytest.mark.parametrize("d,n", [(128, 2), (256, 3), (96, 1)])
def test_preset_equals_its_twin(d, n):
    assert_twin_is_preset("falcon-h1", d, n)