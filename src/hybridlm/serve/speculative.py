"""The engine's speculative step (`hybridlm serve --speculative`): every running row drafts K tokens, one forward of
the model checks all rows' drafts, and each row gets the drafts its sampler accepts plus the token after them
(models/speculative.py: drafters, acceptance rule, rollback).

At each checked position a row's distribution is the one `Engine._sample` would use there: penalties over prompt +
output + the drafts before that position, then temperature, top-k, top-p, min-p; greedy rows compare drafts with the
argmax. Rows hold their own lengths in the running batch, so with attention only each row keeps what it accepted
(the cache cuts every row at its own length). A recurrent state or a window ring cannot be cut: the batch is
restored and every row keeps as many drafts as the row that accepted fewest (each row's tokens are its own, so the
output is exact), fed again in one more forward.
A draft model keeps one batch-1 cache per request (`Request.draft`), rolled back the same way.
"""
import torch

from ..models.generation import filter_logits, penalize
from ..models.speculative import DraftRunner, ModelDrafter, NgramIndex, accept, rollback, snapshot


def _history(req) -> list[int]:
    return req.prompt + req.output


def _drafts(engine, live: list, k: int) -> list[list[int]]:
    """Each live request's drafts (at most k)."""
    d = engine.drafter
    out = []
    for r in live:
        if isinstance(d, ModelDrafter):
            if r.draft is None:
                r.draft = DraftRunner(d, 1, len(r.prompt) + r.params.max_tokens + d.k + 1, len(r.prompt), None)
            seq = torch.tensor([_history(r)], dtype=torch.long, device=engine.device)
            toks, q = r.draft.draft(seq, k, lambda logits, r=r: _draft_sample(r, logits))
            r.draft_q = q[0] if q is not None else None
            out.append(toks[0].tolist())
        else:
            if r.draft is None:
                r.draft = NgramIndex(d.max_n)
            r.draft.extend(_history(r)[len(r.draft.tokens):])
            out.append(r.draft.draft(k))
    return out


def _draft_sample(req, logits):
    """The draft model's token for `req` from logits [1, V]: its argmax for a greedy request, else a draw from its
    filtered distribution (returned too: the acceptance rule needs it)."""
    p = req.params
    if p.temperature == 0:
        return logits.argmax(-1), None
    dev = logits.device
    probs = torch.softmax(filter_logits(logits, torch.tensor([p.temperature], device=dev),
                                        top_k=torch.tensor([p.top_k or 0], device=dev),
                                        top_p=torch.tensor([p.top_p or 1.0], device=dev),
                                        min_p=torch.tensor([p.min_p], device=dev)), -1)
    return torch.multinomial(probs, 1, generator=req.generator)[:, 0], probs


def _target(engine, req, logits, drafts: list[int]):
    """The row's distribution at each checked position: logits [k+1, V] -> penalised logits (greedy) or sampling
    probabilities, the drafts before each position counted as output."""
    p, dev = req.params, logits.device
    x = logits.float()
    if p.penalized:
        seen, counts = engine._token_sets([req])
        k = len(drafts)
        d = torch.tensor(drafts, dtype=torch.long, device=dev)
        before = torch.zeros(k + 1, x.shape[-1], device=dev)
        if k:
            before[1:] = torch.zeros(k, x.shape[-1], device=dev).scatter_(1, d[:, None], 1.0).cumsum(0)
        rows = k + 1
        x = penalize(x, seen.expand(rows, -1) | (before > 0), counts + before,
                     *(torch.full((rows,), float(getattr(p, f)), device=dev)
                       for f in ("repetition_penalty", "presence_penalty", "frequency_penalty")))
    if p.temperature == 0:
        return x
    n = x.shape[0]
    return torch.softmax(filter_logits(x, torch.full((n,), p.temperature, device=dev),
                                       top_k=torch.full((n,), p.top_k or 0, dtype=torch.long, device=dev),
                                       top_p=torch.full((n,), p.top_p if p.top_p is not None else 1.0, device=dev),
                                       min_p=torch.full((n,), p.min_p, device=dev)), -1)


def speculative_decode(engine) -> bool:
    """One check of every running row of `engine` (the batch is set); False (nothing run) when no row has a draft, a
    row has no room for one or a row is constrained by a grammar, and the engine decodes one token plainly instead."""
    rows = engine.rows
    live = [r for r in rows if r is not None]
    if any(r.constraint is not None for r in live):
        return False             # a grammar's mask is not applied at checked positions yet: plain steps
    k = min(engine.drafter.k, min(r.params.max_tokens - len(r.output) for r in live) - 1)
    if k < 1:
        return False
    drafts = _drafts(engine, live, k)
    k = max(len(d) for d in drafts)
    if k == 0:                   # no lookup found anything (a draft model always drafts k)
        return False
    drafts = [d + [d[-1] if d else r.output[-1]] * (k - len(d)) for d, r in zip(drafts, live)]
    by_row = iter(drafts)
    ids = torch.tensor([[r.output[-1]] + next(by_row) if r is not None else [0] * (k + 1) for r in rows],
                       dtype=torch.long, device=engine.device)
    free = engine.table.free()
    if free:            # a free row's dummy tokens go to its columns 0.. at positions 0.. (as in `decode`)
        engine.batch.free(free)
    snap = snapshot(engine.batch)
    logits = engine.model.check_step(ids, engine.batch)          # [rows, k+1, V]
    at = engine.table.live()
    n_acc, nxt = [], []
    for j, (i, r) in enumerate(zip(at, live)):
        d = torch.tensor([drafts[j]], dtype=torch.long, device=engine.device)
        greedy = r.params.temperature == 0
        q = r.draft_q if isinstance(r.draft, DraftRunner) else None
        a, t = accept(_target(engine, r, logits[i], drafts[j])[None], d, q[None] if q is not None else None,
                      greedy=greedy, generator=None if greedy else [r.generator])
        n_acc.append(int(a))
        nxt.append(int(t))
    # each row keeps its last token and the drafts it accepted: cut per row where attention is all there is
    keep = torch.zeros(len(rows), dtype=torch.long)
    keep[at] = 1 + torch.tensor(n_acc)
    if not rollback(engine.batch, snap, keep.to(engine.device)):
        # restored: every row keeps as many drafts as the row that kept fewest, fed again in one forward (each
        # row's tokens are still its own: the token after them is its accepted draft or its correction)
        n = min(n_acc)
        kept = [n] * len(n_acc)
        nxt = [drafts[j][n] if a > n else t for j, (a, t) in enumerate(zip(n_acc, nxt))]
        engine.model.check_step(ids[:, :1 + n], engine.batch)
    else:
        kept = n_acc
    st = engine.spec_stats
    st.checks += 1
    st.rows += len(live)
    st.drafted += k * len(live)
    st.accepted += sum(n_acc)
    for j, (i, r) in enumerate(zip(at, live)):
        a = kept[j]
        _keep_draft(r, a, k)
        for pos, t in enumerate(drafts[j][:a] + [nxt[j]]):
            if r.finished:
                break
            engine.append_token(r, t, logits[i, pos])
            st.emitted += 1
    return True


def _keep_draft(req, n: int, k: int):
    """A draft model's cache keeps the drafts the check kept (n of k)."""
    if isinstance(req.draft, DraftRunner):
        req.draft.commit(n, k)
