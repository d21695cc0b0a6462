"""Speculative decoding (models/speculative.py): drafters, the acceptance rule, exact rollback of every cache kind,
and generate's output with it equal to generate's without (greedy) or equal in distribution (sampled)."""
import warnings

import pytest
import torch

from hybridlm import CausalLM, presets
from hybridlm.errors import ConfigError, InputError
from hybridlm.models.generation import filter_logits
from hybridlm.models.speculative import NgramIndex, accept, parse_speculative, rollback, snapshot

TINY = dict(d_model=32, n_heads=4, vocab_size=257, ssd_headdim=8, ssd_d_state=8, ssd_chunk_size=8, max_seq_len=128,
            rodimus_d_state=8, swa_window=8, mlp_hidden=None, mamba1_d_state=4)
# every letter with a cache or none: A W S R G K C B L I F Z, M O E, and the two-hop block
LAYOUTS = ["SM RM", "AM WM", "GM CM", "KM BM", "LM IM", "FM AO AE", "ZM SM", "[RWM]"]


def tiny_layout(layout: str, seed: int = 0, **kw) -> CausalLM:
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # fields of letters this layout leaves out
        return CausalLM(presets.get("transformer++", **{**TINY, "layout": layout, **kw})).eval()


def repeating_prompts(B: int, n: int = 12, reps: int = 3, vocab: int = 257, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, n), generator=g).repeat(1, reps)


def test_ngram_index_drafts_what_followed_the_last_match():
    ix = NgramIndex(max_n=3)
    ix.extend([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7])
    assert ix.draft(3) == [9, 2, 6]              # [6, 7] last ended at 6 (not at the end itself): 9 2 6 follow
    ix.extend([9])
    assert ix.draft(2) == [2, 6]                 # [6, 7, 9] seen once before
    ix.extend([4])
    assert ix.draft(4) == []                     # 4 never seen before
    one = NgramIndex()
    one.extend([3])
    assert one.draft(2) == []


def test_parse_speculative_errors():
    assert parse_speculative("ngram").k == 4 and parse_speculative("ngram:7").k == 7
    for bad in ("ngram:0", "ngram:x", "beam", "draft"):
        with pytest.raises(InputError, match="speculative"):
            parse_speculative(bad)
    m, d = tiny_layout("AM"), tiny_layout("AM", vocab_size=97)
    with pytest.raises(ConfigError, match="vocab_size"):
        m.generate(torch.zeros(1, 3, dtype=torch.long), 4, temperature=0, speculative={"model": d})
    with pytest.raises(ConfigError, match="speculative"):
        m.generate(torch.zeros(1, 3, dtype=torch.long), 4, temperature=0, speculative="ngram", compile=True)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fed,keep", [(6, 2), (10, 3)])
def test_rollback_leaves_the_state_after_the_last_kept_token(layout, fed, keep):
    """Feed some tokens after a snapshot, keep the first few: the cache then continues exactly as one that saw only
    those (cut in place where every slot can be cut, else restored and the kept tokens fed again)."""
    m = tiny_layout(layout)
    ids = torch.randint(0, 257, (2, 30))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.inference_mode():
        ref, c = m.make_cache(2), m.make_cache(2)
        m(ids[:, :12], attention_mask=mask[:, :12], cache=ref)
        m(ids[:, :12], attention_mask=mask[:, :12], cache=c)
        m(ids[:, 12:12 + keep], cache=ref)
        c = c.take([0, 1])                              # row operations take unpadded rows
        snap = snapshot(c)
        m(ids[:, 12:12 + fed], cache=c)
        held = keep if rollback(c, snap, keep) else 0
        if held == 0:
            m(ids[:, 12:12 + keep], cache=c)
        assert torch.equal(c.row_lengths(), ref.row_lengths()) and torch.equal(c.next_pos, ref.next_pos)
        nxt = ids[:, 25:28]
        torch.testing.assert_close(m(nxt, cache=c).logits, m(nxt, cache=ref).logits, atol=2e-5, rtol=1e-5)
    # attention is cut in place; recurrent states and window rings are restored
    cut = not any(ch in "SRGKCBW" for ch in layout)
    assert held == (keep if cut else 0)


@pytest.mark.parametrize("layout", [lay if lay in ("SM RM", "GM CM", "[RWM]", "AM WM")
                                    else pytest.param(lay, marks=pytest.mark.slow) for lay in LAYOUTS])
def test_greedy_speculative_equals_greedy(layout):
    """Prompt lookup, a draft model that always agrees (the model itself) and one that mostly does not: the same
    tokens as plain greedy decoding, at batch 1 and in a left-padded batch."""
    m, other = tiny_layout(layout), tiny_layout(layout, seed=1)
    one = repeating_prompts(1)
    ref = m.generate(one, 24, temperature=0)
    for spec in ("ngram:4", {"model": m, "k": 3}, {"model": other, "k": 2}):
        assert torch.equal(m.generate(one, 24, temperature=0, speculative=spec), ref), spec
    batch = repeating_prompts(3, seed=2)
    mask = torch.ones_like(batch)
    mask[0, :5], mask[2, :11] = 0, 0
    ref = m.generate(batch, 12, temperature=0, attention_mask=mask)
    for spec in ("ngram:3", {"model": other, "k": 3}):
        got = m.generate(batch, 12, temperature=0, attention_mask=mask, speculative=spec)
        assert torch.equal(got, ref), spec


def test_speculative_stops_at_eos_and_max_tokens():
    m = tiny_layout("SM AM")
    ids = repeating_prompts(2)
    ref = m.generate(ids, 25, temperature=0)
    eos = int(ref[0, ids.shape[1] + 3])
    want = m.generate(ids, 25, temperature=0, eos_token_id=eos)
    got = m.generate(ids, 25, temperature=0, eos_token_id=eos, speculative="ngram")
    assert torch.equal(got, want)
    for n in (1, 2, 5):
        assert m.generate(ids, n, temperature=0, speculative="ngram").shape[1] == ids.shape[1] + n


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of observed counts against probabilities (cells expecting < 5 pooled) and its dof."""
    n = counts.sum()
    e, o = probs.flatten() * n, counts.flatten().double()
    small = e < 5
    e = torch.cat((e[~small], e[small].sum()[None])) if small.any() else e
    o = torch.cat((o[~small], o[small].sum()[None])) if small.any() else o
    keep = e > 0
    return float(((o[keep] - e[keep]) ** 2 / e[keep]).sum()), int(keep.sum()) - 1


def _bound(dof: int) -> float:
    return dof + 6 * (2 * dof) ** 0.5          # ~6 standard deviations: fails on a wrong rule, not by chance


def test_acceptance_rule_keeps_the_distribution():
    """A two-token 'model' p(x1) p(x2 | x1) and a drafter q(x1) q(x2 | x1) that differs: the first two tokens the
    rule emits (the accepted drafts, then the correction; a second token after a first-position rejection is drawn
    from p as the next step would) follow p, for a sampled drafter and a deterministic (one-hot) one."""
    V, N = 4, 20000
    g = torch.Generator().manual_seed(0)
    p1, p2 = torch.softmax(torch.randn(V, generator=g) * 2, -1), torch.softmax(torch.randn(V, V, generator=g) * 2, -1)
    p3 = torch.softmax(torch.randn(V, V, V, generator=g), -1)
    q1, q2 = torch.softmax(torch.randn(V, generator=g), -1), torch.softmax(torch.randn(V, V, generator=g), -1)
    want = p1[:, None] * p2
    for sampled in (True, False):
        if sampled:
            d1 = torch.multinomial(q1, N, replacement=True, generator=g)
            d2 = torch.multinomial(q2[d1], 1, generator=g)[:, 0]
            q = torch.stack((q1.expand(N, V), q2[d1]), 1)
        else:
            d1, d2, q = torch.full((N,), 2), torch.full((N,), 1), None
        target = torch.stack((p1.expand(N, V), p2[d1], p3[d1, d2]), 1)
        n, t = accept(target, torch.stack((d1, d2), 1), q, greedy=False, generator=g)
        first = torch.where(n > 0, d1, t)
        second = torch.where(n > 1, d2, torch.where(n == 1, t, torch.multinomial(p2[first], 1, generator=g)[:, 0]))
        counts = torch.zeros(V, V).index_put_((first, second), torch.ones(N), accumulate=True)
        stat, dof = _chi2(counts, want)
        assert stat < _bound(dof), (sampled, stat, dof)
        if sampled:    # and it is a test that can fail: the drafts taken as they come are far off
            draws = torch.zeros(V, V).index_put_((d1, d2), torch.ones(N), accumulate=True)
            assert _chi2(draws, want)[0] > _bound(dof)
    best, nxt = accept(torch.eye(V)[[1, 2, 3]][None], torch.tensor([[1, 0]]), greedy=True)
    assert (int(best), int(nxt)) == (1, 2)


@pytest.mark.parametrize("spec", ["ngram:3", "draft"])
def test_sampled_speculative_keeps_the_models_distribution(spec):
    """Many rows of one prompt sampled at temperature 0.9 with top-k 5 and top-p 0.95 (vocabulary of 8): the joint
    of the first two new tokens matches the model's filtered distribution, with prompt lookup and with a draft
    model. The rollback runs in between (a check with partial acceptance restores the recurrent state)."""
    V, N = 8, 2000
    m = tiny_layout("SM AM", vocab_size=V)
    spec = {"model": tiny_layout("SM AM", seed=3, vocab_size=V), "k": 2} if spec == "draft" else spec
    prompt = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]])
    kw = dict(temperature=0.9, top_k=5, top_p=0.95)

    def dist(logits):
        x = filter_logits(logits, torch.full((logits.shape[0],), 0.9), top_k=torch.full((logits.shape[0],), 5),
                          top_p=torch.full((logits.shape[0],), 0.95))
        return torch.softmax(x, -1)
    with torch.inference_mode():
        p1 = dist(m(prompt).logits[:, -1])[0]
        nxt = torch.cat((prompt.repeat(V, 1), torch.arange(V)[:, None]), 1)
        p2 = dist(m(nxt).logits[:, -1])
    out = m.generate(prompt.repeat(N, 1), 4, generator=torch.Generator().manual_seed(1), speculative=spec, **kw)
    counts = torch.zeros(V, V)
    counts.index_put_((out[:, -4], out[:, -3]), torch.ones(N), accumulate=True)
    stat, dof = _chi2(counts, p1[:, None] * p2)
    assert stat < _bound(dof), (stat, dof)


def test_bench_suite_gives_the_forced_answers(tmp_path):
    """`bench --suite speculative --quick`: a check that keeps r of K drafts adds r + 1 tokens (fewer only where the
    generation ends), the forced rows' acceptance is r / K, and every run reproduced the greedy output."""
    import json

    from hybridlm.cli import main
    out = tmp_path / "spec.json"
    assert main(["bench", "--suite", "speculative", "--quick", "--models", "llama:2M", "--threads", "1",
                 "--new-tokens", "13", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["models"]["llama:2M"]["rows"]
    assert rows["forced 0/3"]["acceptance"] == 0 and rows["forced 0/3"]["tokens_per_check"] == 1
    assert rows["forced 3/3"]["acceptance"] == 1 and rows["forced 3/3"]["tokens_per_check"] == 4
    assert 0.3 <= rows["forced 1/3"]["acceptance"] <= 0.4 and rows["forced 1/3"]["tokens_per_check"] == 2
