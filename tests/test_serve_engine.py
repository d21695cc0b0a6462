"""The serving engine without HTTP: continuous batching and the prefix cache give what `generate` gives."""
import re
import time

import pytest
import torch

from conftest import assert_close
from hybridlm import presets
from hybridlm.errors import InputError
from hybridlm.cache import InferenceCache
from hybridlm.serve import Engine, QueueFull, Request, SamplingParams, Scheduler
from serve_helpers import FAMILIES, tiny, tiny_layout

# every other preset family (sizes of one family and Doge's 16,384 experts left out), as slow tests
MORE = [n for n in presets.names() if n not in FAMILIES and n != "doge" and not re.search(r"-(\d|wt103)", n)]


def run_mixed(m, block=8, prefix_bytes=1 << 24, max_slots=3):
    """Prompts of mixed lengths: two start, four join mid-flight (one shares two blocks of an earlier prompt, one
    is longer than a block); -> (requests, prompts, new-token counts, engine)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 19, 9, 12, 3)]
    prompts.append(prompts[1][:16] + [3, 4, 5])
    ns = [7, 4, 9, 5, 6, 5]
    eng = Engine(m, eos_id=None, block=block, prefix_cache_bytes=prefix_bytes, max_slots=max_slots)
    sch = Scheduler(eng)
    reqs = [Request(p, SamplingParams(max_tokens=n, temperature=0)) for p, n in zip(prompts, ns)]
    with torch.inference_mode():
        for r in reqs[:2]:
            sch.submit(r)
        sch.step()
        sch.step()
        for r in reqs[2:]:
            sch.submit(r)
        sch.run_until_idle()
    return reqs, prompts, ns, eng


@pytest.mark.parametrize("name", FAMILIES + [pytest.param(n, marks=pytest.mark.slow) for n in MORE])
def test_continuous_batching_greedy_equals_generate(name):
    m = tiny(name)
    reqs, prompts, ns, eng = run_mixed(m)
    assert eng.prefix.hits == 1 and reqs[-1].cached_tokens == 16
    for r, p, n in zip(reqs, prompts, ns):
        assert r.finish_reason == "length"
        assert r.output == m.generate(torch.tensor([p]), n, temperature=0)[0, len(p):].tolist(), (name, len(p))
    assert eng.batch is None and eng.rows == []          # every row retired, the state freed


@pytest.mark.parametrize("name", ["mamba2-attention"])
def test_prefix_hit_gives_identical_output(name):
    m = tiny(name)
    with_hit = run_mixed(m)[0]
    without = run_mixed(m, prefix_bytes=0)[0]
    assert [r.output for r in with_hit] == [r.output for r in without]
    assert with_hit[-1].cached_tokens == 16 and without[-1].cached_tokens == 0


@pytest.mark.parametrize("name", ["rodimus++", "mamba2-attention", "deepseek-mla"])
def test_rows_at_their_own_lengths_decode_like_their_own_caches(name):
    """A batch concatenated from caches of different lengths (each row at its own length, no padding) decodes every
    row exactly as its own cache does; rows taken out of it keep doing so."""
    m = tiny(name)
    g = torch.Generator().manual_seed(0)
    caches, ids = [], []
    with torch.inference_mode():
        for n in (3, 11, 6):
            c = m.make_cache(1)
            m(torch.randint(0, 256, (1, n), generator=g), cache=c)
            caches.append(c)
            ids.append(torch.randint(0, 256, (1, 1), generator=g))
        batch = InferenceCache.concat([(c, [0]) for c in caches], cap=16)
        assert batch.lengths.tolist() == [3, 11, 6] and batch.seen == 11
        own = torch.cat([m.decode_step(i, c.take([0])) for i, c in zip(ids, caches)])
        assert_close(m.decode_step(torch.cat(ids), batch), own, atol=1e-5, msg=name)
        sub = batch.take([2, 0])                # two rows out: the longest row's columns go with it
        assert sub.seen == 7 and sub.lengths.tolist() == [7, 4]
        nxt = torch.randint(0, 256, (2, 1), generator=g)
        for c, i in zip(caches, ids):          # advance the own caches by the token the batch saw
            m.decode_step(i, c)
        ref = torch.cat([m.decode_step(nxt[j:j + 1], caches[k]) for j, k in enumerate((2, 0))])
        assert_close(m.decode_step(nxt, sub), ref, atol=1e-5, msg=name)


def test_seeded_sampling_matches_generate():
    m = tiny("mamba2")
    p = [5, 6, 7, 8]
    eng = Engine(m, eos_id=None, block=8)
    sch = Scheduler(eng)
    r = Request(p, SamplingParams(max_tokens=6, temperature=0.9, top_k=50, top_p=0.9, seed=3))
    sch.submit(r)
    with torch.inference_mode():
        sch.run_until_idle()
    ref = m.generate(torch.tensor([p]), 6, temperature=0.9, top_k=50, top_p=0.9,
                     generator=torch.Generator().manual_seed(3))[0, 4:].tolist()
    assert r.output == ref


def test_eos_stops_unless_ignored():
    m = tiny("mamba2")
    first = m.generate(torch.tensor([[1, 2, 3]]), 1, temperature=0)[0, -1].item()
    eng = Engine(m, eos_id=first, block=8)
    sch = Scheduler(eng)
    a = Request([1, 2, 3], SamplingParams(max_tokens=5, temperature=0))
    b = Request([1, 2, 3], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    sch.submit(a)
    sch.submit(b)
    with torch.inference_mode():
        sch.run_until_idle()
    assert (a.output, a.finish_reason) == ([first], "stop")
    assert len(b.output) == 5 and b.finish_reason == "length"


def test_validation_queue_abort_and_budget():
    m = tiny("transformer++")
    eng = Engine(m, eos_id=None, block=8, max_slots=1)
    sch = Scheduler(eng, max_queue=2)
    for bad, msg in (([], "empty"), ([300], "out of range"), ([1] * 120, "context")):
        with pytest.raises(InputError, match=msg):
            sch.submit(Request(bad, SamplingParams(max_tokens=10)))
    with pytest.raises(InputError, match="max_tokens"):
        sch.submit(Request([1], SamplingParams(max_tokens=0)))
    a, b = Request([1, 2], SamplingParams(max_tokens=50, temperature=0)), Request([3], SamplingParams(max_tokens=2))
    sch.submit(a)
    sch.submit(b)
    with pytest.raises(QueueFull):
        sch.submit(Request([4], SamplingParams(max_tokens=2)))
    with torch.inference_mode():
        sch.step()
        sch.step()
        assert eng.running == [a] and b.output == []     # one slot: b waits
        n = len(a.output)
        sch.abort(a)
        sch.step()                                     # a leaves before the next decode step; b takes its slot
        assert a.finish_reason == "abort" and len(a.output) == n and b.output
        sch.run_until_idle()
    assert b.finish_reason == "length"
    # a memory budget: attention K/V grows with the tokens, so two long requests do not fit where two short ones do
    eng = Engine(m, eos_id=None, block=8, max_slots=8, memory_bytes=None)
    eng.memory_bytes = (eng.peak_bytes([64]) + eng.peak_bytes([64, 64])) // 2     # one fits, two do not
    sch = Scheduler(eng)
    for _ in range(2):
        sch.submit(Request([1] * 32, SamplingParams(max_tokens=32, temperature=0)))
    with torch.inference_mode():
        sch.step()
    assert len(sch.prefilling) + len(eng.rows) == 1 and len(sch.waiting) == 1
    with pytest.raises(InputError, match="memory budget"):
        sch.submit(Request([1] * 60, SamplingParams(max_tokens=60)))


def test_state_per_slot_recurrent_fixed_attention_grows():
    rec = Engine(tiny("rodimus"), block=8)
    att = Engine(tiny("transformer++"), block=8)
    assert rec.token_bytes == 0 and rec.fixed_bytes > 0
    assert att.token_bytes > 0 and att.slot_bytes(4096) > att.slot_bytes(128)


@pytest.mark.parametrize("name", ["rodimus++", "mamba2-attention", "deepseek-mla"])
def test_a_joining_request_takes_a_free_row_in_place(name):
    """A request that joins where one retired is written into the free row at column 0 (the batch is not rebuilt;
    its buffers grow if the request needs more columns) and every row still decodes as its own cache does; a
    rebuild keeps free rows for the requests still being prefilled, and one with no free row rebuilds the batch."""
    m = tiny(name)
    eng = Engine(m, block=64)
    g = torch.Generator().manual_seed(0)
    reqs = [Request(torch.randint(0, 256, (n,), generator=g).tolist(), SamplingParams(max_tokens=20, temperature=0))
            for n in (9, 14, 4, 6, 30)]
    for r in reqs[:4]:
        eng.start(r)
        eng.prefill([r])
    own = {id(r): r.cache.take([0]) for r in reqs[:4]}
    eng.set_rows(reqs[:3])
    batch = eng.batch
    assert eng.rows == reqs[:3] + [None]             # a free row kept for reqs[3], still to join
    eng.start(reqs[4])
    eng.prefill([reqs[4]])
    eng.set_rows([reqs[0], reqs[2], reqs[3]])        # reqs[1] retires, reqs[3] takes a free row
    assert eng.batch is batch and eng.rows == [reqs[0], reqs[3], reqs[2], None]
    eng.decode()
    with torch.inference_mode():
        for r in (reqs[0], reqs[3], reqs[2]):
            t = m.decode_step(torch.tensor([[r.output[0]]]), own[id(r)]).argmax(-1).item()
            assert r.output[1] == t, name
    eng.set_rows([reqs[0], reqs[2], reqs[3], reqs[4]])   # 30 tokens, placed: the buffers grow in place
    assert eng.batch is batch and eng.rows == [reqs[0], reqs[3], reqs[2], reqs[4]]
    eng.decode()
    late = Request([1, 2, 3], SamplingParams(max_tokens=2, temperature=0))
    eng.start(late)
    eng.prefill([late])
    eng.set_rows([reqs[0], reqs[2], reqs[3], reqs[4], late])     # no free row: a rebuild
    assert eng.batch is not batch and eng.batch.batch_size == 5
    eng.decode()
    assert [len(r.output) for r in reqs[2:] + [late]] == [4, 4, 3, 2]


def test_an_engine_fault_fails_the_requests_in_flight_not_the_server():
    m = tiny("mamba2")
    eng = Engine(m, block=8)
    sch = Scheduler(eng)
    sch.start()
    try:
        done = []
        broken = eng.decode
        eng.decode = lambda: (_ for _ in ()).throw(RuntimeError("boom"))
        r = Request([1, 2, 3], SamplingParams(max_tokens=5), on_token=lambda req, t: t is None and done.append(req))
        sch.submit(r)
        for _ in range(500):
            if done:
                break
            time.sleep(0.01)
        assert r.finish_reason == "error" and "boom" in r.error
        eng.decode = broken
        r2 = Request([1, 2, 3], SamplingParams(max_tokens=3), on_token=lambda req, t: t is None and done.append(req))
        sch.submit(r2)
        for _ in range(500):
            if len(done) == 2:
                break
            time.sleep(0.01)
        assert r2.finish_reason == "length"
    finally:
        sch.stop()


def _run(m, reqs, **kw):
    eng = Engine(m, eos_id=None, **{"block": 8, **kw})
    sch = Scheduler(eng)
    for r in reqs:
        sch.submit(r)
    with torch.inference_mode():
        sch.run_until_idle()
    return eng


@pytest.mark.parametrize("name", FAMILIES)
def test_logprobs_are_the_raw_model_distribution(name):
    """Each new token's logprob (and its top-k) and every prompt token's are log_softmax of one full forward pass
    over prompt + output; asking for prompt logprobs skips the prefix cache (the positions must all be run)."""
    m = tiny(name)
    g = torch.Generator().manual_seed(2)
    p = torch.randint(0, 256, (19,), generator=g).tolist()
    warm = Request(p, SamplingParams(max_tokens=1, temperature=0))
    r = Request(p, SamplingParams(max_tokens=5, temperature=0.8, seed=1, logprobs=3, prompt_logprobs=2))
    score = Request(p, SamplingParams(max_tokens=0, prompt_logprobs=0))
    eng = _run(m, [warm], prefix_cache_bytes=1 << 24)
    sch = Scheduler(eng)
    for q in (r, score):
        sch.submit(q)
    with torch.inference_mode():
        sch.run_until_idle()
        full = torch.log_softmax(m(torch.tensor([p + r.output])).logits[0].float(), -1)
    assert r.cached_tokens == 0 and eng.prefix.hits == 0
    assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(p)
    for j, e in enumerate(r.prompt_logprobs[1:], 1):
        assert e.token == p[j] and abs(e.logprob - full[j - 1, p[j]].item()) < 1e-4
        assert [t for t, _ in e.top] == full[j - 1].topk(2).indices.tolist()
    assert [e.token for e in r.logprobs] == r.output
    for j, e in enumerate(r.logprobs):
        row = full[len(p) - 1 + j]
        assert abs(e.logprob - row[e.token].item()) < 1e-4 and len(e.top) == 3
        assert_close(torch.tensor([v for _, v in e.top]), row.topk(3).values, atol=1e-4)
    assert score.finish_reason == "length" and score.output == [] and len(score.prompt_logprobs) == len(p)
    assert all(e.top == [] for e in score.prompt_logprobs[1:])
    assert [e.logprob for e in score.prompt_logprobs[1:]] == pytest.approx(
        [e.logprob for e in r.prompt_logprobs[1:]], abs=1e-5)


def test_penalties_and_min_p():
    """Greedy with penalties is the argmax of the penalised logits (checked step by step against a plain loop);
    min_p 1 keeps only the most likely token, so sampling with it is greedy."""
    m = tiny("mamba2")
    p = [5, 6, 7, 5, 5]
    sp = dict(repetition_penalty=1.7, presence_penalty=0.5, frequency_penalty=0.7)
    r = Request(p, SamplingParams(max_tokens=8, temperature=0, **sp))
    mp = Request(p, SamplingParams(max_tokens=8, temperature=1.5, min_p=1.0, seed=4))
    plain = Request(p, SamplingParams(max_tokens=8, temperature=0))
    _run(m, [r, mp, plain])
    out = []
    with torch.inference_mode():
        for _ in range(8):
            x = m(torch.tensor([p + out])).logits[0, -1].float()
            seen = torch.zeros_like(x, dtype=torch.bool)
            seen[p + out] = True
            x = torch.where(seen, torch.where(x > 0, x / 1.7, x * 1.7), x)
            for t in set(out):
                x[t] -= 0.5 + 0.7 * out.count(t)
            out.append(int(x.argmax()))
    assert r.output == out and r.output != plain.output
    assert mp.output == plain.output


def test_sampling_rows_of_one_batch_keep_their_seeds():
    """Requests with different settings sampled as rows of one batch give what each gives alone."""
    m = tiny("transformer++")
    kinds = [dict(temperature=0.9, top_k=20, seed=1), dict(temperature=1.2, top_p=0.8, seed=2),
             dict(temperature=0.7, min_p=0.1, seed=3), dict(temperature=0, repetition_penalty=1.3)]
    together = [Request([1, 2, 3, 4], SamplingParams(max_tokens=6, **k)) for k in kinds]
    _run(m, together)
    for r, k in zip(together, kinds):
        alone = Request([1, 2, 3, 4], SamplingParams(max_tokens=6, **k))
        _run(m, [alone])
        assert alone.output == r.output, k


def test_sampling_validation():
    eng = Engine(tiny("mamba2"), block=8)
    for kw, msg in ((dict(min_p=1.5), "min_p"), (dict(repetition_penalty=0), "repetition_penalty"),
                    (dict(presence_penalty=3), "presence_penalty"), (dict(logprobs=21), "logprobs"),
                    (dict(max_tokens=0), "max_tokens")):
        with pytest.raises(InputError, match=msg):
            eng.validate(Request([1, 2], SamplingParams(**kw)))
    eng.validate(Request([1, 2], SamplingParams(max_tokens=0, prompt_logprobs=1)))


LAYOUTS = ["SM RM", "AM WM", "GM CM", "KM BM", "LM IM", "FM AO AE", "ZM SM"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batched_prefill_of_mixed_lengths_equals_generate(layout):
    """Prompts of mixed lengths arriving together are prefilled several per forward pass (fresh ones left-padded
    together, later chunks grouped by length) and greedy output still equals `generate`, with and without a
    prefix hit."""
    m = tiny_layout(layout)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 30, 9, 17, 12, 1, 24)]
    late = prompts[1][:16] + [7, 8, 9]
    eng = Engine(m, eos_id=None, block=8, prefix_cache_bytes=1 << 24, max_slots=8, step_tokens=40)
    sch = Scheduler(eng)
    sizes = []
    plan = eng.plan_prefill
    eng.plan_prefill = lambda reqs: [sizes.append(len(grp)) or grp for grp in plan(reqs)]
    reqs = [Request(p, SamplingParams(max_tokens=5, temperature=0)) for p in prompts]
    with torch.inference_mode():
        for r in reqs:
            sch.submit(r)
        while reqs[1].prefilled < 16:
            sch.step()
        hit = Request(late, SamplingParams(max_tokens=5, temperature=0))
        sch.submit(hit)
        sch.run_until_idle()
    assert max(sizes) >= 4                                   # several prompts in one forward pass
    assert hit.cached_tokens == 16
    for r in reqs + [hit]:
        assert r.output == m.generate(torch.tensor([r.prompt]), 5, temperature=0)[0, len(r.prompt):].tolist(), \
            (layout, len(r.prompt))


def test_a_short_prompt_is_not_left_behind_a_long_one():
    """A short prompt that arrives just after a long one gets its first token long before the long one
    finishes its prefill (fewest tokens left first), and the long one still progresses (aging)."""
    m = tiny("transformer++")
    eng = Engine(m, eos_id=None, block=8, max_slots=4, step_tokens=8)
    sch = Scheduler(eng)
    long = Request(list(range(1, 100)), SamplingParams(max_tokens=20, temperature=0))
    short = Request([5, 6, 7], SamplingParams(max_tokens=20, temperature=0))
    with torch.inference_mode():
        sch.submit(long)
        sch.step()
        sch.submit(short)
        for i in range(3):
            sch.step()
        assert short.output and not long.output and long.prefilled > 8
        sch.run_until_idle()
    assert long.finish_reason == short.finish_reason == "length"


def test_memory_counts_what_is_allocated():
    """The engine's memory figures are the bytes of the storage held (capacity and padding included); the batch
    stays within the bound the budget admits by; a prefix snapshot stores only its own block of K/V."""
    m = tiny("mamba2-attention")
    eng = Engine(m, eos_id=None, block=8, prefix_cache_bytes=1 << 24, max_slots=4)
    sch = Scheduler(eng)
    base = eng.memory()["state_bytes"]
    assert base == 0
    p = list(range(1, 41))
    reqs = [Request(p[:n], SamplingParams(max_tokens=6, temperature=0)) for n in (40, 11, 25)]
    seen = []
    with torch.inference_mode():
        for r in reqs:
            sch.submit(r)
        while sch.busy():
            sch.step()
            mem = eng.memory()
            seen.append(mem)
            lengths = [len(r.prompt) + r.params.max_tokens for r in reqs]
            assert mem["batch_bytes"] + mem["prefill_bytes"] <= eng.peak_bytes(lengths)
    assert max(s["batch_bytes"] for s in seen) > eng.slot_bytes(46)   # several rows at their capacity
    # 40 tokens at block 8: five snapshots, chained; each holds one block of attention K/V plus the fixed states
    assert len(eng.prefix.entries) == 5
    attn = [i for i, (f, t) in enumerate(eng.layers) if t]
    for part in eng.prefix.parts():
        assert all(part.layers[i].k.shape[1] == 8 for i in attn)
    assert eng.memory()["prefix_cache_bytes"] == eng.prefix.nbytes
    assert eng.memory()["state_bytes"] == eng.prefix.nbytes       # the requests' state is all freed
    eng.prefix.clear()
    assert eng.memory()["state_bytes"] == 0


def test_snapshots_give_way_to_the_memory_budget():
    """With a budget that the requests in flight fill, no snapshot is made (and none is copied)."""
    m = tiny("transformer++")
    eng = Engine(m, eos_id=None, block=8, prefix_cache_bytes=1 << 24, max_slots=4)
    eng.memory_bytes = eng.peak_bytes([40 + 4])
    r = Request(list(range(1, 41)), SamplingParams(max_tokens=4, temperature=0))
    sch = Scheduler(eng)
    sch.submit(r)
    with torch.inference_mode():
        sch.run_until_idle()
    assert r.finish_reason == "length" and len(eng.prefix.entries) == 0
    eng.memory_bytes = None
    sch.submit(Request(list(range(1, 41)), SamplingParams(max_tokens=4, temperature=0)))
    with torch.inference_mode():
        sch.run_until_idle()
    assert len(eng.prefix.entries) == 5


@pytest.mark.parametrize("layout", ["AM WM", "LM IM", "SM RM"])
def test_a_batch_of_prompts_from_5_to_300_tokens_equals_generate(layout):
    """Prompts of 5 to 300 tokens in one running batch, some arriving while others decode: each row holds its own
    length (the batch is never padded to the longest) and greedy output equals `generate` for every request."""
    m = tiny_layout(layout, max_seq_len=320)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 300, 37, 9, 211)]
    eng = Engine(m, eos_id=None, block=64, max_slots=4, step_tokens=96)
    sch = Scheduler(eng)
    reqs = [Request(p, SamplingParams(max_tokens=6, temperature=0)) for p in prompts]
    ragged = []
    with torch.inference_mode():
        for r in reqs[:3]:
            sch.submit(r)
        for _ in range(3):
            sch.step()
        for r in reqs[3:]:
            sch.submit(r)
        while sch.busy():
            sch.step()
            if eng.batch is not None and eng.batch.lengths is not None:
                ragged.append(eng.batch.lengths.tolist())
    assert any(max(n) - min(n) > 100 for n in ragged)          # rows far apart in length shared a batch
    for r in reqs:
        assert r.output == m.generate(torch.tensor([r.prompt]), 6, temperature=0)[0, len(r.prompt):].tolist(), \
            (layout, len(r.prompt))


def test_serve_bench_decode_figures(monkeypatch):
    """The serve bench's decode figures at a tiny size: each case's batch is the server's (rows at their own
    lengths for the mixed prompts, on one time axis for equal ones), every case decodes on the one clock, and the
    ratios are the documented arithmetic of its readings."""
    from hybridlm.bench import measure
    from hybridlm.bench.serve import burst_lengths, decode_figures
    m = tiny("transformer++", max_seq_len=256)
    seen, fake = {}, {"1x8": 1.0, "4x8": 2.0, "4 mixed 8-64": 3.0, "4x30": 2.5}

    def clock(fns, repeats, warmup):
        for name, fn in fns.items():
            eng = fn.args[0]                                            # partial(_decode_steps, engine, steps)
            seen[name] = (eng.batch.batch_size, eng.batch.lengths)
            fn()                                                        # real decode steps
            assert all(len(r.output) == 1 + 2 for r in eng.running)
        return {name: [fake[name] * 2] for name in fns}
    monkeypatch.setattr(measure, "clock", clock)
    out = decode_figures(m, prompt_len=8, burst=4, burst_min=8, burst_max=64, steps=2, log=lambda *_: None)
    assert burst_lengths(4, 8, 64) == [8, 16, 32, 64] and out["mean_length"] == 30
    assert seen["4 mixed 8-64"][1].tolist() == [8, 16, 32, 64] and seen["4x30"] == (4, None)
    assert seen["1x8"][0] == 1 and seen["4x8"] == (4, None)
    assert out["streams_vs_1"] == 2.0 and out["mixed_vs_equal"] == 1.2
    assert out["step_s"]["1x8"] == 1.0
