"""hybridlm models as transformers models: save_pretrained -> AutoModelForCausalLM with identical weights (logits to
float32 rounding), transformers' generate() (greedy, sampling, beam search) against our own decoding, its own uncached
decoding and a brute-force beam search, pipeline() on an exported trained run. One preset per family in the fast
suite; every preset under -m slow."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import hybridlm  # noqa: E402,F401  (registers model_type "hybridlm")
from hybridlm import presets  # noqa: E402
from hybridlm.errors import InputError  # noqa: E402
from hybridlm.hf.modeling import HybridLMCache, HybridLMForCausalLM  # noqa: E402
from test_models import TINY, tiny  # noqa: E402

# one preset per cache kind: K/V, SSD state + conv, MLA latent + indexer keys, WM bias + CDMoE, GLA state + ring
FAMILIES = ["transformer++", "mamba2-attention", "deepseek-sparse", "doge", "rodimus++"]
SLOW = [n for n in presets.names() if n not in FAMILIES]
V = 97


def small(name, n_layers, **kw):
    return hybridlm.CausalLM(presets.get(name, n_layers=n_layers, **{**TINY, **kw})).eval()


def saved_and_loaded(m, tmp_path):
    w = HybridLMForCausalLM.from_model(m)
    assert w.model is m and next(w.parameters()) is next(m.parameters())       # a wrapper, not a copy
    w.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is HybridLMForCausalLM
    return loaded.eval()


def greedy(w, ids, n, **kw):
    return w.generate(ids, attention_mask=kw.pop("attention_mask", torch.ones_like(ids)), max_new_tokens=n,
                      do_sample=False, eos_token_id=None, pad_token_id=0, **kw)


def check_preset(name, tmp_path, **kw):
    m = tiny(name, **kw)
    w = saved_and_loaded(m, tmp_path)
    ids = torch.randint(0, V, (2, 11))
    loaded, ours = w.model.state_dict(), m.state_dict()
    assert loaded.keys() == ours.keys() and all(torch.equal(loaded[k], ours[k]) for k in ours), name
    # the same weights, but loaded tensors sit at safetensors-mmap alignment, and CPU kernels may then sum in another
    # order (doge-dense, kimi-linear, CDMoE's embedding_bag: ≤ 2e-6 seen): the logits agree to float32 rounding
    torch.testing.assert_close(w(ids).logits, m(ids).logits, rtol=0, atol=1e-5)
    assert torch.equal(greedy(w, ids, 7), m.generate(ids, 7, temperature=0)), name
    # beam search reorders every layer's cache; recomputing the whole sequence each step (no cache) must agree
    beams = greedy(w, ids[:1], 4, num_beams=3, num_return_sequences=3)
    assert torch.equal(beams, greedy(w, ids[:1], 4, num_beams=3, num_return_sequences=3, use_cache=False)), name


@pytest.mark.parametrize("name", FAMILIES)
def test_save_load_identical_logits_and_greedy_equals_ours(name, tmp_path):
    check_preset(name, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_every_preset_save_load_and_greedy(name, tmp_path):
    check_preset(name, tmp_path)


def test_hyper_connections_and_tied_embeddings(tmp_path):
    check_preset("transformer++", tmp_path, hyper_connections=2, tie_embeddings=True)
    from safetensors.torch import load_file
    assert "model.lm_head.weight" not in load_file(tmp_path / "model.safetensors")          # stored once, tied


def test_left_padded_batch_greedy_without_cache_and_top_k_1_sampling(tmp_path):
    m = small("mamba2-attention", n_layers=2)                            # "SA": a recurrent and an attention layer
    w = saved_and_loaded(m, tmp_path)
    ids = torch.randint(1, V, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    ours = m.generate(ids, 6, temperature=0, attention_mask=mask)
    assert torch.equal(greedy(w, ids, 6, attention_mask=mask), ours)
    assert torch.equal(greedy(w, ids, 6, attention_mask=mask, use_cache=False), ours)     # full recompute per step
    sampled = w.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=1, eos_token_id=None,
                         pad_token_id=0)
    assert torch.equal(sampled, ours)


def beam_reference(m, prompt: list[int], beams: int, steps: int) -> list[list[int]]:
    """Beam search by full forwards (no cache): each step keeps the `beams` best continuations by summed log-prob."""
    hyps = [(0.0, [])]
    for _ in range(steps):
        cand = []
        for score, toks in hyps:
            lp = m(torch.tensor([prompt + toks])).logits[0, -1].double().log_softmax(-1)
            cand += [(score + lp[t].item(), toks + [t]) for t in range(lp.shape[0])]
        hyps = sorted(cand, key=lambda c: -c[0])[:beams]
    return [prompt + toks for _, toks in hyps]


@pytest.mark.parametrize("name", ["llama", "mamba2", "rodimus++"])
def test_beam_search_equals_brute_force(name, tmp_path):
    m = small(name, n_layers=1, vocab_size=13)
    w = saved_and_loaded(m, tmp_path)
    ids = torch.randint(0, 13, (2, 5))
    out = greedy(w, ids, 3, num_beams=3, num_return_sequences=3, length_penalty=0.0)
    for b in range(2):
        assert out[3 * b: 3 * b + 3].tolist() == beam_reference(m, ids[b].tolist(), 3, 3), (name, b)


def test_cache_reorder_selects_every_slot():
    m = tiny("deepseek-sparse")
    ids = torch.randint(0, V, (3, 8))
    c = HybridLMCache(m)
    m(ids, cache=c.for_batch(3))
    c.reorder_cache(torch.tensor([2, 2, 0]))
    ref = m.make_cache(3)
    m(ids[[2, 2, 0]], cache=ref)
    nxt = torch.randint(0, V, (3, 1))
    assert torch.equal(m(nxt, cache=c.inner).logits, m(nxt, cache=ref).logits)
    with pytest.raises(InputError, match="cannot be cropped"):
        c.crop(1)


def test_pipeline_continues_a_prompt_of_a_trained_run_directory_and_its_export(tmp_path):
    """The run directory itself opens in transformers (no conversion): same logits as our loader, and pipeline()
    continues a prompt as our own decoding does; `convert --to-hf` writes a directory that does the same."""
    from hybridlm.commands.generate import stream_text
    from hybridlm.data.corpus import load_corpus
    from hybridlm.data.loader import TokenData
    from hybridlm.data.tokenizer import ByteTokenizer
    from hybridlm.hf.directory import export_to_hf
    from hybridlm.train import TrainConfig, load_pretrained, train
    text = tmp_path / "code.py"
    text.write_text("def add(a, b):\n    return a + b\n\n" * 200)
    cfg = presets.get("mamba2", n_layers=1, d_model=32, vocab_size=257, max_seq_len=128, ssd_headdim=16,
                      ssd_d_state=16, ssd_chunk_size=16)
    tcfg = TrainConfig(steps=30, batch_size=4, seq_len=32, lr=2e-2, warmup=3, eval_every=30, eval_tokens=200,
                       save_every=30, log_every=30)
    train(cfg, tcfg, TokenData.from_corpus(load_corpus(str(text)), ByteTokenizer()), str(tmp_path / "run"),
          progress=False)
    export_to_hf(str(tmp_path / "run"), str(tmp_path / "hf"))
    model, tok = load_pretrained(str(tmp_path / "run"))
    ids = torch.tensor([tok.encode("def add(a, b):\n")])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "run"))
    assert type(hf) is HybridLMForCausalLM and hf.config.eos_token_id == tok.eos_id
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, model(ids).logits)
    ours = stream_text(model, tok, "def add(a, b):\n    return", 12, temperature=0, out=open("/dev/null", "w"))
    for where in ("run", "hf"):
        pipe = transformers.pipeline("text-generation", model=str(tmp_path / where))
        got = pipe("def add(a, b):\n    return", max_new_tokens=12, do_sample=False)[0]["generated_text"]
        assert got == "def add(a, b):\n    return" + ours and "a + b" in ours, (where, got)


def test_bench_suite_hf_quick():
    from hybridlm.bench.suites import hf_suite
    res = hf_suite({"quick": True}, log=lambda *a: None)
    assert [r["arch"] for r in res["decode"]] == ["llama", "mamba2"]
    assert all(r["ours_tokens_per_s"] > 0 and r["wrapper_tokens_per_s"] > 0 for r in res["decode"])
