"""Cross-check against transformers' Lfm2ForCausalLM: converted to C/A layers with SwiGLU, it gives the same logits
(float32, 1e-4) with GQA, MQA, conv biases, tied and untied embeddings and the auto-adjusted MLP width; with left
padding; the same greedy generations; from a saved directory; the preset equals its transformers twin."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from hybridlm.errors import ConfigError  # noqa: E402
from hybridlm.hf import to_state_dict  # noqa: E402
from hybridlm.hf.convert import config_from_transformers  # noqa: E402
from hf_checks import (assert_directory_converts, assert_greedy_matches, assert_left_padding_matches,  # noqa: E402
                       assert_logits_match, assert_twin_is_preset)

VOCAB = 97
TYPES = ["conv", "full_attention", "conv", "conv", "full_attention"]


def lfm2(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=len(TYPES),
                num_attention_heads=4, num_key_value_heads=2, layer_types=TYPES, block_multiple_of=32,
                block_ffn_dim_multiplier=1.5, max_position_embeddings=256, conv_L_cache=3,
                rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                pad_token_id=None, bos_token_id=None, eos_token_id=None)
    base.update(kw)
    torch.manual_seed(0)
    model = transformers.Lfm2ForCausalLM(transformers.Lfm2Config(**base))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every parameter perturbed (norm weights start at ones)
        for _, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g) if p.dim() == 1
                    else 0.15 * torch.randn(p.shape, generator=g))
    return model.eval()


CASES = {
    "gqa-tied": dict(),
    "mqa-untied-bias": dict(num_key_value_heads=1, tie_word_embeddings=False, conv_bias=True),
    "mha-kernel4-plain-ffn": dict(num_key_value_heads=4, conv_L_cache=4, block_auto_adjust_ff_dim=False),
}


def max_diff(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match(case):
    assert_logits_match(lfm2(**CASES[case]), T=19)


def test_left_padding():
    assert_left_padding_matches(lfm2(), T=15)


def test_greedy_generate_matches():
    assert_greedy_matches(lfm2(), T=10)


def test_config_mapping():
    cfg, sd = to_state_dict(lfm2())
    assert cfg.layout == "CM AM (CM)*2 AM" and cfg.d_conv == 3 and cfg.qk_norm and cfg.tie_embeddings
    assert cfg.mlp_hidden_size == 160          # int(2/3·160) = 106, ×1.5 = 159, rounded up to 32
    assert sd["blocks.0.mixer.conv.weight"].shape == (64, 3) and sd["blocks.0.mixer.in_proj.weight"].shape == (192, 64)
    assert to_state_dict(lfm2(block_ffn_dim_multiplier=1.0))[0].mlp_hidden_size == 128     # 106 rounded up


def test_refused_options_name_themselves():
    cfg = transformers.Lfm2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                  layer_types=["conv", "sliding_attention"])
    with pytest.raises(ConfigError, match="layer type 'sliding_attention'"):
        config_from_transformers(cfg)
    cfg = transformers.Lfm2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                  rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(ConfigError, match="rope_type"):
        config_from_transformers(cfg)


def test_directory_conversion_and_info(tmp_path, capsys):
    assert_directory_converts(lfm2(), tmp_path, capsys, "CM AM (CM)*2 AM  (10 layers: 2 A, 3 C, 5 M)")


@pytest.mark.parametrize("d,n", [(128, 7), (256, 6), (64, 1)])
def test_preset_equals_its_twin(d, n):
    assert_twin_is_preset("lfm2", d, n)