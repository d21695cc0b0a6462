"""The static-shape decode step (`CausalLM.static_decode_step`, `InferenceCache.make_static`): the same logits and
tokens as the growing-cache decode, for every preset and with left padding, at fixed shapes and buffer addresses
(what CUDA graphs capture). The CUDA-graph run itself is checked on CUDA only."""
import pytest
import torch

from conftest import assert_batch_generates_like_single, assert_close
from hybridlm.errors import InputError
from hybridlm.ops.cpu_kernels import cxx_compiler
from test_models import ALL, tiny

CUDA = torch.cuda.is_available()
SIZES = [n for n in ALL if n.endswith(("-125m", "-350m", "-760m", "-1.3b", "-wt103"))]   # the same blocks, sized
MAIN = ["transformer++", "mamba2", "rodimus++", "cheems", "doge", "deepseek-mla", "deepseek-sparse"]


def _padded_batch(B=3, T=9):
    ids = torch.randint(0, 97, (B, T))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :5] = 0                                  # three prompt lengths, left padded
    return ids, mask


def _decode_both(m, ids, mask, n):
    """Logits [n, B, V] of n teacher-forced decode steps after a padded prefill: growing cache, then static."""
    steps = torch.randint(0, 97, (n, ids.shape[0], 1))
    out = []
    for static in (False, True):
        cache = m.make_cache(ids.shape[0], max_tokens=ids.shape[1] + n)
        with torch.inference_mode():
            m(ids, attention_mask=mask, cache=cache)
            step = m.static_decode_step() if static else m.decode_step
            out.append(torch.stack([step(s, cache) for s in steps]))
        assert cache.seen == ids.shape[1] + n
    return out


@pytest.mark.parametrize("name", [n for n in ALL if n not in SIZES]
                         + [pytest.param(n, marks=pytest.mark.slow) for n in SIZES])
def test_static_step_equals_growing_decode(name):
    torch.manual_seed(0)
    m = tiny(name)
    ids, mask = _padded_batch()
    dyn, static = _decode_both(m, ids, mask, 7)
    assert_close(static, dyn, 1e-5, 2e-5, msg=name)


@pytest.mark.parametrize("name", MAIN)
def test_static_generation_batched_prompts(name):
    """Greedy tokens: static = growing decode, and a left-padded batch of two prompt lengths = each prompt alone."""
    torch.manual_seed(0)
    m = tiny(name)
    ids, mask = _padded_batch()
    assert torch.equal(m.generate(ids, 8, temperature=0, attention_mask=mask, static=True),
                       m.generate(ids, 8, temperature=0, attention_mask=mask))
    orig = m.generate
    m.generate = lambda *a, **kw: orig(*a, static=True, **kw)
    assert_batch_generates_like_single(m, torch.randint(0, 97, (1, 8)), torch.randint(0, 97, (1, 3)), 6)


@pytest.mark.parametrize("name", ["transformer++", "cheems", "deepseek-sparse", "mamba2", "rodimus++"])
def test_static_step_keeps_shapes_and_addresses(name):
    """Every cache tensor keeps its shape and storage from step to step; the step traces as one graph."""
    m = tiny(name)
    ids, mask = _padded_batch()
    cache = m.make_cache(3, max_tokens=9 + 6)
    with torch.inference_mode():
        m(ids, attention_mask=mask, cache=cache)
        step = m.static_decode_step()
        step(torch.randint(0, 97, (3, 1)), cache)
        before = [(t.shape, t.data_ptr()) for t in cache.static_tensors()]
        for _ in range(4):
            step(torch.randint(0, 97, (3, 1)), cache)
        assert [(t.shape, t.data_ptr()) for t in cache.static_tensors()] == before
        ex = torch._dynamo.explain(type(m)._static_decode_step)(m, torch.randint(0, 97, (3, 1)), cache)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons


def test_static_needs_room():
    m = tiny("transformer++")
    ids = torch.randint(0, 97, (1, 4))
    with torch.inference_mode():
        cache = m.make_cache(1)
        m(ids, cache=cache)
        with pytest.raises(InputError, match="max_tokens"):
            m.static_decode_step()(ids[:, :1], cache)
        cache = m.make_cache(1, max_tokens=5)
        m(ids, cache=cache)
        step = m.static_decode_step()
        step(ids[:, :1], cache)
        with pytest.raises(InputError, match="full"):
            step(ids[:, :1], cache)


@pytest.mark.slow
@pytest.mark.skipif(cxx_compiler() is None, reason="torch.compile on CPU needs a C++ compiler")
def test_static_step_compiles_once():
    """Compiled with dynamic=False, the static step is compiled once and reused at every step."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    m = tiny("transformer++")
    ids, mask = _padded_batch()
    eager = m.generate(ids, 6, temperature=0, attention_mask=mask)
    assert torch.equal(m.generate(ids, 6, temperature=0, attention_mask=mask, compile=True, static=True), eager)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("name", MAIN)
def test_cuda_graph_decode(name):
    torch.manual_seed(0)
    m = tiny(name).cuda()
    ids, mask = _padded_batch()
    ids, mask = ids.cuda(), mask.cuda()
    assert torch.equal(m.generate(ids, 8, temperature=0, attention_mask=mask, compile=True),
                       m.generate(ids, 8, temperature=0, attention_mask=mask))


def test_decode_bench_suite_quick():
    """`hybridlm bench --suite decode --quick`: a row per preset and mode, sizes taken from the flags."""
    from hybridlm.bench import registry
    from hybridlm.bench.suites import decode_suite
    assert registry.SUITES["decode"].function() is decode_suite
    out = decode_suite(registry.settings("decode", quick=True, presets="mamba2", steps=3, repeats=1),
                       log=lambda *a: None)
    assert out["settings"]["steps"] == 3
    row = out["ms_per_token"]["mamba2"]
    assert set(row) == {"growing", "static"} | ({"static+graph"} if CUDA else set()) and min(row.values()) > 0


def test_graph_needs_cuda_and_no_compile():
    """The eager CUDA-graph step (the GPU check's decode) is refused with one line off CUDA or with compile."""
    from hybridlm import CausalLM, presets
    from hybridlm.errors import ConfigError
    m = CausalLM(presets.get("mamba2", n_layers=1, d_model=32, vocab_size=64))
    with pytest.raises(ConfigError, match="CUDA graph"):
        m.static_decode_step(graph=True)
    with pytest.raises(ConfigError, match="compile=True"):
        m.static_decode_step(compile=True, graph=True)
