"""Cross-check against transformers' DogeForCausalLM: the dense form converted with `from_transformers` gives the
same logits (float32, 1e-4) with and without padding, with top-keep_window key selection, and the same greedy
generations; the MoE form differs exactly where transformers' CDMoE mixes tokens (its
`router_gate(h).view(2, tokens, -1)` makes routing depend on later tokens)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from hybridlm.errors import ConfigError  # noqa: E402
from hybridlm.hf import from_transformers, to_state_dict  # noqa: E402

VOCAB = 97


def doge(n_kv=4, **kw):
    kw = {"num_experts": 64, "num_experts_per_tok": 8, **kw}
    cfg = transformers.DogeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=n_kv, max_position_embeddings=256,
                                  rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                                  eos_token_id=None, bos_token_id=None,
                                  pad_token_id=None, **kw)
    torch.manual_seed(0)
    model = transformers.DogeForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # random values everywhere, the dynamic-mask A included (it starts at 0)
        for name, p in model.named_parameters():
            base = 0.0 if name.endswith(".A") else 1.0
            p.copy_(base + 0.3 * torch.randn(p.shape, generator=g) if p.dim() == 1
                    else 0.15 * torch.randn(p.shape, generator=g))
    return model.eval()


def distinct_ids(B, T, seed=1):
    """Rows without repeated tokens: equal tokens give equal dynamic-mask biases in the first layer, and
    transformers breaks top-k ties arbitrarily (ours keeps the later key), so keep-window checks avoid them."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(VOCAB, generator=g)[:T] for _ in range(B)])


CASES = {
    "mha": dict(),
    "gqa": dict(n_kv=2),
    "mqa-bias-tied": dict(n_kv=1, attention_bias=True, tie_word_embeddings=True),
    "keep-window": dict(keep_window_size=7),
    "gqa-keep-window-sliding": dict(n_kv=2, keep_window_size=5, sliding_window=9),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_dense_logits_match(case):
    hf = doge(**CASES[case])
    ours = from_transformers(hf)
    x = distinct_ids(2, 31)
    with torch.no_grad():
        ref, got = hf(x).logits, ours(x).logits
    assert (got - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("case", ["gqa", "keep-window"])
def test_dense_left_padding(case):
    hf = doge(**CASES[case])
    ours = from_transformers(hf)
    x = distinct_ids(3, 20)
    mask = torch.ones_like(x)
    mask[0, :5] = 0
    mask[2, :11] = 0
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(x, attention_mask=mask, position_ids=pos).logits
        got = ours(x, attention_mask=mask).logits
    real = mask.bool()
    assert (got[real] - ref[real]).abs().max().item() <= 1e-4


def test_greedy_generate_matches():
    hf = doge(n_kv=2)
    ours = from_transformers(hf)
    x = distinct_ids(2, 15)
    with torch.no_grad():
        ref = hf.generate(x, max_new_tokens=6, do_sample=False, use_cache=True)
    assert torch.equal(ours.generate(x, 6, temperature=0), ref)


def test_config_mapping():
    cfg, sd = to_state_dict(doge(n_kv=2, keep_window_size=7))
    assert cfg.layout == "(AM)*2" and cfg.wm_dyn_mask == "dt" and cfg.wm_keep_window == 7
    assert cfg.residual_scale and cfg.qk_norm and cfg.kv_heads == 2 and cfg.mlp_hidden_size == 96
    assert sd["blocks.0.mixer.A"].shape == (2,) and sd["blocks.0.mixer.dt_proj.weight"].shape == (2, 32)
    assert to_state_dict(doge())[0].wm_keep_window is None       # keep_window_size 2048 >= max positions
    moe_cfg, _ = to_state_dict(doge(is_moe=True))
    assert moe_cfg.layout == "(AE)*2" and moe_cfg.wm_cdmoe_experts == 64 and moe_cfg.wm_cdmoe_topk == 8
    with pytest.raises(ConfigError, match="perfect square"):
        to_state_dict(doge(is_moe=True, num_experts=60))


def test_moe_differs_only_by_transformers_token_mixing():
    """transformers' DogeCDMoE views router logits as (2, tokens, √N): with one token the split is right and
    the logits match; with several, its routing of token 0 depends on later tokens (with 8 tokens, its "y"
    scores are token 4's "x" logits). Ours is causal."""
    hf = doge(is_moe=True)
    ours = from_transformers(hf)
    one = distinct_ids(1, 1)
    with torch.no_grad():
        assert (ours(one).logits - hf(one).logits).abs().max().item() <= 1e-4
        x = distinct_ids(1, 8)
        x2 = x.clone()
        x2[0, 4] = (x[0, 4] + 1) % VOCAB     # token 0's second score vector is read from token 4's logits
        hf_first = hf(x).logits[0, 0], hf(x2).logits[0, 0]
        ours_first = ours(x).logits[0, 0], ours(x2).logits[0, 0]
        assert (hf_first[0] - hf_first[1]).abs().max().item() > 1e-3    # transformers: not causal
        assert torch.equal(ours_first[0], ours_first[1])                 # ours: token 0 ignores the future
        assert (ours(x).logits - hf(x).logits).abs().max().item() > 1e-3
        # with correct per-token routing, each position equals running its prefix alone (one token at a time)
        solo = torch.stack([ours(x[:, : t + 1]).logits[0, -1] for t in range(8)])
        assert (solo - ours(x).logits[0]).abs().max().item() <= 1e-4
