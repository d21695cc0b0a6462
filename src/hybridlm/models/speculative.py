"""Speculative decoding: a cheap drafter proposes K tokens, one forward of the model checks them all, and the longest
prefix the model agrees with is kept, plus the model's own next token ("Fast Inference from Transformers via
Speculative Decoding", Leviathan, Kalman and Matias, 2023; "Accelerating Large Language Model Decoding with
Speculative Sampling", Chen et al., 2023). Decoding on a CPU reads every weight once per step whatever the tokens,
so checking K + 1 tokens costs about one token's step.

Acceptance (`accept`): greedy keeps drafts while they equal the model's argmax; sampling accepts draft x with
probability min(1, p(x) / q(x)) and on a rejection draws from max(0, p - q) renormalised, so the output
distribution is the model's p exactly (p after every sampler option; q the drafter's, one-hot for a lookup).

Drafters: `NgramDrafter` (prompt lookup: the tokens that followed the last earlier occurrence of the last n tokens,
n = 3, 2, 1) and `ModelDrafter` (a small `CausalLM` with the same vocabulary and its own cache).

Rollback (`snapshot`, `rollback`, on the cache's row operations): after a check the cache must hold exactly the
accepted tokens. Attention keys (KV, MLA latents, indexer keys) are cut at any length (`InferenceCache.trim`); a
recurrent slot (conv tail + state: S, R, G, K, C, B, two-hop blocks) or a window ring has no per-token history, so
it is copied before the check (`InferenceCache.snapshot`) and restored after a partial acceptance, and `decode`
feeds the accepted tokens again at the head of the next check (pending): a replay with no forward of its own.
`decode` runs the loop for `CausalLM.stream`; the server checks its rows the same way (serve/speculative.py).
"""
from dataclasses import dataclass

import torch
from torch import Tensor

from ..cache import InferenceCache
from ..errors import ConfigError, InputError
from .generation import filter_logits

DEFAULT_K = 4                 # drafts per check: ~the break-even of a CPU step's cost against acceptance


# ---------------------------------------------------------------------------------------------------- drafters
class NgramIndex:
    """Prompt lookup over one growing token sequence: `draft(k)` gives the (at most) k tokens that followed the last
    earlier occurrence of the sequence's last n tokens, trying n = max_n down to 1. Incremental: every n-gram is
    entered once, as the sequence grows, in a dict from n-gram to where it last ended."""

    def __init__(self, max_n: int = 3):
        self.max_n = max_n
        self.tokens: list[int] = []
        self.last: dict[tuple, int] = {}       # n-gram -> end index of its last occurrence before the current end

    def extend(self, tokens):
        for t in tokens:
            end = len(self.tokens) - 1         # the n-grams ending at the previous last token become searchable
            for n in range(1, self.max_n + 1):
                if end - n + 1 >= 0:
                    self.last[tuple(self.tokens[end - n + 1:end + 1])] = end
            self.tokens.append(int(t))

    def draft(self, k: int) -> list[int]:
        L = len(self.tokens)
        for n in range(min(self.max_n, L), 0, -1):
            end = self.last.get(tuple(self.tokens[L - n:]))
            if end is not None:
                return self.tokens[end + 1:end + 1 + k]
        return []


@dataclass
class NgramDrafter:
    """`ngram[:K]`: prompt lookup, K drafts per check (the draft distribution is one-hot)."""
    k: int = DEFAULT_K
    max_n: int = 3


@dataclass
class ModelDrafter:
    """A draft model: a small CausalLM with the target's vocabulary, K drafts per check (greedy when the target
    decodes greedily, else sampled from its own filtered distribution, which the acceptance rule corrects)."""
    model: object
    k: int = DEFAULT_K


def parse_speculative(spec, draft_model=None):
    """`speculative=` of generate / `--speculative` of serve -> a drafter. "ngram" | "ngram:K" | "draft" |
    "draft:K" (with `draft_model`), a dict {"model": CausalLM, "k": K} / {"ngram": K}, or a drafter itself."""
    if spec is None or isinstance(spec, (NgramDrafter, ModelDrafter)) or hasattr(spec, "propose"):
        return spec             # (an object with `k` and `propose(tokens, k) -> drafts`: a deterministic drafter)
    if isinstance(spec, dict):
        if "model" in spec:
            return ModelDrafter(spec["model"], _k(spec.get("k", DEFAULT_K)))
        if "ngram" in spec:
            return NgramDrafter(_k(spec["ngram"]))
        raise InputError(f"speculative: a dict names a draft 'model' (and 'k') or 'ngram': K, got keys {sorted(spec)}")
    if isinstance(spec, str):
        kind, _, k = spec.partition(":")
        k = _k(k) if k else DEFAULT_K
        if kind == "ngram":
            return NgramDrafter(k)
        if kind == "draft":
            if draft_model is None:
                raise InputError("speculative 'draft' needs a draft model (--draft-checkpoint RUN)")
            return ModelDrafter(draft_model, k)
    raise InputError(f"speculative must be 'ngram[:K]', 'draft[:K]' or a draft model, got {spec!r}")


def _k(k) -> int:
    try:
        k = int(k)
    except (TypeError, ValueError):
        raise InputError(f"speculative K (drafts per step) must be an integer, got {k!r}") from None
    if not 1 <= k <= 64:
        raise InputError(f"speculative K (drafts per step) must be in [1, 64], got {k}")
    return k


def check_draft_model(target, draft):
    """One ConfigError when `draft` cannot draft for `target` (same token ids: same vocabulary size)."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise ConfigError(f"the draft model's vocab_size {draft.config.vocab_size} differs from the model's "
                          f"{target.config.vocab_size}: a draft model must share the tokenizer")


class SpecStats:
    """Counters for /metrics and the bench: checks run, rows checked (a check of 3 rows counts 3), drafts checked,
    drafts accepted, tokens added."""

    def __init__(self):
        self.checks = self.rows = self.drafted = self.accepted = self.emitted = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_check(self) -> float:
        return self.emitted / self.rows if self.rows else 0.0


# ---------------------------------------------------------------------------------------------------- rollback
@dataclass
class Snapshot:
    """A cache's rows as they were before a check (`InferenceCache.snapshot`: attention lengths, copies of rings and
    recurrent states) and each row's length then."""
    state: object
    lengths: Tensor


def snapshot(cache: InferenceCache) -> Snapshot:
    """The state `rollback` returns to. The rows must be unpadded (`InferenceCache.take` drops left padding)."""
    return Snapshot(cache.snapshot(), cache.row_lengths().clone())


def rollback(cache: InferenceCache, snap: Snapshot, keep) -> bool:
    """Make every row of `cache` hold what it held at `snap` plus the first `keep` tokens fed since (an int, or [B]
    ints). True when every layer could cut its tokens (attention: `InferenceCache.trim`); False when a layer with no
    per-token history (a recurrent state, a window ring) made it restore `snap`: the caller then feeds the kept
    tokens again."""
    rows = torch.arange(cache.batch_size, device=cache.device)
    try:
        cache.trim(rows, snap.lengths + torch.as_tensor(keep, device=cache.device))
        cut = True
    except ValueError:                     # a layer without history (raised before the bookkeeping moves)
        cache.restore(snap.state)
        cut = False
    cache.settle()                         # the columns in use back to the longest row's
    return cut


# ---------------------------------------------------------------------------------------------------- acceptance
def accept(target: Tensor, drafts: Tensor, q: Tensor | None = None, *, greedy: bool,
           generator: torch.Generator | list | None = None) -> tuple[Tensor, Tensor]:
    """Check the k drafts [B, k] of B rows. target [B, k+1, V]: the model's logits (greedy: their argmax, penalties
    applied) or its sampling probabilities (every filter applied) before each draft and after the last. q [B, k, V]:
    the drafter's probabilities of what it drew from (None: one-hot, a deterministic drafter). `generator`: one for
    all rows or a list of one per row. Returns (n [B]: drafts accepted, next [B]: the token after them, the model's
    correction or its own next token)."""
    B, k = drafts.shape
    rows = torch.arange(B, device=target.device)
    if greedy:
        best = target.argmax(-1)
        n = (drafts == best[:, :k]).long().cumprod(1).sum(1)
        return n, best[rows, n]
    p_d = target[:, :k].gather(2, drafts[..., None])[..., 0]
    q_d = q.gather(2, drafts[..., None])[..., 0] if q is not None else torch.ones_like(p_d)
    if isinstance(generator, list):
        u = torch.stack([torch.rand(k, generator=g, device=target.device) for g in generator])
    else:
        u = torch.rand(B, k, generator=generator, device=target.device)
    n = (u * q_d < p_d).long().cumprod(1).sum(1)              # u < p / q, without dividing by a zero q
    dist = target[rows, n]
    at = n.clamp(max=max(k - 1, 0))
    if k:                                                      # rejected: draw from max(0, p - q) renormalised
        qn = q[rows, at] if q is not None else torch.zeros_like(dist).scatter_(1, drafts[rows, at][:, None], 1.0)
        res = (dist - qn).clamp(min=0)
        use = (n < k) & (res.sum(-1) > 0)
        dist = torch.where(use[:, None], res, dist)
    dist = dist / dist.sum(-1, keepdim=True)
    if isinstance(generator, list):
        nxt = torch.cat([torch.multinomial(dist[i], 1, generator=g) for i, g in enumerate(generator)])
    else:
        nxt = torch.multinomial(dist, 1, generator=generator)[:, 0]
    return n, nxt


# ---------------------------------------------------------------------------------------------------- the loop
class _Model:
    """A model, its cache and how many tokens of the sequence the cache holds (`fed`, the same for every row)."""

    def __init__(self, model, batch: int, max_tokens: int):
        self.model = model
        self.max_tokens = max_tokens
        self.cache = model.make_cache(batch, max_tokens=max_tokens)
        self.fed = 0
        self.snap: Snapshot | None = None
        self.step_fed = 0

    def run(self, ids: Tensor, mask: Tensor | None = None, keep_logits: int = 1, save: bool = False) -> Tensor:
        """Feed ids [B, T] (the snapshot taken first when `save`); logits of the last `keep_logits` positions."""
        if save:
            if self.cache.key_mask is not None:     # a left-padded prompt: rows at their own lengths from here
                self.cache = self.cache.take(range(self.cache.batch_size), cap=self.max_tokens)
            self.snap = snapshot(self.cache)
            self.step_fed = self.fed
        out = self.model(ids, attention_mask=mask, cache=self.cache, logits_to_keep=keep_logits).logits
        self.fed += ids.shape[1]
        return out

    def keep(self, n: int):
        """Of the tokens fed since the snapshot, keep the first n (the rest are rolled back)."""
        self.fed = self.step_fed + (n if rollback(self.cache, self.snap, n) else 0)
        self.snap = None


class DraftRunner:
    """A `ModelDrafter` over a batch: its own cache follows the sequence, rolled back like the model's."""

    def __init__(self, drafter: ModelDrafter, batch: int, max_tokens: int, prompt: int, mask: Tensor | None):
        self.m = _Model(drafter.model, batch, max_tokens)
        self.mask = mask
        self.prompt = prompt

    def draft(self, seq: Tensor, k: int, sampler) -> tuple[Tensor, Tensor | None]:
        """k drafts [B, k] for seq [B, L] and the probabilities they were drawn from [B, k, V] (None: greedy)."""
        m = self.m
        if m.fed == 0:            # the (left-padded) prompt first: a snapshot holds a prefilled cache
            m.run(seq[:, :self.prompt], self.mask)
        logits = m.run(seq[:, m.fed:], save=True)[:, -1]
        drafts, probs = [], []
        for i in range(k):
            tok, pr = sampler(logits)
            drafts.append(tok)
            probs.append(pr)
            if i + 1 < k:
                logits = m.run(tok[:, None])[:, -1]
        q = torch.stack(probs, 1) if probs[0] is not None else None
        return torch.stack(drafts, 1), q

    def commit(self, accepted: int, k: int):
        """The model kept `accepted` of the k drafts: keep what this cache fed of the sequence so far (nothing to do
        when it drafted nothing since)."""
        if self.m.snap is None:
            return
        fed_now = self.m.fed - self.m.step_fed             # pending part + drafts 1..k-1
        self.m.keep(fed_now - (k - 1) + min(accepted, k - 1))


@torch.inference_mode()
def decode(model, input_ids: Tensor, max_new_tokens: int, spec, *, temperature: float = 1.0,
           top_k: int | None = None, top_p: float | None = None, attention_mask: Tensor | None = None,
           generator: torch.Generator | None = None, max_pending: int | None = None, stats: SpecStats | None = None):
    """Yield lists of new token ids [B] (one list per check: the accepted drafts and the token after them) for
    `CausalLM.stream`. Every row keeps the same number of tokens per check (the fewest any row accepted: exact,
    each row's tokens are its own), so one cache serves the batch. `max_pending` bounds a check's length: accepted
    tokens still to replay plus drafts (default 2(K + 1)). `stats` (a SpecStats) counts the checks."""
    drafter = parse_speculative(spec)
    B, L0 = input_ids.shape
    K = drafter.k
    max_pending = max_pending or 2 * (K + 1)
    total = L0 + max_new_tokens
    greedy = temperature == 0
    if isinstance(drafter, ModelDrafter):
        from .quantize import cpu_kernels_by_default_
        check_draft_model(model, drafter.model)
        cpu_kernels_by_default_(drafter.model)
        if total > drafter.model.config.max_seq_len:
            raise InputError(f"prompt + max_new_tokens ({total}) exceeds the draft model's max_seq_len "
                             f"{drafter.model.config.max_seq_len}")
    dev = input_ids.device

    def probs(logits: Tensor) -> Tensor:         # [N, V] -> sampling probabilities, every filter applied
        N = logits.shape[0]
        t = torch.full((N,), temperature, device=dev)
        return torch.softmax(filter_logits(logits, t, top_k=torch.full((N,), top_k or 0, device=dev, dtype=torch.long),
                                           top_p=torch.full((N,), top_p if top_p is not None else 1.0, device=dev)), -1)

    def sampler(logits: Tensor):                 # [B, V] -> (tokens [B], probabilities [B, V] or None)
        if greedy:
            return logits.argmax(-1), None
        pr = probs(logits)
        return torch.multinomial(pr, 1, generator=generator).squeeze(-1), pr

    target = _Model(model, B, total)
    first = target.run(input_ids, attention_mask)[:, -1]
    tok, _ = sampler(first)
    seq = torch.cat((input_ids, tok[:, None]), 1)
    yield [tok]
    emitted = 1
    runner = DraftRunner(drafter, B, total, L0, attention_mask) if isinstance(drafter, ModelDrafter) else None
    index = [NgramIndex(drafter.max_n) for _ in range(B)] if isinstance(drafter, NgramDrafter) else None
    if index is not None:
        for i in range(B):
            real = input_ids[i] if attention_mask is None else input_ids[i][attention_mask[i].bool()]
            index[i].extend(real.tolist() + [int(tok[i])])
    while emitted < max_new_tokens:
        pending = seq[:, target.fed:]
        p = pending.shape[1]
        k = max(0, min(K, max_new_tokens - emitted - 1, max_pending - p))
        q = None
        if k and runner is not None:
            drafts, q = runner.draft(seq, k, sampler)
        elif k:
            rows = [ix.draft(k) for ix in index] if index is not None else \
                [drafter.propose(seq[i].tolist(), k)[:k] for i in range(B)]
            k = max(len(r) for r in rows)
            drafts = torch.tensor([r + [r[-1] if r else int(seq[i, -1])] * (k - len(r)) for i, r in enumerate(rows)],
                                  dtype=torch.long, device=dev).view(B, k)
        if not k:        # nothing to check: an ordinary step (it also replays what is pending)
            logits = target.run(pending)[:, -1]
            new = [sampler(logits)[0]]
        else:
            logits = target.run(torch.cat((pending, drafts), 1), keep_logits=k + 1, save=True)
            target_p = logits.float() if greedy else probs(logits.flatten(0, 1)).view(logits.shape)
            acc, nxt = accept(target_p, drafts, q, greedy=greedy, generator=generator)
            n = int(acc.min())
            last = torch.where(acc > n, drafts[:, min(n, k - 1)], nxt)
            new = [drafts[:, j] for j in range(n)] + [last]
            target.keep(p + n)
            if runner is not None:
                runner.commit(n, k)
            if stats is not None:
                stats.checks += 1
                stats.rows += B
                stats.drafted += k * B
                stats.accepted += int(acc.sum())
                stats.emitted += (n + 1) * B
        new = new[:max_new_tokens - emitted]
        seq = torch.cat([seq] + [t[:, None] for t in new], 1)
        if index is not None:
            for i in range(B):
                index[i].extend([int(t[i]) for t in new])
        emitted += len(new)
        yield new
