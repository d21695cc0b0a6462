"""Cross-check against transformers' KimiLinearForCausalLM: small random models (every parameter and the router's
correction bias perturbed) converted with `from_transformers` give the same logits (float32, 1e-4), with left padding
too, and the same greedy generations; the directory conversion, `info`, the preset's twin and refused options."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from hybridlm.errors import ConfigError  # noqa: E402
from hybridlm.hf import to_state_dict  # noqa: E402
from hybridlm.hf.convert import config_from_transformers  # noqa: E402
from hf_checks import (assert_directory_converts, assert_greedy_matches, assert_left_padding_matches,  # noqa: E402
                       assert_logits_match, assert_twin_is_preset)

VOCAB = 97
KKKL = ["linear_attention"] * 3 + ["full_attention"]
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
              v_head_dim=12, linear_head_dim=16, linear_num_heads=4, layer_types=KKKL,
              mlp_layer_types=["dense"] * 4, moe_intermediate_size=24, num_local_experts=8, num_experts_per_tok=2,
              max_position_embeddings=256, pad_token_id=None, bos_token_id=None, eos_token_id=None)
MOE = dict(mlp_layer_types=["dense"] + ["sparse"] * 3)


def kimi(**kw):
    torch.manual_seed(0)
    model = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**{**COMMON, **kw}))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():   # random values everywhere: norms start at ones, A_log/dt_bias at their init, bias at 0
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g) * 2 - 1)
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    return model.eval()


CASES = {
    "dense": dict(),
    "heads-differ-q-lora-bias": dict(linear_num_heads=3, linear_head_dim=8, q_lora_rank=24, attention_bias=True,
                                     linear_conv_kernel_dim=3),
    "moe-groups-shared": dict(**MOE, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.446),
    "moe-no-renorm-two-shared": dict(**MOE, norm_topk_prob=False, n_shared_experts=2, routed_scaling_factor=1.5),
    "moe-no-shared-mla-first": dict(mlp_layer_types=["sparse"] * 4, n_shared_experts=0,
                                    layer_types=["full_attention"] + ["linear_attention"] * 3),
}


def ids(B=2, T=37, seed=1):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match(case):
    assert_logits_match(kimi(**CASES[case]), T=37)


@pytest.mark.parametrize("case", ["dense", "moe-groups-shared"])
def test_left_padding_matches(case):
    assert_left_padding_matches(kimi(**CASES[case]), T=20, pads=(5, 0, 11), positions=False)


@pytest.mark.parametrize("case", ["dense", "moe-groups-shared"])
def test_greedy_generate_matches(case):
    assert_greedy_matches(kimi(**CASES[case]), T=15)


def test_config_mapping():
    cfg, sd = to_state_dict(kimi(**CASES["moe-groups-shared"]))
    assert cfg.layout == "KM (KO)*2 LO" and cfg.pos_embedding == "none"
    assert (cfg.kda_heads, cfg.kda_head_dim, cfg.kda_rank, cfg.d_conv) == (4, 16, 16, 4)
    assert (cfg.moe_router, cfg.moe_router_bias, cfg.moe_n_group, cfg.moe_topk_group, cfg.moe_scale) == \
        ("sigmoid", True, 4, 2, 2.446)
    assert sd["blocks.0.mixer.qkv.weight"].shape == (3 * 64, 64) and sd["blocks.0.mixer.A_log"].shape == (4,)
    assert sd["blocks.3.mixer.w_gate"].shape == (8, 64, 24) and sd["blocks.3.mixer.w_down"].shape == (8, 24, 64)
    released = [4, 8, 12, 16, 20, 24, 27]   # the 48B-A3B config.json: full attention layers (1-based), first dense
    hf_cfg = transformers.KimiLinearConfig(**{**COMMON, "num_hidden_layers": 27, "layer_types": None,
                                              "mlp_layer_types": None},
                                           linear_attn_config={"full_attn_layers": released,
                                                               "kda_layers": [i for i in range(1, 28)
                                                                              if i not in released]})
    assert config_from_transformers(hf_cfg).layout == "KM (KO KO LO KO)*6 KO LO"


@pytest.mark.parametrize("kw,match", [
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(hidden_act="gelu"), "activation"),
    (dict(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), "layer type"),
    (dict(mla_use_nope=False), "mla_use_nope"),
    (dict(moe_router_activation_func="softmax"), "moe_router_activation_func"),
])
def test_unsupported_options_raise(kw, match):
    cfg = transformers.KimiLinearConfig(**{**COMMON, **kw})
    with pytest.raises(ConfigError, match=match):
        config_from_transformers(cfg)


@pytest.mark.parametrize("n_layers", [1, 4, 8])
def test_preset_twin(n_layers):
    assert_twin_is_preset("kimi-linear", 128, n_layers, vocab_size=256)


def test_directory_conversion_and_info(tmp_path, capsys):
    assert_directory_converts(kimi(**CASES["moe-groups-shared"]), tmp_path, capsys, "KM (KO)*2 LO", T=17)