"""Fault injection: an op of the engine that raises once fails exactly the requests it touched (finish reason
"error", `error` naming the op), frees their state, and the scheduler goes on: every request ends, the queue
drains, the memory held returns to its level, the others' greedy output still equals `generate`."""
import pytest
import torch

from hybridlm.cache import InferenceCache
from hybridlm.models.speculative import ModelDrafter
from hybridlm.serve import Engine, Request, SamplingParams, Scheduler
from serve_helpers import tiny

PROMPTS = [(5, 6), (20, 4), (3, 4), (12, 3), (17, 5)]


def once(fn, touched: list, rows):
    """`fn` that raises the first time `rows(*args)` is not None, noting those rows as touched."""
    def f(*a, **k):
        hit = rows(*a, **k)
        if hit is not None and not touched:
            touched.extend(hit)
            raise RuntimeError("injected fault")
        return fn(*a, **k)
    return f


def inject(eng: Engine, path: str, touched: list, monkeypatch):
    if path == "set_rows":           # a rebuild or a join that raises (memory)
        monkeypatch.setattr(eng, "set_rows", once(eng.set_rows, touched, lambda rows: rows if any(
            r not in eng.running for r in rows) and eng.running else None))
    elif path == "decode":
        monkeypatch.setattr(eng, "decode", once(eng.decode, touched, lambda: eng.running or None))
    elif path == "prefill":
        monkeypatch.setattr(eng, "prefill", once(eng.prefill, touched, lambda g: g if len(g) > 1 else None))
    elif path == "sampling":         # the sampler, called by a decode step
        decoding = []
        decode = eng.decode

        def tracked():
            decoding.append(1)
            try:
                decode()
            finally:
                decoding.pop()
        monkeypatch.setattr(eng, "decode", tracked)
        monkeypatch.setattr(eng, "_sample", once(eng._sample, touched, lambda reqs, logits: eng.running
                                                 if decoding and len(reqs) > 1 else None))
    elif path == "snapshot":         # copying a prefix snapshot: the group being prefilled fails
        group = []
        prefill = eng.prefill
        monkeypatch.setattr(eng, "prefill", lambda g: group.__setitem__(slice(None), g) or prefill(g))
        monkeypatch.setattr(InferenceCache, "cut", once(InferenceCache.cut, touched, lambda c, lo: list(group)))
    elif path == "verify":           # the forward checking every row's drafts (after the snapshot)
        monkeypatch.setattr(eng.model, "check_step", once(eng.model.check_step, touched, lambda ids, cache: (
            eng.running if ids.shape[1] > 1 and len(eng.running) > 1 else None)))
    elif path == "start":            # resuming from the prefix cache
        monkeypatch.setattr(InferenceCache, "stitch", once(InferenceCache.stitch, touched, lambda parts, extra: [
            r for r in eng.staged.values() if r.cache is None and r.prefilled == 0][-1:] or None))


@pytest.mark.parametrize("path", ["set_rows", "decode", "prefill", "sampling", "snapshot", "start", "verify"])
def test_a_fault_fails_exactly_the_requests_it_touched(path, monkeypatch):
    m = tiny("mamba2-attention")
    # "verify": speculative decoding with a smaller draft model that agrees only in part (checks cut short)
    spec = ModelDrafter(tiny("mamba2-attention", n_layers=1), 2) if path == "verify" else None
    eng = Engine(m, eos_id=None, block=8, prefix_cache_bytes=1 << 24 if path in ("snapshot", "start") else 0,
                 max_slots=4, step_tokens=16, speculative=spec)
    sch = Scheduler(eng)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n, _ in PROMPTS]
    prompts.append(prompts[1][:16] + [1, 2])               # a prefix hit on the second prompt's two blocks
    reqs = [Request(p, SamplingParams(max_tokens=n, temperature=0)) for p, (_, n) in zip(prompts, PROMPTS + [(0, 3)])]
    ended = []
    for r in reqs:
        r.on_token = lambda req, t: t is None and ended.append(req)
    touched = []
    inject(eng, path, touched, monkeypatch)
    with torch.inference_mode():
        for r in reqs[:5]:
            sch.submit(r)
        while reqs[1].prefilled < 16 and not reqs[1].finished:
            sch.step()
        sch.submit(reqs[5])
        sch.run_until_idle()
    assert touched, f"the {path} fault never fired"
    assert sorted(map(id, ended)) == sorted(map(id, reqs))            # every request ended, once
    assert not sch.busy() and not sch.waiting and not sch.prefilling
    failed = [r for r in reqs if r.finish_reason == "error"]
    assert {id(r) for r in failed} == {id(r) for r in touched}
    assert all("injected fault" in r.error for r in failed)
    for r in reqs:
        if r.finish_reason != "error":
            n = r.params.max_tokens
            assert r.finish_reason == "length" and r.error is None
            assert r.output == m.generate(torch.tensor([r.prompt]), n, temperature=0)[0, len(r.prompt):].tolist()
    mem = eng.memory()
    assert mem["batch_bytes"] == mem["prefill_bytes"] == 0 and eng.staged == {} and eng.batch is None
    assert mem["state_bytes"] == mem["prefix_cache_bytes"]
    later = Request(prompts[0], SamplingParams(max_tokens=4, temperature=0))
    sch.submit(later)
    with torch.inference_mode():
        sch.run_until_idle()
    assert later.finish_reason == "length"
    assert later.output == m.generate(torch.tensor([prompts[0]]), 4, temperature=0)[0, len(prompts[0]):].tolist()
