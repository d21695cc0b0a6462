"""`hybridlm serve --speculative`: the engine checks every row's drafts in one forward; greedy output equals
`generate` (and the plain engine, penalties included) in a batch of mixed requests; a client gone in the middle of a
check strands nothing; /metrics counts checks and accepted drafts."""
import pytest
import torch

from hybridlm.models.speculative import ModelDrafter
from hybridlm.serve import Engine, Request, SamplingParams, Scheduler
from test_speculative import LAYOUTS, repeating_prompts, tiny_layout


def _prompts():
    return [repeating_prompts(1, n=n, reps=r, seed=s)[0].tolist() for n, r, s in ((5, 3, 1), (9, 2, 2), (3, 1, 3),
                                                                                    (12, 2, 4), (7, 3, 5))]


def _run(m, spec, params, arrive_late=True):
    eng = Engine(m, eos_id=None, block=8, max_slots=4, speculative=spec)
    sch = Scheduler(eng)
    reqs = [Request(p, sp) for p, sp in zip(_prompts(), params)]
    with torch.inference_mode():
        for r in reqs[:3]:
            sch.submit(r)
        for _ in range(3):
            sch.step()
        for r in reqs[3:]:                   # join a batch that is decoding
            sch.submit(r)
        sch.run_until_idle()
    return eng, reqs


# two layouts in the fast suite (a two-hop block: states and ring restored, the kept tokens fed again; MLA and an
# indexer: attention only, every row cut at its own acceptance), all in the slow one
@pytest.mark.parametrize("layout", [lay if lay in ("[RWM]", "LM IM") else pytest.param(lay, marks=pytest.mark.slow)
                                    for lay in LAYOUTS])
def test_greedy_engine_with_speculation_equals_generate(layout):
    m, other = tiny_layout(layout), tiny_layout(layout, seed=1)
    params = [SamplingParams(max_tokens=n, temperature=0) for n in (10, 7, 12, 5, 8)]
    params[2] = SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.3, frequency_penalty=0.5)
    params[4] = SamplingParams(max_tokens=8, temperature=0.8, top_k=20, min_p=0.05, seed=7)   # sampled, beside
    _, plain = _run(m, None, params)
    want = [m.generate(torch.tensor([p.prompt]), p.params.max_tokens, temperature=0)[0, len(p.prompt):].tolist()
            for p in plain]
    for spec in ("ngram:3", ModelDrafter(other, 2)):
        eng, reqs = _run(m, spec, params)
        for r, p, w in zip(reqs, plain, want):
            assert r.finish_reason == "length" and len(r.output) == r.params.max_tokens
            if r.params.temperature == 0 and not r.params.penalized:
                assert r.output == w, (layout, spec)
            elif r.params.temperature == 0:          # penalties over the drafts before each checked position
                assert r.output == p.output, (layout, spec)
        st = eng.spec_stats
        assert st.drafted >= st.accepted and (st.checks > 0 or spec == "ngram:3")


def test_a_client_gone_in_the_middle_of_a_check_strands_nothing():
    """A request aborted by its listener at the first of several tokens a check adds: retired at the next iteration,
    its row and draft state freed, the others unchanged."""
    m = tiny_layout("SM AM")
    eng = Engine(m, eos_id=None, block=8, max_slots=4, speculative=ModelDrafter(m, 3))   # agrees: 4 tokens a check
    sch = Scheduler(eng)
    ps = _prompts()[:3]
    reqs = [Request(p, SamplingParams(max_tokens=12, temperature=0)) for p in ps]
    gone = reqs[1]
    gone.on_token = lambda r, t: t is not None and len(r.output) >= 3 and r.abort()
    with torch.inference_mode():
        for r in reqs:
            sch.submit(r)
        sch.run_until_idle()
    assert gone.finish_reason == "abort" and len(gone.output) < 12
    for r in (reqs[0], reqs[2]):
        assert r.output == m.generate(torch.tensor([r.prompt]), 12, temperature=0)[0, len(r.prompt):].tolist()
    assert eng.batch is None and eng.memory()["batch_bytes"] == 0 and not sch.busy()
    assert eng.spec_stats.tokens_per_check > 2


def test_speculation_counts_in_metrics():
    m = tiny_layout("AM")
    eng = Engine(m, eos_id=None, block=8, max_slots=2, speculative="ngram:4")
    sch = Scheduler(eng)
    with torch.inference_mode():
        sch.submit(Request(repeating_prompts(1, n=6, reps=4)[0].tolist(), SamplingParams(max_tokens=20, temperature=0)))
        sch.run_until_idle()
    g = sch.gauges()
    st = eng.spec_stats
    assert g["spec_decode_num_drafts_total"][1] == st.checks > 0
    assert g["spec_decode_num_accepted_tokens_total"][1] == st.accepted
    assert 0 <= g["spec_decode_acceptance_rate"][1] <= 1 and g["spec_decode_tokens_per_step"][1] >= 1
    assert "hybridlm:spec_decode_num_drafts_total" in sch.metrics.render(g)


@pytest.mark.slow
def test_sampled_engine_checks_keep_the_distribution():
    """Many seeded requests of one prompt (vocabulary of 8) sampled with a presence penalty, temperature, top-k and
    min-p: the joint of their first two tokens (the second from a speculative check with prompt lookup) matches the
    model's penalised, filtered distribution."""
    from hybridlm.models.generation import filter_logits, penalize
    from test_speculative import _bound, _chi2
    V, N = 8, 1200
    m = tiny_layout("SM AM", vocab_size=V)
    prompt = [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    sp = dict(max_tokens=3, temperature=0.9, top_k=6, min_p=0.02, presence_penalty=0.7)

    def dist(logits, out):
        seen = torch.zeros(1, V, dtype=torch.bool)
        seen[0, prompt + out] = True
        counts = torch.zeros(1, V)
        for t in out:
            counts[0, t] += 1
        one = lambda v: torch.tensor([float(v)])       # noqa: E731
        x = penalize(logits[None], seen, counts, one(1), one(0.7), one(0))
        return torch.softmax(filter_logits(x, one(0.9), top_k=torch.tensor([6]), min_p=one(0.02)), -1)[0]
    with torch.inference_mode():
        p1 = dist(m(torch.tensor([prompt])).logits[0, -1], [])
        nxt = m(torch.tensor([prompt + [x] for x in range(V)])).logits[:, -1]
        want = torch.stack([p1[x] * dist(nxt[x], [x]) for x in range(V)])
    eng = Engine(m, eos_id=None, block=16, max_slots=256, step_tokens=4096, speculative="ngram:2")
    sch = Scheduler(eng, max_queue=N)
    reqs = [Request(prompt, SamplingParams(seed=i, **sp)) for i in range(N)]
    with torch.inference_mode():
        for r in reqs:
            sch.submit(r)
        sch.run_until_idle()
    assert eng.spec_stats.checks > 0 and eng.spec_stats.accepted > 0
    counts = torch.zeros(V, V)
    for r in reqs:
        counts[r.output[0], r.output[1]] += 1
    stat, dof = _chi2(counts, want)
    assert stat < _bound(dof), (stat, dof)


def test_a_request_past_the_draft_models_context_is_refused():
    from hybridlm.errors import InputError
    m = tiny_layout("AM")
    eng = Engine(m, eos_id=None, block=8, speculative=ModelDrafter(tiny_layout("AM", max_seq_len=32), 4))
    with pytest.raises(InputError, match="draft model's context"):
        eng.validate(Request(list(range(20)), SamplingParams(max_tokens=10)))
    eng.validate(Request(list(range(10)), SamplingParams(max_tokens=10)))


def test_the_token_budget_counts_a_checked_row_as_k_plus_one(monkeypatch):
    """A speculating row runs K + 1 positions a step: the prefill chunks beside it get what is left of step_tokens."""
    m = tiny_layout("[RWM]")
    plain, spec = (Engine(m, eos_id=None, block=8, max_slots=4, step_tokens=24, speculative=s)
                   for s in (None, "ngram:4"))
    assert (plain.row_tokens, spec.row_tokens) == (1, 5)
    picked = []
    for eng in (plain, spec):
        sch = Scheduler(eng)
        decoding = [Request([1, 2], SamplingParams(max_tokens=4)) for _ in range(2)]
        monkeypatch.setattr(type(eng), "running", property(lambda self: decoding))
        sch.prefilling.extend(Request(list(range(1, 30)), SamplingParams(max_tokens=4)) for _ in range(2))
        picked.append(len(sch._pick_chunks()))
    assert picked == [2, 1]          # 24 - 2 leaves room for two 8-token chunks; 24 - 2 * 5 for one


def test_the_memory_budget_counts_the_draft_models_cache():
    """A draft model's cache per request (its state at the request's length + K + 1) is part of the request's peak,
    as measured on a real cache of the draft model."""
    m, d = tiny_layout("SM AM"), tiny_layout("AM", seed=1)
    plain = Engine(m, eos_id=None, block=8)
    spec = Engine(m, eos_id=None, block=8, speculative=ModelDrafter(d, 3))
    with torch.inference_mode():
        cache = d.make_cache(1)
        d(torch.zeros(1, 40 + 4, dtype=torch.long), cache=cache, logits_to_keep=1)
    real = sum(s.nbytes for s in cache.layers if s is not None)
    assert spec.draft_bytes(40) == real > 0 and plain.draft_bytes(40) == 0
    assert spec.peak_bytes([40, 12]) - plain.peak_bytes([40, 12]) == spec.draft_bytes(40) + spec.draft_bytes(12)
