"""Every preset: builds, decodes exactly like a full forward, pads cleanly, trains, generates."""
import pytest
import torch

from conftest import assert_batch_generates_like_single, assert_close, assert_trains, decode_logits, padded_logits
from hybridlm import CausalLM, ModelConfig, presets
from hybridlm.errors import ConfigError, InputError
from hybridlm.models.sizing import token_mixers

TINY = dict(d_model=64, n_heads=4, vocab_size=97, ssd_headdim=16, ssd_d_state=16, ssd_chunk_size=8,
            max_seq_len=256,
            # Rodimus*: small state, a window the test sequences slide past, size presets' explicit FFN width reset
            rodimus_d_state=16, swa_window=8, mlp_hidden=None, mamba1_d_state=4)


def _letters(cfg) -> set[str]:
    return {c for c in cfg.layout if c.isalpha()}


def tiny_config(name: str, **kw) -> ModelConfig:
    """The preset at TINY sizes with the fewest layers that still hold every letter of it."""
    n = 2 if presets.PRESETS[name].n_layers < 10 else 10
    if token_mixers(presets.get(name, n_layers=1, **{**TINY, **kw})) >= 4:
        n = 1                                   # one repeat unit already has several mixers (Jamba's 8 layers)
    full = _letters(presets.get(name, **{**TINY, **kw}))
    while _letters(presets.get(name, n_layers=n, **{**TINY, **kw})) != full:
        n += 1                                  # every letter of the preset (Bamba's attention is its 3rd layer)
    return presets.get(name, n_layers=n, **{**TINY, **kw})


def tiny(name: str, **kw) -> CausalLM:
    return CausalLM(tiny_config(name, **kw)).eval()


ALL = presets.names()


@pytest.mark.parametrize("name", ALL)
def test_prefill_then_decode_equals_full_forward(name):
    m = tiny(name)
    ids = torch.randint(0, 97, (2, 29))
    full = m(ids).logits
    cache = m.make_cache(2)
    assert_close(decode_logits(m, ids, 11, cache=cache), full, atol=2e-5, msg=name)
    assert cache.nbytes > 0


@pytest.mark.parametrize("name", ALL)
def test_chunked_prefill_equals_one_prefill(name):
    m = tiny(name)
    ids = torch.randint(0, 97, (2, 40))
    c1, c2 = m.make_cache(2), m.make_cache(2)
    one = m(ids, cache=c1).logits
    chunks = torch.cat([m(ids[:, i:i + 13], cache=c2).logits for i in range(0, 40, 13)], 1)
    assert_close(chunks, one, atol=2e-5, msg=name)
    nxt = torch.randint(0, 97, (2, 1))
    assert_close(m(nxt, cache=c2).logits, m(nxt, cache=c1).logits, atol=2e-5)


@pytest.mark.parametrize("name", ALL)
def test_padding_leaves_real_positions_unchanged(name):
    m = tiny(name)
    ids = torch.randint(0, 97, (1, 15))
    ref = m(ids).logits
    pad = torch.randint(0, 97, (1, 6))
    assert_close(padded_logits(m, ids, pad), ref, atol=2e-5, msg=f"{name} left")
    assert_close(padded_logits(m, ids, pad, "right"), ref, atol=2e-5, msg=f"{name} right")


@pytest.mark.parametrize("name", ALL)
def test_left_padded_batch_generation_matches_single(name):
    m = tiny(name)
    a = torch.randint(0, 97, (1, 9))
    b = torch.randint(0, 97, (1, 5))
    assert_batch_generates_like_single(m, a, b, 6)


@pytest.mark.parametrize("name", ALL)
def test_trains_with_falling_loss_and_round_trips(name):
    torch.manual_seed(0)
    m = tiny(name)
    ids = torch.randint(0, 97, (4, 32))
    assert_trains(m, ids, 15, drop=0.5)
    m.eval()
    m2 = CausalLM(ModelConfig.from_dict(m.config.to_dict())).eval()
    m2.load_state_dict(m.state_dict())
    assert torch.equal(m2(ids).logits, m(ids).logits)
    out = m2.generate(ids[:1, :5], 4, temperature=0.8, top_k=10, top_p=0.9)
    assert out.shape == (1, 9)


def test_packed_documents_equal_separate_runs():
    for name in ("transformer++", "mamba2"):
        m = tiny(name)
        a, b = torch.randint(0, 97, (1, 12)), torch.randint(0, 97, (1, 9))
        resets = torch.zeros(1, 21, dtype=torch.bool)
        resets[0, 12] = True
        packed = m(torch.cat([a, b], 1), resets=resets).logits
        assert_close(packed, torch.cat([m(a).logits, m(b).logits], 1), atol=2e-5, msg=name)


def test_generate_greedy_is_deterministic_and_stream_matches():
    m = tiny("mamba2-attention")
    ids = torch.randint(0, 97, (2, 7))
    g = m.generate(ids, 8, temperature=0)
    streamed = torch.stack(list(m.stream(ids, 8, temperature=0)), 1)
    assert torch.equal(g[:, 7:], streamed)


def test_tied_and_untied_embeddings():
    tied = tiny("mamba2")
    assert tied.lm_head.weight is tied.embed.weight
    untied = tiny("transformer++")
    assert untied.lm_head.weight is not untied.embed.weight


def test_hybrid_spreads_attention():
    cfg = presets.get("mamba2-attention", n_layers=20)
    assert cfg.layout.count("A") == 2 and cfg.layout.count("S") == 18
    assert not cfg.layout.startswith("A")


def test_bad_inputs_give_clear_errors():
    with pytest.raises(ConfigError, match="unknown preset"):
        presets.get("nope")
    with pytest.raises(ConfigError, match="column"):
        ModelConfig(layout="(AM*2")
    m = tiny("transformer++")
    with pytest.raises(InputError, match="out of range"):
        m(torch.tensor([[1, 2, 97]]))
    with pytest.raises(InputError, match="max_seq_len"):
        m(torch.zeros(1, 257, dtype=torch.long))
    with pytest.raises(InputError, match="max_seq_len"):
        m.generate(torch.zeros(1, 250, dtype=torch.long), 10)
    with pytest.raises(ConfigError, match="n_kv_heads"):
        ModelConfig(layout="A", n_heads=4, n_kv_heads=3)
    with pytest.raises(ConfigError, match="unknown config field"):
        ModelConfig.from_dict({"layout": "A", "bogus": 1})
