"""The decode loop of `stream`: a cache sized once for the whole generation, and the torch.compile'd step."""
import pytest
import torch

from hybridlm.ops.cpu_kernels import cxx_compiler
from test_models import ALL, tiny

needs_compiler = pytest.mark.skipif(cxx_compiler() is None, reason="torch.compile on CPU needs a C++ compiler")


def test_stream_allocates_kv_once():
    m = tiny("transformer++")
    ids = torch.randint(0, 97, (2, 7))
    cache = m.make_cache(2, max_tokens=7 + 20)
    m(ids, cache=cache)
    ptr = cache.layers[0].k.data_ptr()
    for _ in range(20):
        m.decode_step(torch.randint(0, 97, (2, 1)), cache)
    assert cache.layers[0].k.data_ptr() == ptr and cache.layers[0].k.shape[1] == 27
    kv = [c for c in cache.layers if c is not None]
    assert cache.nbytes == sum(27 * (c.k[:, :1].nbytes + c.v[:, :1].nbytes) for c in kv)  # held tokens, not capacity


def test_decode_step_equals_forward_with_padded_prompt():
    m = tiny("mamba2-attention")
    ids = torch.randint(0, 97, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0                                   # left padding in row 0
    c1, c2 = m.make_cache(2), m.make_cache(2)
    m(ids, attention_mask=mask, cache=c1)
    m(ids, attention_mask=mask, cache=c2)
    nxt = torch.randint(0, 97, (2, 1))
    fast = m.decode_step(nxt, c1)
    ref = m(nxt, attention_mask=torch.ones_like(nxt), cache=c2).logits[:, -1]
    torch.testing.assert_close(fast, ref, atol=0, rtol=0)
    assert torch.equal(c1.key_mask, c2.key_mask) and torch.equal(c1.next_pos, c2.next_pos)


@needs_compiler
@pytest.mark.parametrize("name", ["transformer++", "mamba2-attention"])
def test_compiled_decode_matches_eager(name):
    torch.manual_seed(0)
    m = tiny(name)
    ids = torch.randint(0, 97, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    eager = m.generate(ids, 8, temperature=0, attention_mask=mask)
    compiled = m.generate(ids, 8, temperature=0, attention_mask=mask, compile=True)
    assert torch.equal(eager, compiled)


@pytest.mark.slow
@needs_compiler
@pytest.mark.parametrize("name", ALL)
def test_compiled_decode_matches_eager_every_preset(name):
    torch._dynamo.reset()              # one compiled step per process in real use; keep presets apart here
    torch.manual_seed(0)
    m = tiny(name)
    ids = torch.randint(0, 97, (2, 9))
    assert torch.equal(m.generate(ids, 6, temperature=0), m.generate(ids, 6, temperature=0, compile=True))


def test_compile_without_a_compiler_is_one_clear_error(monkeypatch):
    from hybridlm.errors import ConfigError
    monkeypatch.setattr("shutil.which", lambda name: None)
    m = tiny("transformer++")
    with pytest.raises(ConfigError, match="C\\+\\+ compiler"):
        m.generate(torch.randint(0, 97, (1, 4)), 2, temperature=0, compile=True)


@pytest.mark.parametrize("name", ["doge", "cheems", "transformer++"])
def test_decode_step_traces_as_one_graph(name):
    """No data-dependent shapes in the decode step (CDMoE included): torch.compile sees one graph."""
    m = tiny(name).eval()
    ids = torch.randint(0, 97, (2, 9))
    with torch.inference_mode():
        cache = m.make_cache(2, max_tokens=16)
        m(ids, cache=cache)
        ex = torch._dynamo.explain(type(m).decode_step)(m, torch.randint(0, 97, (2, 1)), cache)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons
