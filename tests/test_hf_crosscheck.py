"""Cross-checks against transformers: small random Llama and Mamba2 models converted with
`from_transformers` must give the same logits (float32, 1e-4) and the same greedy generations."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from hybridlm.errors import ConfigError  # noqa: E402
from hybridlm.hf import from_transformers, to_state_dict  # noqa: E402

VOCAB = 97
NO_SPECIAL = dict(eos_token_id=None, bos_token_id=None, pad_token_id=None)


def _perturb(model, seed=0):
    """Random values everywhere (norm gains, D, biases, ...): a default init hides many mix-ups."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 8 + 1))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) - 3)
            elif p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    return model.eval()


def llama(n_kv_heads=4, **kw):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=n_kv_heads,
                                   max_position_embeddings=256, rms_norm_eps=1e-5,
                                   rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                                   **{**NO_SPECIAL, **kw})
    torch.manual_seed(0)
    return _perturb(transformers.LlamaForCausalLM(cfg))


def mamba2(n_groups=1, **kw):
    cfg = transformers.Mamba2Config(vocab_size=VOCAB, hidden_size=64, expand=2, num_heads=8, head_dim=16,
                                    state_size=16, n_groups=n_groups, num_hidden_layers=2, chunk_size=16,
                                    conv_kernel=4, **{**NO_SPECIAL, **kw})
    torch.manual_seed(0)
    return _perturb(transformers.Mamba2ForCausalLM(cfg))


def ids(B=2, T=37, seed=1):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


CASES = {
    "llama-mha": lambda: llama(4),
    "llama-gqa": lambda: llama(2),
    "llama-mqa-tied": lambda: llama(1, tie_word_embeddings=True),
    "llama-bias": lambda: llama(2, attention_bias=True, mlp_bias=True, head_dim=24),
    "mamba2-g1": lambda: mamba2(1),
    "mamba2-g2": lambda: mamba2(2),
    "mamba2-g2-tied": lambda: mamba2(2, tie_word_embeddings=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match(case):
    hf = CASES[case]()
    ours = from_transformers(hf)
    x = ids(T=37)                                        # 37: not a multiple of the chunk (16)
    with torch.no_grad():
        ref = hf(x).logits
        got = ours(x).logits
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-4
    if "tied" in case:
        assert ours.lm_head.weight is ours.embed.weight


@pytest.mark.parametrize("n_kv", [4, 2])
def test_llama_left_padding(n_kv):
    hf = llama(n_kv)
    ours = from_transformers(hf)
    x = ids(B=3, T=20)
    mask = torch.ones_like(x)
    mask[0, :5] = 0
    mask[2, :11] = 0
    pos = (mask.cumsum(1) - 1).clamp(min=0)              # positions of real tokens start at 0
    with torch.no_grad():
        ref = hf(x, attention_mask=mask, position_ids=pos).logits
        got = ours(x, attention_mask=mask).logits
    real = mask.bool()
    assert (got[real] - ref[real]).abs().max().item() <= 1e-4
    # the unpadded rows also equal running each row alone
    with torch.no_grad():
        alone = ours(x[2:, 11:]).logits
    assert (got[2, 11:] - alone[0]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("case", ["llama-gqa", "mamba2-g1", "mamba2-g2"])
def test_greedy_generate_matches(case):
    hf = CASES[case]()
    ours = from_transformers(hf)
    x = ids(B=2, T=19)
    with torch.no_grad():
        ref = hf.generate(x, max_new_tokens=6, do_sample=False, use_cache=True)
    got = ours.generate(x, 6, temperature=0)
    assert torch.equal(got, ref)


def test_llama_generate_left_padded():
    hf = llama(2)
    ours = from_transformers(hf)
    x = ids(B=2, T=12)
    mask = torch.ones_like(x)
    mask[1, :4] = 0
    with torch.no_grad():
        ref = hf.generate(x, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    got = ours.generate(x, 5, temperature=0, attention_mask=mask)
    assert torch.equal(got, ref)


def test_config_mapping():
    cfg, sd = to_state_dict(llama(2))
    assert cfg.layout == "(AM)*2" and cfg.n_heads == 4 and cfg.kv_heads == 2 and cfg.rope_base == 500.0
    assert cfg.mlp_hidden_size == 96 and cfg.norm_eps == 1e-5 and not cfg.tie_embeddings
    assert sd["blocks.0.mixer.qkv.weight"].shape == ((4 + 2 * 2) * 16, 64)
    cfg, _ = to_state_dict(mamba2(2))
    assert cfg.layout == "S*2" and cfg.ssd_ngroups == 2 and cfg.ssd_d_state == 16 and cfg.ssd_headdim == 16
    assert cfg.ssd_chunk_size == 16 and cfg.norm_eps == 1e-5
    assert to_state_dict(mamba2(1), ssd_chunk_size=8)[0].ssd_chunk_size == 8


def test_unsupported_options_raise():
    with pytest.raises(ConfigError, match="rope"):
        from_transformers(transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})))
    with pytest.raises(ConfigError, match="activation"):
        from_transformers(transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            hidden_act="gelu")))
    limited = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(          # a dt clamp is ssd_dt_limit
        vocab_size=VOCAB, hidden_size=32, num_heads=4, head_dim=16, state_size=8, n_groups=1,
        num_hidden_layers=1, time_step_limit=(0.0, 0.5))).eval()
    assert from_transformers(limited).config.ssd_dt_limit == (0.0, 0.5)
    x = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        assert (from_transformers(limited)(x).logits - limited(x).logits).abs().max().item() <= 1e-4
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2,
                                                                n_positions=64))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel"):
        from_transformers(gpt2)
    with pytest.raises(ConfigError, match="LlamaModel"):
        from_transformers(transformers.LlamaModel(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)))
