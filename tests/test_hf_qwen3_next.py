"""Cross-check against transformers' Qwen3NextForCausalLM on random weights (every parameter perturbed): the
converted model gives the same logits (float32, 1e-4) for dense, MoE and mixed stacks, key/value head groups in both
G and A, attention bias and tied embeddings, with left padding; greedy generation is token-identical; a
transformers-format directory converts through the CLI; unsupported options are named; the preset's twin converts
to the preset."""
import pytest
import torch
from conftest import decode_logits

transformers = pytest.importorskip("transformers")

from hybridlm.errors import ConfigError  # noqa: E402
from hybridlm.hf.convert import config_from_transformers  # noqa: E402
from hf_checks import (assert_directory_converts, assert_greedy_matches, assert_left_padding_matches,  # noqa: E402
                       assert_logits_match, assert_twin_is_preset, max_diff)

VOCAB = 97


def qwen3_next(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                shared_expert_intermediate_size=40, intermediate_size=48, max_position_embeddings=256,
                rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg = transformers.Qwen3NextConfig(**{**base, **kw})
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():   # zero-init norms, ones, A_log: perturb every parameter so no mapping hides
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g) if p.dim() == 1 else 0.1 * torch.randn(p.shape, generator=g))
    return model.float().eval()


CASES = {
    "moe": dict(),
    "dense": dict(num_experts=0),
    "mixed-sparse-step": dict(decoder_sparse_step=2, mlp_only_layers=[3], num_key_value_heads=1),
    "groups-bias-tied": dict(linear_num_key_heads=1, linear_num_value_heads=3, attention_bias=True,
                             tie_word_embeddings=True, norm_topk_prob=False, num_hidden_layers=6,
                             layer_types=["linear_attention", "full_attention"] * 3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match(case):
    hf = qwen3_next(**CASES[case])
    ours = assert_logits_match(hf, T=37)
    if case == "groups-bias-tied":
        ids = torch.randint(0, VOCAB, (2, 37))
        with torch.no_grad():
            assert max_diff(decode_logits(ours, ids, 20), ours(ids).logits) <= 1e-4


def test_layouts():
    layout = {c: config_from_transformers(qwen3_next(**kw).config).layout for c, kw in CASES.items()}
    assert layout == {"moe": "(GO)*3 AO", "dense": "(GM)*3 AM", "mixed-sparse-step": "GM GO GM AM",
                      "groups-bias-tied": "(GO AO)*3"}
    released = transformers.Qwen3NextConfig()   # the 80B-A3B defaults: 48 layers, full attention every 4th
    cfg = config_from_transformers(released)
    assert cfg.layout == "(GO GO GO AO)*12" and cfg.rope_dim == 64 and cfg.gdn_v_heads == 32
    assert cfg.moe_experts == 512 and cfg.moe_topk == 10 and cfg.moe_shared_gate and cfg.mlp_hidden is None


def test_left_padding():
    assert_left_padding_matches(qwen3_next(), T=21, pads=(6, 0, 13))


def test_greedy_generate_matches():
    assert_greedy_matches(qwen3_next(num_key_value_heads=1), n=8)


def test_directory_conversion_and_info(tmp_path, capsys):
    assert_directory_converts(qwen3_next(mlp_only_layers=[0]), tmp_path, capsys, "GM (GO)*2 AO")


@pytest.mark.parametrize("kw, match", [
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "rope_type 'linear'"),
    (dict(hidden_act="gelu"), "activation 'gelu'"),
    (dict(attention_dropout=0.1), "attention_dropout"),
    (dict(layer_types=["linear_attention", "sliding_attention"] * 2), "layer_types"),
    (dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size"),
])
def test_unsupported_options_are_named(kw, match):
    cfg = transformers.Qwen3NextConfig(**{**dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                                                   head_dim=16), **kw})
    with pytest.raises(ConfigError, match=match):
        config_from_transformers(cfg)


def test_preset_twin_converts_to_the_preset():
    for d, n in ((128, 4), (256, 8), (128, 2)):
        assert_twin_is_preset("qwen3-next", d, n)