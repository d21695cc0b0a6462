"""The Mamba-2 hybrids of transformers: Bamba, Nemotron-H, Granite-4.0 (GraniteMoeHybrid). Converted models give
transformers' logits (float32, 1e-4) on random weights with every parameter perturbed, with GQA, several SSD groups,
left padding, MoE layers and Granite's multipliers, and the same greedy generations; directories convert; the S
letter's new options (ssd_d_inner, ssd_dt_limit) decode like the full forward, ignore padding and stop at resets."""
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import assert_close, decode_logits, padded_logits  # noqa: E402
from hybridlm import presets  # noqa: E402
from hybridlm.cli import main as cli_main  # noqa: E402
from hybridlm.errors import ConfigError  # noqa: E402
from hybridlm.hf import from_transformers, to_state_dict  # noqa: E402
from hybridlm.hf.common import TWINS  # noqa: E402
from hybridlm.hf.convert import config_from_transformers  # noqa: E402
from hybridlm.models import CausalLM, ModelConfig  # noqa: E402
from hf_checks import assert_greedy_matches, assert_left_padding_matches  # noqa: E402

V = 97
_NO_TOKENS = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)


def perturb(model, dt_bias=1.0):
    """Random values in every parameter and buffer that is a weight (inits of ones/zeros hide mapping bugs);
    1-D parameters around 1 (norms, D, A_log), dt_bias around `dt_bias`."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point() or "inv_freq" in name:
                continue
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("dt_bias"):
                p.copy_(dt_bias + noise)
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * noise)
            elif p.dim() == 1:
                p.copy_(1.0 + 0.3 * noise)
            else:
                p.copy_(0.15 * noise)
    return model.eval()


def bamba(**kw):
    kw = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2,
              mamba_d_state=16, mamba_chunk_size=8, max_position_embeddings=256, **_NO_TOKENS) | kw
    return perturb(transformers.BambaForCausalLM(transformers.BambaConfig(**kw)))


def nemotron_h(dt_bias=1.0, **kw):
    kw = dict(vocab_size=V, hidden_size=64, hybrid_override_pattern="M-M*-E", num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=6, mamba_head_dim=16,
              n_groups=3, ssm_state_size=16, chunk_size=8, n_routed_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1,
              routed_scaling_factor=2.5, max_position_embeddings=256, **_NO_TOKENS) | kw
    return perturb(transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**kw)), dt_bias=dt_bias)


def granite(**kw):
    kw = dict(vocab_size=V, hidden_size=64, intermediate_size=32, shared_intermediate_size=48, num_hidden_layers=3,
              layer_types=["linear_attention", "full_attention", "linear_attention"], num_attention_heads=4,
              num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=16,
              mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=8, max_position_embeddings=256,
              embedding_multiplier=3.0, attention_multiplier=0.05, residual_multiplier=0.4, logits_scaling=2.5,
              tie_word_embeddings=True, **_NO_TOKENS) | kw
    return perturb(transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(**kw)))


CASES = {
    "bamba": lambda: bamba(),
    "bamba-mha-tied-bias-1group": lambda: bamba(num_key_value_heads=4, mamba_n_groups=1, tie_word_embeddings=True,
                                                attention_bias=True, mamba_proj_bias=True),
    "bamba-dt-limit": lambda: bamba(time_step_limit=(0.5, 2.0)),
    "nemotron-h": lambda: nemotron_h(),
    "nemotron-h-dt-clamped": lambda: nemotron_h(dt_bias=-7.0, hybrid_override_pattern="M-*M", n_groups=2),
    "nemotron-h-mqa-d-inner": lambda: nemotron_h(num_key_value_heads=1, mamba_num_heads=5, n_groups=5,
                                                 n_group=1, norm_topk_prob=False),
    "granite-moe-nope": lambda: granite(),
    "granite-dense-rope-untied": lambda: granite(num_local_experts=0, position_embedding_type="rope",
                                                 tie_word_embeddings=False),
    "granite-bias": lambda: granite(layer_types=["linear_attention", "linear_attention", "full_attention"],
                                    mamba_proj_bias=True, attention_bias=True),
}


def ids(B, T, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match(case):
    hf = CASES[case]()
    ours = from_transformers(hf)
    x = ids(2, 19)
    with torch.no_grad():
        ref, got = hf(x).logits, ours(x).logits
    assert (got - ref).abs().max().item() <= 1e-4
    with torch.no_grad():                                                     # our cache: prefill + decode
        assert_close(decode_logits(ours, x[:, :11], 5), got[:, :11], rtol=1e-4, atol=1e-4)


def test_dt_clamp_is_exercised():
    """Nemotron-H's (time_step_min, inf) clamp matters with these dt_bias values: without it the logits move."""
    hf = CASES["nemotron-h-dt-clamped"]()
    cfg, sd = to_state_dict(hf)
    assert cfg.ssd_dt_limit == (1e-3, math.inf) and cfg.ssd_dt_min == 1e-3
    free = CausalLM(cfg.replace(ssd_dt_limit=None)).eval()
    free.load_state_dict(sd)
    x = ids(1, 19)
    with torch.no_grad():
        assert (free(x).logits - hf(x).logits).abs().max().item() > 1e-3


@pytest.mark.parametrize("case", ["bamba", "nemotron-h", "granite-moe-nope", "granite-dense-rope-untied"])
def test_left_padding(case):
    assert_left_padding_matches(CASES[case](), T=16)


@pytest.mark.parametrize("case", ["bamba", "nemotron-h", "granite-moe-nope"])
def test_greedy_generate_matches(case):
    assert_greedy_matches(CASES[case]())


def test_layouts_and_options():
    cfg = to_state_dict(nemotron_h())[0]
    assert cfg.layout == "SMSAMO" and not cfg.mlp_gated and cfg.mlp_act == "relu2" and cfg.pos_embedding == "none"
    assert (cfg.moe_router, cfg.moe_router_bias, cfg.moe_n_group, cfg.moe_scale) == ("sigmoid", True, 2, 2.5)
    assert cfg.ssd_ngroups == 3 and cfg.ssd_d_inner == 96 and cfg.ssd_dt_limit == (1e-3, math.inf)
    cfg = to_state_dict(bamba())[0]
    assert cfg.layout == "SM AM SM" and cfg.rope_dim == 8 and cfg.head_dim == 16 and cfg.ssd_expand == 2
    assert cfg.ssd_d_inner is None and cfg.ssd_dt_limit is None
    cfg = to_state_dict(granite())[0]
    assert cfg.layout == "SO AO SO" and cfg.embed_scale == 3.0 and cfg.moe_shared and cfg.moe_shared_hidden == 48
    assert cfg.pos_embedding == "none" and cfg.tie_embeddings


@pytest.mark.parametrize("build, option, match", [
    (lambda: bamba(hidden_act="gelu"), None, "activation 'gelu'"),
    (lambda: bamba(attention_dropout=0.1), None, "attention_dropout"),
    (lambda: bamba(time_step_limit=(0.5, 0.1)), None, "time_step_limit"),
    (lambda: bamba(), dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "rope_type"),
    (lambda: nemotron_h(), dict(sliding_window=8), "sliding_window"),
    (lambda: nemotron_h(), dict(moe_latent_size=16), "moe_latent_size"),
    (lambda: nemotron_h(), dict(mamba_hidden_act="relu2"), "Mamba activation"),
    (lambda: nemotron_h(), dict(mlp_bias=True), "mlp_bias"),
    (lambda: granite(), dict(position_embedding_type="alibi"), "position_embedding_type"),
    (lambda: granite(), dict(layer_types=["linear_attention", "moe", "linear_attention"]), "layer_types"),
])
def test_refused_options_are_named(build, option, match):
    if option is None:
        with pytest.raises(ConfigError, match=match):
            to_state_dict(build())
        return
    cfg = build().config
    for k, v in option.items():
        object.__setattr__(cfg, k, v)
    with pytest.raises(ConfigError, match=match):
        config_from_transformers(cfg)


@pytest.mark.parametrize("name", ["bamba", "nemotron-h", "granite-hybrid"])
def test_twin_equals_preset(name):
    for d, n in ((128, 4), (64, 5)):
        assert config_from_transformers(TWINS[name](d, n, 500, 300)) == \
            presets.get(name, d_model=d, n_layers=n, vocab_size=500, max_seq_len=300)


@pytest.mark.parametrize("case", ["nemotron-h", "granite-moe-nope"])
def test_directory_conversion_and_info(case, tmp_path, capsys):
    from hybridlm.checkpoint import load_checkpoint
    hf = CASES[case]()
    hf.save_pretrained(tmp_path / "hf")
    run = str(tmp_path / "run")
    assert cli_main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", run]) == 0
    model, _ = load_checkpoint(run)
    x = ids(1, 12)
    with torch.no_grad():
        assert (model.eval()(x).logits - hf(x).logits).abs().max().item() <= 1e-4
    assert cli_main(["info", "--checkpoint", run, "--context", "8"]) == 0
    assert model.config.layout in capsys.readouterr().out


# --- the S letter's options, on our own models ------------------------------------------------------------------

def s_model(**kw):
    cfg = ModelConfig(layout="SM AM S", vocab_size=V, d_model=32, n_heads=2, ssd_headdim=8, ssd_d_state=8,
                      ssd_ngroups=2, ssd_chunk_size=4, mlp_act="relu2", mlp_gated=False, pos_embedding="none",
                      ssd_d_inner=48, ssd_dt_limit=(0.05, 0.3), **kw)
    torch.manual_seed(0)
    return CausalLM(cfg).eval()


def test_ssd_options_decode_padding_resets():
    m = s_model()
    assert m.blocks[0].mixer.d_inner == 48 and m.blocks[0].mixer.nheads == 6
    x = ids(2, 13)
    with torch.no_grad():
        full = m(x).logits
        assert_close(decode_logits(m, x, 4, 5), full, rtol=1e-4, atol=1e-5)
        pad = ids(2, 3, seed=7)
        assert_close(padded_logits(m, x, pad, "left"), full, rtol=1e-4, atol=1e-5)
        assert_close(padded_logits(m, x, pad, "right"), full, rtol=1e-4, atol=1e-5)
        resets = torch.zeros_like(x, dtype=torch.bool)
        resets[:, 0] = resets[:, 6] = True
        packed = m(x, resets=resets).logits
        assert_close(packed[:, 6:], m(x[:, 6:]).logits, rtol=1e-4, atol=1e-5)
        assert_close(packed[:, :6], m(x[:, :6]).logits, rtol=1e-4, atol=1e-5)


def test_ssd_dt_limit_clamps_and_trains():
    m = s_model()
    x = ids(2, 9)
    out = m(x, labels=x)
    out.loss.backward()
    assert all(p.grad is not None for n, p in m.named_parameters() if "dt_bias" in n)
    with torch.no_grad():
        free = CausalLM(m.config.replace(ssd_dt_limit=None)).eval()
        free.load_state_dict(m.state_dict())
        assert (free(x).logits - m(x).logits).abs().max().item() > 1e-4


@pytest.mark.parametrize("field, value, match", [
    ("ssd_d_inner", 50, "ssd_headdim"),
    ("ssd_d_inner", 0, "ssd_d_inner"),
    ("ssd_dt_limit", (0.3, 0.1), "ssd_dt_limit"),
    ("ssd_dt_limit", (-1.0, 1.0), "ssd_dt_limit"),
    ("mlp_act", "relu3", "mlp_act"),
])
def test_impossible_sizes_fail_at_config_time(field, value, match):
    base = dict(layout="S O", vocab_size=V, d_model=32, ssd_headdim=8, ssd_d_state=8, moe_experts=4)
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**{**base, field: value})


def test_relu2_mlp():
    from hybridlm.layers.mlp import MLP
    mlp = MLP(8, 16, act="relu2", gated=False)
    x = torch.randn(3, 8)
    assert_close(mlp(x), mlp.w_out(torch.relu(mlp.w_in(x)) ** 2))


def test_bfloat16_close_to_float32():
    """The converted model in bf16 (recurrent state still float32) stays near its float32 logits."""
    ours = from_transformers(CASES["nemotron-h"]())
    x = ids(1, 17)
    with torch.no_grad():
        ref = ours(x).logits
        got = ours.to(torch.bfloat16)(x).logits.float()
    assert (got - ref).abs().max().item() <= 0.05 * ref.abs().max().item()
