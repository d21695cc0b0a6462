"""Cross-check against transformers' MambaForCausalLM, FalconMambaForCausalLM and JambaForCausalLM (every parameter
perturbed first): logits within 1e-4 (float32) with and without left padding, greedy generations token-identical,
transformers-format directories converted by `hybridlm convert --from-hf`, the preset twins, refused options."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from hybridlm.errors import ConfigError  # noqa: E402
from hybridlm.hf import config_from_transformers, to_state_dict  # noqa: E402
from hf_checks import (assert_directory_converts, assert_greedy_matches, assert_left_padding_matches,  # noqa: E402
                       assert_logits_match, assert_twin_is_preset, max_diff)

V = 61
NO_SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def perturb(model):
    """Random values everywhere: norms and D around 1, A_log around its S4D init, the rest around 0."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("A_log"):
                p.add_(0.3 * noise)
            elif p.dim() == 1 and (name.endswith(".D") or "norm" in name):
                p.copy_(1.0 + 0.3 * noise)
            else:
                p.copy_((0.3 if p.dim() == 1 else 0.15) * noise)
    return model.eval()


def mamba(falcon=False, **kw):
    kw = {"vocab_size": V, "hidden_size": 32, "num_hidden_layers": 2, "state_size": 8, **NO_SPECIAL, **kw}
    torch.manual_seed(0)
    if falcon:
        return perturb(transformers.FalconMambaForCausalLM(transformers.FalconMambaConfig(**kw)))
    return perturb(transformers.MambaForCausalLM(transformers.MambaConfig(**kw)))


def jamba(**kw):
    kw = {"vocab_size": V, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "attn_layer_period": 2, "attn_layer_offset": 1,
          "expert_layer_period": 2, "expert_layer_offset": 0, "num_experts": 4, "num_experts_per_tok": 2,
          "mamba_d_state": 8, "mamba_dt_rank": 3, **NO_SPECIAL, **kw}
    torch.manual_seed(0)
    return perturb(transformers.JambaForCausalLM(transformers.JambaConfig(**kw)))


CASES = {
    "mamba": lambda: mamba(),
    "mamba-bias-untied-k3": lambda: mamba(use_bias=True, use_conv_bias=False, tie_word_embeddings=False,
                                          conv_kernel=3, expand=3, time_step_rank=5),
    "falcon-mamba": lambda: mamba(falcon=True, mixer_rms_eps=1e-3),
    "jamba-moe-gqa": lambda: jamba(),
    "jamba-dense-mqa": lambda: jamba(num_experts=1, num_key_value_heads=1),
    "jamba-moe-top1-8-layers": lambda: jamba(num_hidden_layers=8, attn_layer_period=4, attn_layer_offset=3,
                                             num_experts=3, num_experts_per_tok=1, mamba_proj_bias=True,
                                             tie_word_embeddings=True),
}
LAYOUTS = {"mamba": "B*2", "mamba-bias-untied-k3": "B*2", "falcon-mamba": "B*2", "jamba-moe-gqa": "(BO AM)*2",
           "jamba-dense-mqa": "(BM AM)*2", "jamba-moe-top1-8-layers": "(BO BM BO AM)*2"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match(case):
    ours = assert_logits_match(CASES[case](), T=23)
    assert ours.config.layout == LAYOUTS[case]


@pytest.mark.parametrize("case", ["mamba", "falcon-mamba", "jamba-moe-gqa"])
def test_left_padding_matches(case):
    """transformers zeroes padded inputs before in_proj and after the conv; without in_proj biases its padded
    positions then leave no trace, as ours do (dt = 0 there)."""
    ours, x, got = assert_left_padding_matches(CASES[case](), positions=False)
    with torch.no_grad():
        assert max_diff(got[2, 9:], ours(x[2:, 9:]).logits[0]) <= 1e-4


@pytest.mark.parametrize("case", ["mamba", "falcon-mamba", "jamba-moe-gqa"])
def test_greedy_generate_matches(case):
    assert_greedy_matches(CASES[case](), T=9)


def test_config_mapping():
    cfg, sd = to_state_dict(CASES["jamba-moe-gqa"]())
    assert cfg.pos_embedding == "none" and cfg.kv_heads == 2 and cfg.mamba1_bcdt_norm == "weight"
    assert cfg.moe_experts == 4 and cfg.moe_topk == 2 and not cfg.moe_norm_topk and cfg.moe_router == "softmax"
    assert sd["blocks.1.mixer.w_gate"].shape == (4, 32, 48) and sd["blocks.1.mixer.w_down"].shape == (4, 48, 32)
    assert sd["blocks.0.mixer.dt_norm"].shape == (3,) and sd["blocks.0.mixer.conv.weight"].shape == (64, 4)
    falcon = config_from_transformers(CASES["falcon-mamba"]().config)
    assert falcon.mamba1_bcdt_norm == "plain" and falcon.mamba1_norm_eps == 1e-3
    assert config_from_transformers(jamba(num_hidden_layers=32, attn_layer_period=8, attn_layer_offset=4,
                                          expert_layer_period=2, expert_layer_offset=1).config
                                    ).layout == "(BM BO BM BO AM BO BM BO)*4"        # Jamba-v0.1's plan
    assert config_from_transformers(jamba(num_hidden_layers=5).config).layout == "(BO AM)*2 BO"


@pytest.mark.parametrize("case", ["mamba-bias-untied-k3", "falcon-mamba", "jamba-moe-gqa"])
def test_convert_directory(case, tmp_path):
    assert_directory_converts(CASES[case](), tmp_path)


@pytest.mark.parametrize("name", ["mamba", "jamba"])
def test_twins_equal_presets(name):
    assert_twin_is_preset(name, 64, 2, vocab_size=100, max_seq_len=256)


def _with(cfg, **attrs):
    for k, v in attrs.items():
        setattr(cfg, k, v)
    return cfg


@pytest.mark.parametrize("make,match", [
    (lambda: transformers.MambaConfig(hidden_size=32, hidden_act="gelu"), r"hidden_act \(conv\) activation 'gelu'"),
    (lambda: transformers.MambaConfig(hidden_size=32, hidden_act="relu2"), "activation 'relu2'"),   # our conv: SiLU
    (lambda: transformers.JambaConfig(hidden_size=32, num_attention_heads=4, hidden_act="relu2"), "activation 'relu2'"),
    (lambda: _with(transformers.MambaConfig(hidden_size=32), intermediate_size=48), "intermediate size 48"),
    (lambda: transformers.JambaConfig(hidden_size=32, num_attention_heads=4, attention_dropout=0.1),
     "attention_dropout"),
    (lambda: transformers.JambaConfig(hidden_size=32, num_attention_heads=4, hidden_act="gelu"), "activation 'gelu'"),
])
def test_refused_options_name_the_option(make, match):
    with pytest.raises(ConfigError, match=match):
        config_from_transformers(make())
