"""The engine: one model, the cache of the running batch, per-request prefill caches and the prefix cache.

Plain Python, no HTTP and no threads (the scheduler drives it). One request's life:
  `start`    resume from the longest cached prefix of its prompt (its own batch-1 cache, joined from the prefix
             cache's chain) or start with no cache
  `prefill`  run the next chunk of a group of requests in one forward pass (`plan_prefill` groups them: first
             chunks of fresh prompts left-padded together, then each taken out into its own cache without the
             padding; a prompt under way runs alone in its own cache, nothing gathered or split; chunks end at
             `block` boundaries, where snapshots are taken); after the last chunk the first token is sampled
  `set_rows` move prefilled requests into the running batch and retire finished ones: one `InferenceCache` whose
             rows hold their own lengths (no padding); a new request is placed into a free row at column 0, the
             batch is rebuilt (`InferenceCache.concat`) only when no row is free or free rows pile up
  `decode`   one token for every running row in one forward pass (`CausalLM.decode_step`): the weights are read
             once per step for all rows, and each row's attention reads its own keys
The engine never asks which kind a layer's state is: the cache kinds move their rows, serve/slots.py only says
which request holds which row. Greedy decoding (temperature 0) gives what `CausalLM.generate` gives for the same
prompt: a batch of rows at their own lengths decodes each row as its own cache does, for every layout, and a
prefill in chunks (batched or not) equals one in one go. Memory is counted as allocated (`memory`), and admission
(`fits`) reserves what the requests in flight can come to hold (`peak_bytes`), a prefill chunk's activations
included.
"""
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..cache import InferenceCache, allocated_bytes
from ..errors import InputError
from ..models.generation import filter_logits, penalize
from ..models.speculative import ModelDrafter, SpecStats, check_draft_model, parse_speculative
from ..models.structured import mask_logits
from .fields import check_sampling
from .prefix_cache import PrefixCache, block_hashes
from .slots import RowTable
from .speculative import speculative_decode


@dataclass
class SamplingParams:
    """How one request samples. Penalties apply first (`repetition_penalty` over prompt + output tokens as
    transformers and vLLM: a positive logit divided, a negative one multiplied; `presence_penalty` /
    `frequency_penalty` over output tokens as OpenAI), then temperature, top-k, top-p, min-p. Temperature 0 is the
    argmax of the penalised logits. Log probabilities are of the raw model distribution (log_softmax of the logits
    before any of these), as OpenAI and vLLM report them."""
    max_tokens: int = 16              # 0: score only (with prompt_logprobs): finishes after prefill with "length"
    temperature: float = 1.0          # 0: greedy
    top_p: float | None = None
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None           # None: a random seed
    ignore_eos: bool = False
    logprobs: int | None = None       # k: each new token's logprob and its top-k alternatives (None: none)
    prompt_logprobs: int | None = None    # k: every prompt token's logprob (after the first) and the top-k

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


@dataclass
class TokenLogprob:
    """A token's log probability under the model and the `top` (token, logprob) alternatives, most likely first."""
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(eq=False)
class Request:
    """One generation. `on_token(request, token_id | None)` is called from the engine's thread for every new token
    (its `TokenLogprob` is already `logprobs[-1]` when asked for), then once with None when the request is finished
    (`finish_reason`: "stop" (end of text), "length" (max_tokens), "abort" (aborted or disconnected) or "error"
    (`error` says why)). `prompt_logprobs` (when asked for) is complete by the first callback: one entry per prompt
    token, None for the first."""
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    on_token: Callable | None = None
    id: str = ""
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    cached_tokens: int = 0            # prompt tokens resumed from the prefix cache
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    # its logits processor (models/structured.py's Constraint): masks the row's logits before sampling, accepts
    # each sampled token, and ends the request ("stop") once `finished`
    constraint: object = None
    # engine state
    cache: object = None              # its own batch-1 InferenceCache while it is prefilled
    prefilled: int = 0                # prompt tokens run so far
    passed_over: int = 0              # scheduler iterations its next chunk waited (its aging credit)
    keys: list = field(default_factory=list, repr=False)
    generator: object = None
    draft: object = None              # speculative decoding: its prompt-lookup index or draft-model cache
    draft_q: object = None            # the draft model's probabilities of its last drafts (sampled requests)
    aborted: bool = False             # set from any thread; the engine thread acts on it
    abort_reason: str = "abort"       # the finish reason it is retired with ("stop": the API met a stop string)
    # timings (time.perf_counter)
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def abort(self, reason: str = "abort"):
        if not self.aborted:          # the first reason stands
            self.abort_reason = reason
            self.aborted = True


class Engine:
    """model: a CausalLM in eval mode (quantized / CPU kernels already applied, on its device).
    eos_id: the end-of-text id (None: never stop early). block: prefill chunk and prefix-cache block, in tokens.
    prefix_cache_bytes: the prefix cache's budget (0: off). max_slots: rows decoded together at most.
    memory_bytes: budget for all inference state (None: only max_slots limits): the requests in flight at their
    largest, the running batch while it is rebuilt, a prefill chunk's activations, and the prefix cache (which gives
    way to requests).
    step_tokens: tokens run per scheduler iteration, decode rows and prefill chunks together (default 2 blocks).
    speculative: "ngram[:K]" or a `ModelDrafter` (models/speculative.py): each decode step checks K drafts per row in
    one forward (serve/speculative.py); `spec_stats` counts checks, drafts and accepted tokens."""

    def __init__(self, model, *, eos_id: int | None = None, block: int = 256, prefix_cache_bytes: int = 0,
                 max_slots: int = 16, memory_bytes: int | None = None, step_tokens: int | None = None,
                 speculative=None):
        if max_slots < 1:
            raise InputError(f"max_slots must be >= 1, got {max_slots}")
        if block < 1:
            raise InputError(f"prefix block must be >= 1, got {block}")
        self.model = model.eval()
        self.device = model.embed.weight.device
        self.eos_id = eos_id
        self.block = block
        self.max_slots = max_slots
        self.step_tokens = step_tokens if step_tokens is not None else 2 * block
        if self.step_tokens < 1:
            raise InputError(f"step_tokens must be >= 1, got {self.step_tokens}")
        self.context = model.config.max_seq_len
        self.prefix = PrefixCache(block, prefix_cache_bytes)
        self.batch = None                 # InferenceCache of the running rows (each at its own length)
        self.table = RowTable()           # the request of each batch row
        self.staged: dict[int, Request] = {}     # started, not yet in the batch (they may hold a prefill cache)
        # held by the scheduler's thread while it changes the state (prefill, batch, prefix cache); `memory()`
        # takes it, so a reader on another thread (the metrics) sees a consistent state
        self.lock = threading.RLock()
        self.drafter = parse_speculative(speculative)
        if isinstance(self.drafter, ModelDrafter):
            check_draft_model(model, self.drafter.model)
        self.spec_stats = SpecStats()
        self.layers = self._measure_state(model)
        # a draft model keeps a cache of its own per request (models/speculative.py's DraftRunner)
        self.draft_layers = self._measure_state(self.drafter.model) if isinstance(self.drafter, ModelDrafter) else []
        self.fixed_bytes = sum(f for f, _ in self.layers)
        self.token_bytes = sum(t for _, t in self.layers)
        # a prefill forward's transient bytes per token, from the model's sizes: the residual stream and a norm's
        # output (d each), the widest projection's output and its activation, a few of each alive at once
        d = model.config.d_model
        widest = max([d] + [m.out_features for m in model.blocks.modules()
                            if isinstance(getattr(m, "out_features", None), int)])
        self.act_token_bytes = 4 * (d + widest) * model.embed.weight.element_size()
        self.memory_bytes = memory_bytes
        if memory_bytes is not None and self.peak_bytes([2]) > memory_bytes:
            raise InputError(f"the memory budget ({memory_bytes} bytes) holds no request: one costs "
                             f"{self.peak_bytes([2])} bytes of state")

    @property
    def running(self) -> list[Request]:
        """The requests in the batch (free rows left out)."""
        return self.table.requests

    @property
    def rows(self) -> list[Request | None]:
        """The request of each batch row (None: a free row)."""
        return self.table.rows

    # ---------------------------------------------------------------- memory
    @torch.inference_mode()
    def _measure_state(self, model) -> list[tuple[int, int]]:
        """(fixed bytes, bytes per token) of every layer's state of one request of `model`: recurrent states, conv
        tails and window rings are fixed, attention K/V (and MLA latents) grow by the token. Measured on the real
        model (1 and 2 tokens)."""
        sizes = []
        for n in (1, 2):
            cache = model.make_cache(1)
            model(torch.zeros(1, n, dtype=torch.long, device=self.device), cache=cache, logits_to_keep=1)
            sizes.append([s.nbytes if s is not None else 0 for s in cache.layers])
        return [(a - (b - a), b - a) for a, b in zip(*sizes)]

    def slot_bytes(self, tokens: int) -> int:
        """Bytes of inference state of one request at `tokens` tokens."""
        return self.fixed_bytes + self.token_bytes * tokens

    def draft_bytes(self, tokens: int) -> int:
        """Bytes of a draft model's cache of one request of `tokens` tokens (0 without a draft model): it runs K + 1
        positions past the request's tokens at a check."""
        return sum(f + t * (tokens + self.row_tokens) for f, t in self.draft_layers)

    def prefill_tokens(self) -> int:
        """Tokens one prefill forward runs at most (padding included: `plan_prefill` keeps a group within it)."""
        return max(self.step_tokens, self.block)

    def activation_bytes(self, tokens: int, context: int) -> int:
        """Transient bytes of a prefill forward of `tokens` tokens over up to `context` keys, estimated from the
        model's sizes: per token the hidden activations (`act_token_bytes`), a float32 row of attention mask or
        scores over the context, and a float32 row of logits (all of them when prompt logprobs are asked for)."""
        return tokens * (self.act_token_bytes + 4 * context + 4 * self.model.config.vocab_size)

    def peak_bytes(self, lengths: list[int], batch_now: int = 0) -> int:
        """The most state requests of total lengths `lengths` (prompt + max_tokens) can hold at once: their own
        prefill caches (a request's at most its length; a group of fresh prompts runs in one cache padded to its
        longest first chunk before each row is taken out), the batch of one row each (dense [rows, cap] buffers
        with cap the longest length: each row holds its own tokens within it), during a rebuild or a growth of the
        time axis the old batch (`batch_now`, the bytes it holds) beside the new one layer at a time, the
        activations of one prefill forward, and each request's draft-model cache when one drafts."""
        if not lengths:
            return batch_now
        cap, rows = max(lengths), len(lengths)
        batch = rows * self.slot_bytes(cap)
        layer = rows * max(f + t * cap for f, t in self.layers)
        prefill = sum(self.slot_bytes(n) for n in lengths) + rows * self.slot_bytes(min(cap, self.block))
        drafts = sum(self.draft_bytes(n) for n in lengths)
        return prefill + max(batch, batch_now) + layer + drafts + self.activation_bytes(self.prefill_tokens(), cap)

    def in_flight(self) -> list[Request]:
        return self.running + list(self.staged.values())

    def fits(self, req: Request, admitted: list[Request] = ()) -> bool:
        """Whether `req` can start now, beside the requests in flight and those `admitted` but not started yet,
        within the memory budget (the prefix cache gives way to it)."""
        if self.memory_bytes is None:
            return True
        reqs = self.in_flight() + list(admitted) + [req]
        need = self.peak_bytes([len(r.prompt) + r.params.max_tokens for r in reqs], self.batch_bytes())
        if need > self.memory_bytes:
            return False
        with self.lock:
            self.prefix.shrink(self.memory_bytes - need)
        return True

    def _spare_bytes(self) -> int | None:
        """Bytes the budget leaves for the prefix cache now (None: no budget)."""
        if self.memory_bytes is None:
            return None
        reqs = self.in_flight()
        return self.memory_bytes - self.peak_bytes([len(r.prompt) + r.params.max_tokens for r in reqs],
                                                   self.batch_bytes())

    def batch_bytes(self) -> int:
        return allocated_bytes([self.batch]) if self.batch is not None else 0

    def memory(self) -> dict:
        """Bytes allocated now (storage, capacity and padding included): the running batch, the prefill caches of
        requests not yet in it, the prefix cache, and their sum `state_bytes` (each storage counted once)."""
        with self.lock:
            staged = [r.cache for r in self.staged.values() if r.cache is not None]
            parts = self.prefix.parts()
            return {"batch_bytes": self.batch_bytes(), "prefill_bytes": allocated_bytes(staged),
                    "prefix_cache_bytes": allocated_bytes(parts),
                    "state_bytes": allocated_bytes(([self.batch] if self.batch is not None else []) + staged + parts)}

    # ---------------------------------------------------------------- requests
    def validate(self, req: Request):
        """One InputError for a request the engine cannot run (checked before it is queued)."""
        p, V = req.params, self.model.config.vocab_size
        if not req.prompt:
            raise InputError("the prompt is empty")
        bad = next((t for t in req.prompt if not isinstance(t, int) or not 0 <= t < V), None)
        if bad is not None:
            raise InputError(f"token id {bad} is out of range for vocab_size {V}")
        if p.max_tokens < (0 if p.prompt_logprobs is not None else 1):
            raise InputError(f"max_tokens must be >= 1 (0 only to score the prompt), got {p.max_tokens}")
        if len(req.prompt) + p.max_tokens > self.context:
            raise InputError(f"the prompt ({len(req.prompt)} tokens) plus max_tokens ({p.max_tokens}) exceeds the "
                             f"model's context of {self.context} tokens")
        check_sampling(p)
        if isinstance(self.drafter, ModelDrafter) and \
                len(req.prompt) + p.max_tokens + self.drafter.k + 1 > self.drafter.model.config.max_seq_len:
            raise InputError(f"the prompt ({len(req.prompt)} tokens) plus max_tokens ({p.max_tokens}) exceeds the "
                             f"draft model's context of {self.drafter.model.config.max_seq_len} tokens")
        need = self.peak_bytes([len(req.prompt) + p.max_tokens])
        if self.memory_bytes is not None and need > self.memory_bytes:
            raise InputError(f"the request needs {need} bytes of state, more than the memory budget of "
                             f"{self.memory_bytes}")

    @torch.inference_mode()
    def start(self, req: Request):
        """Take `req` in: its prompt's longest cached prefix becomes its own cache (joined from the prefix cache's
        chain), or it starts with none (its first chunk is run with other fresh prompts). At most len(prompt) - 1
        tokens are resumed: the last prompt token's logits give the first new token."""
        n = len(req.prompt)
        self.staged[id(req)] = req
        seed = req.params.seed if req.params.seed is not None else int.from_bytes(os.urandom(7), "little")
        req.generator = torch.Generator(device=self.device).manual_seed(seed)
        req.keys = block_hashes(req.prompt, self.block) if self.prefix.max_bytes else []
        if req.params.prompt_logprobs is not None:    # they need the logits of every prompt position (as vLLM)
            return
        hit, parts = self.prefix.longest(req.keys[: (n - 1) // self.block])
        if hit:
            req.cache = InferenceCache.stitch(parts, extra=n - hit * self.block)
            req.prefilled = req.cached_tokens = hit * self.block

    def release(self, req: Request):
        """Free what `req` holds outside the batch (its prefill cache); its batch row is freed by `set_rows`."""
        self.staged.pop(id(req), None)
        req.cache = None

    def chunk(self, req: Request) -> int:
        """Tokens of `req`'s next prefill chunk: up to the next block boundary (where snapshots are taken)."""
        a = req.prefilled
        return min(len(req.prompt), (a // self.block + 1) * self.block) - a

    def plan_prefill(self, reqs: list[Request]) -> list[list[Request]]:
        """Group chunks that run in one forward pass: first chunks of fresh prompts (nothing run yet) together,
        left-padded to the longest, shortest first and each group within `prefill_tokens` padded tokens; a prompt
        under way alone, in its own cache (no padding after real tokens, which would enter conv tails and
        recurrent states, and no gathering of caches and splitting them back every chunk)."""
        fresh = sorted((r for r in reqs if r.prefilled == 0), key=self.chunk)
        groups, group = [], []
        for r in fresh:
            if group and (len(group) + 1) * self.chunk(r) > self.prefill_tokens():
                groups.append(group)
                group = []
            group.append(r)
        return groups + ([group] if group else []) + [[r] for r in reqs if r.prefilled > 0]

    @torch.inference_mode()
    def prefill(self, group: list[Request]):
        """Run the next chunk of every request of `group` (a group of `plan_prefill`) in one forward pass. After a
        request's last chunk its first new token is sampled into `output` (or, with max_tokens 0, it finishes with
        "length"). Prefix snapshots are taken at block boundaries."""
        chunks = [self.chunk(r) for r in group]
        T, B = max(chunks), len(group)
        ids = torch.zeros(B, T, dtype=torch.long)
        for i, (r, c) in enumerate(zip(group, chunks)):
            ids[i, T - c:] = torch.tensor(r.prompt[r.prefilled:r.prefilled + c])
        ids = ids.to(self.device)
        mask = None
        if group[0].prefilled == 0:                          # fresh prompts: an empty cache, left padding
            cache = self.model.make_cache(B, max_tokens=len(group[0].prompt) if B == 1 else None)
            if min(chunks) < T:
                mask = (torch.arange(T) >= T - torch.tensor(chunks)[:, None]).to(self.device)
        else:
            cache = group[0].cache                           # a prompt under way: alone, in its own cache
        scored = any(r.params.prompt_logprobs is not None for r in group)
        logits = self.model(ids, attention_mask=mask, cache=cache, logits_to_keep=None if scored else 1).logits
        for i, (r, c) in enumerate(zip(group, chunks)):
            # fresh prompts run together once: each row is then taken out, unpadded, with room for its prompt
            r.cache = cache if B == 1 else cache.take([i], cap=len(r.prompt))
            if r.params.prompt_logprobs is not None:
                self._prompt_logprobs(r, r.prefilled, logits[i, T - c:])
            r.prefilled += c
        del cache
        for r in group:
            self._snapshot(r)
        done = [i for i, r in enumerate(group) if r.prefilled == len(r.prompt)]
        for i in [i for i in done if group[i].params.max_tokens == 0]:
            group[i].finish_reason = "length"
        done = [i for i in done if group[i].params.max_tokens > 0]
        if done:
            self._sample([group[i] for i in done], logits[done, -1])

    def _snapshot(self, req: Request):
        """At a block boundary of its prompt, keep what `req`'s cache adds to the previous block's snapshot, if
        the prefix cache's budget and the memory budget leave room for it (checked before copying)."""
        b = req.prefilled
        k = b // self.block
        if b % self.block or not 0 < k <= len(req.keys) or req.keys[k - 1] in self.prefix:
            return
        parent = req.keys[k - 2] if k > 1 else None
        if parent is not None and parent not in self.prefix:
            return
        lo = (k - 1) * self.block
        size = req.cache.cut_bytes(lo)
        limit = self._spare_bytes()
        if self.prefix.room(size, limit):
            self.prefix.put(req.keys[k - 1], parent, req.cache.cut(lo), size, limit)

    def _prompt_logprobs(self, req: Request, a: int, logits):
        """Append the logprobs of prompt tokens a+1 .. a+T given the logits [T, V] of positions a .. a+T-1."""
        if a == 0:
            req.prompt_logprobs = [None]
        targets = req.prompt[a + 1:a + 1 + logits.shape[0]]
        lp = torch.log_softmax(logits[:len(targets)].float(), -1)
        req.prompt_logprobs += _logprobs(lp, targets, req.params.prompt_logprobs)

    @torch.inference_mode()
    def set_rows(self, rows: list[Request]):
        """Make `rows` the running requests: rows already in the batch keep their state, new ones bring the cache of
        their prefill (then released); rows not listed retire. A new request is placed into a free row at column 0
        (the batch's buffers grow to its prompt + max_tokens if they must, once per layer); the batch is rebuilt
        compactly when no row is free for it or free rows pile up, so every row always has room for all its
        tokens and the buffers never grow by doubling in between. A rebuild keeps a free row for each request
        still being prefilled (up to max_slots), so a burst of joins rebuilds the batch once, not once a join."""
        if not rows:
            self.clear()
            return
        gone = self.table.keep(rows)
        new = [r for r in rows if not self.table.holds(r)]
        cap = max(len(r.prompt) + r.params.max_tokens for r in rows)
        live, free = self.table.live(), self.table.free()
        idle, coming = len(free) - len(new), len(self.staged) - len(new)     # coming: prefilling, will join
        if self.batch is not None and live and 0 <= idle <= coming + (len(live) + len(new)) // 4 \
                and not self._too_long(cap):
            if gone:
                self.batch.free(gone)
            self.batch.reserve(cap)
            for r, i in zip(new, free):
                self.batch.place([i], r.cache)
                self.table.fill(i, r)
                self.release(r)
            return
        spare = max(0, min(coming, self.max_slots - len(live) - len(new)))
        sources = ([(self.batch, live)] if live else []) + [(r.cache, [0]) for r in new]
        if spare:                     # free rows shaped by a copy of the first new row (emptied just below)
            sources.append(sources[-1][:1] + ([sources[-1][1][-1]] * spare,))
        self.batch = InferenceCache.concat(sources, cap=cap, consume=True)
        self.table.compact(new + [None] * spare)
        if spare:
            self.batch.free(self.table.free())
        for r in new:
            self.release(r)

    def clear(self):
        """Drop the running batch (after a fault, or when nothing runs)."""
        self.batch = None
        self.table.clear()

    def _too_long(self, cap: int) -> bool:
        """Whether the batch's time axis has grown well past what its rows need (long requests retired): then a
        rebuild trims it."""
        room = self.batch.room
        return room is not None and self.batch.seen + room > 2 * cap + 64

    @property
    def row_tokens(self) -> int:
        """Positions a decode step runs per row: 1, or K + 1 when speculating (the check of K drafts)."""
        return 1 + (self.drafter.k if self.drafter is not None else 0)

    @torch.inference_mode()
    def decode(self):
        """One new token for every running row (one forward pass over the batch; free rows run a dummy token at
        position 0 and their output is dropped); with speculative decoding, one check of every row's drafts
        (serve/speculative.py), which may add several tokens to each row."""
        if self.drafter is not None and speculative_decode(self):
            return
        live = self.table.live()
        ids = torch.tensor([[r.output[-1] if r is not None else 0] for r in self.rows], dtype=torch.long,
                           device=self.device)
        if len(live) < len(self.rows):
            # a free row's dummy token goes to column 0 at position 0 (inside a learned position table), every step
            self.batch.free(self.table.free())
        logits = self.model.decode_step(ids, self.batch)
        self._sample([self.rows[i] for i in live], logits[live] if len(live) < len(self.rows) else logits)

    def _sample(self, reqs: list[Request], logits):
        """Sample each request's next token from logits [B, V] (its logprobs first, when asked for) and note
        whether it is finished. Penalties and filters run batched over the rows; only the draw is per row (each
        request has its own generator, so a seed gives the same tokens in any batch)."""
        ps = [r.params for r in reqs]
        dev = logits.device
        x = logits.float()
        held = [i for i, r in enumerate(reqs) if r.constraint is not None]
        if held:                      # the mask first: the penalties and filters see only the allowed tokens
            x = mask_logits(x.clone(), [reqs[i].constraint for i in held], held)
        pen = [i for i, p in enumerate(ps) if p.penalized]
        if pen:
            x = x.clone()
            x[pen] = penalize(x[pen], *self._token_sets([reqs[i] for i in pen]),
                              *(torch.tensor([getattr(ps[i], f) for i in pen], device=dev)
                                for f in ("repetition_penalty", "presence_penalty", "frequency_penalty")))
        tokens = x.argmax(-1).tolist()
        hot = [i for i, p in enumerate(ps) if p.temperature > 0]
        if hot:
            probs = torch.softmax(filter_logits(
                x[hot], torch.tensor([ps[i].temperature for i in hot], device=dev),
                top_k=torch.tensor([ps[i].top_k or 0 for i in hot], dtype=torch.long, device=dev),
                top_p=torch.tensor([ps[i].top_p if ps[i].top_p is not None else 1.0 for i in hot], device=dev),
                min_p=torch.tensor([ps[i].min_p for i in hot], device=dev)), -1)
            for j, i in enumerate(hot):
                tokens[i] = int(torch.multinomial(probs[j:j + 1], 1, generator=reqs[i].generator))
        want = [i for i, p in enumerate(ps) if p.logprobs is not None]
        if want:
            lp = torch.log_softmax(logits[want].float(), -1)
            for i, entry in zip(want, _logprobs(lp, [tokens[i] for i in want], max(ps[i].logprobs for i in want))):
                entry.top = entry.top[:ps[i].logprobs]
                reqs[i].logprobs.append(entry)
        now = time.perf_counter()
        for r, t in zip(reqs, tokens):
            self._append(r, t, now)

    def _append(self, r: Request, t: int, now: float):
        """Add token t to r's output and note whether r is finished."""
        r.output.append(t)
        if r.first_token_at is None:
            r.first_token_at = now
        if r.constraint is not None and (not r.constraint.accept(t) or r.constraint.finished):
            r.finish_reason = "stop"          # the grammar is complete (a rejected token cannot be sampled)
        elif t == self.eos_id and not r.params.ignore_eos:
            r.finish_reason = "stop"
        elif len(r.output) >= r.params.max_tokens:
            r.finish_reason = "length"

    def append_token(self, r: Request, t: int, logits):
        """A token checked by speculative decoding: its logprobs (from the raw logits [V] at its position) when asked
        for, then `_append`."""
        if r.params.logprobs is not None:
            entry = _logprobs(torch.log_softmax(logits[None].float(), -1), [t], r.params.logprobs)[0]
            r.logprobs.append(entry)
        self._append(r, t, time.perf_counter())

    def _token_sets(self, reqs: list[Request]):
        """(seen [B, V] bool: prompt or output tokens, counts [B, V] float: output tokens) of the requests."""
        V, dev = self.model.config.vocab_size, self.device
        seen = torch.zeros(len(reqs), V, dtype=torch.bool, device=dev)
        counts = torch.zeros(len(reqs), V, device=dev)
        for i, r in enumerate(reqs):
            seen[i, torch.tensor(r.prompt + r.output, device=dev)] = True
            if r.output:
                out = torch.tensor(r.output, device=dev)
                counts[i].index_add_(0, out, torch.ones(len(out), device=dev))
        return seen, counts


def _logprobs(lp, tokens: list[int], k: int) -> list[TokenLogprob]:
    """TokenLogprob of each row's token under log-probabilities lp [B, V], with the row's top-k alternatives."""
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    if k == 0:
        return [TokenLogprob(t, c) for t, c in zip(tokens, chosen)]
    top = lp.topk(min(k, lp.shape[-1]), -1)
    return [TokenLogprob(t, c, list(zip(ids, vals)))
            for t, c, ids, vals in zip(tokens, chosen, top.indices.tolist(), top.values.tolist())]
