"""The engine: one model, the cache of the running batch, per-request prefill caches and the prefix cache.

Plain Python, no HTTP and no threads (the scheduler drives it). One request's life:
  `start`    look up the prompt's longest cached prefix and make its own batch-1 cache (a copy of the snapshot)
  `prefill`  run the next chunk of its prompt (chunks end at `block` boundaries, where snapshots are taken);
             after the last chunk the first token is sampled
  `set_rows` move prefilled requests into the running batch and retire finished ones: one left-padded
             `InferenceCache` [rows, time] for all (serve/slots.py aligns rows of different lengths); a new
             request takes a free row in place, and the batch is rebuilt only when it must be
  `decode`   one token for every running row in one forward pass: the weights are read once per step for all rows
Greedy decoding (temperature 0) gives what `CausalLM.generate` gives for the same prompt: batched, left-padded
decoding equals single decoding for every layout, and a prefill in chunks equals one in one go.
"""
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import InputError
from ..models.generation import filter_logits, penalize
from .prefix_cache import PrefixCache, block_hashes
from .slots import first_real, gather, place


MAX_LOGPROBS = 20                     # alternatives per token at most (OpenAI's top_logprobs bound)


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
    # engine state
    cache: object = None              # its own batch-1 InferenceCache while it is prefilled
    prefilled: int = 0                # prompt tokens run so far
    keys: list = field(default_factory=list, repr=False)
    generator: object = None
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
    memory_bytes: budget for the inference state of all requests in flight (None: only max_slots limits)."""

    def __init__(self, model, *, eos_id: int | None = None, block: int = 256, prefix_cache_bytes: int = 0,
                 max_slots: int = 16, memory_bytes: int | None = None):
        if max_slots < 1:
            raise InputError(f"max_slots must be >= 1, got {max_slots}")
        if block < 1:
            raise InputError(f"prefix block must be >= 1, got {block}")
        self.model = model.eval()
        self.device = model.embed.weight.device
        self.eos_id = eos_id
        self.block = block
        self.max_slots = max_slots
        self.context = model.config.max_seq_len
        self.prefix = PrefixCache(block, prefix_cache_bytes)
        self.batch = None                 # InferenceCache of the running rows
        self.rows: list[Request | None] = []     # the request of each batch row (None: a free row)
        self.lock = threading.Lock()      # held by the engine's thread while it steps (readers: metrics)
        self.fixed_bytes, self.token_bytes = self._measure_state()
        self.memory_bytes = memory_bytes
        if memory_bytes is not None and self.slot_bytes(1) > memory_bytes:
            raise InputError(f"the memory budget ({memory_bytes} bytes) holds no request: one costs "
                             f"{self.slot_bytes(1)} bytes of state")

    @property
    def running(self) -> list[Request]:
        """The requests in the batch (free rows left out)."""
        return [r for r in self.rows if r is not None]

    # ---------------------------------------------------------------- memory
    @torch.inference_mode()
    def _measure_state(self) -> tuple[int, int]:
        """(fixed bytes, bytes per token) of one request's state: recurrent states, conv tails and window rings are
        fixed, attention K/V (and MLA latents) grow by the token. Measured on the real model (1 and 2 tokens)."""
        sizes = []
        for n in (1, 2):
            cache = self.model.make_cache(1)
            self.model(torch.zeros(1, n, dtype=torch.long, device=self.device), cache=cache, logits_to_keep=1)
            sizes.append(cache.nbytes)
        return sizes[0] - (sizes[1] - sizes[0]), sizes[1] - sizes[0]

    def slot_bytes(self, tokens: int) -> int:
        """Bytes of inference state of one request at `tokens` tokens."""
        return self.fixed_bytes + self.token_bytes * tokens

    def request_bytes(self, req: Request) -> int:
        """What a request may come to hold: its state at prompt + max_tokens tokens."""
        return self.slot_bytes(len(req.prompt) + req.params.max_tokens)

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
        if p.temperature < 0:
            raise InputError(f"temperature must be >= 0, got {p.temperature}")
        if p.top_p is not None and not 0 < p.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {p.top_p}")
        if p.top_k is not None and p.top_k < 1:
            raise InputError(f"top_k must be >= 1, got {p.top_k}")
        if not 0 <= p.min_p <= 1:
            raise InputError(f"min_p must be in [0, 1], got {p.min_p}")
        if not p.repetition_penalty > 0:
            raise InputError(f"repetition_penalty must be > 0, got {p.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(p, name) <= 2:
                raise InputError(f"{name} must be in [-2, 2], got {getattr(p, name)}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(p, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise InputError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")
        if self.memory_bytes is not None and self.request_bytes(req) > self.memory_bytes:
            raise InputError(f"the request needs {self.request_bytes(req)} bytes of state, more than the memory "
                             f"budget of {self.memory_bytes}")

    @torch.inference_mode()
    def start(self, req: Request):
        """Give `req` its own cache: a copy of the longest cached prefix of its prompt, or an empty one. At most
        len(prompt) - 1 tokens are resumed: the last prompt token's logits give the first new token."""
        n = len(req.prompt)
        req.keys = block_hashes(req.prompt, self.block) if self.prefix.max_bytes else []
        # prompt logprobs need the logits of every prompt position: no resuming past them (as vLLM)
        hit, snap = (0, None) if req.params.prompt_logprobs is not None else \
            self.prefix.longest(req.keys[: (n - 1) // self.block])
        # the prompt only: the request decodes in the batch's cache
        if snap is not None:
            req.cache = gather([(snap, [0])], extra=n - hit * self.block)
            req.prefilled = req.cached_tokens = hit * self.block
        else:
            req.cache = self.model.make_cache(1, max_tokens=n)
        seed = req.params.seed if req.params.seed is not None else int.from_bytes(os.urandom(7), "little")
        req.generator = torch.Generator(device=self.device).manual_seed(seed)

    @torch.inference_mode()
    def prefill(self, req: Request) -> int:
        """Run the next chunk of `req`'s prompt (up to the next block boundary); returns the tokens run. After the
        last chunk the first new token is sampled into `req.output`. Snapshots go to the prefix cache at block
        boundaries."""
        n = len(req.prompt)
        a = req.prefilled
        b = min(n, (a // self.block + 1) * self.block)
        ids = torch.tensor([req.prompt[a:b]], dtype=torch.long, device=self.device)
        scored = req.params.prompt_logprobs is not None
        logits = self.model(ids, cache=req.cache, logits_to_keep=None if scored else 1).logits
        if scored:
            self._prompt_logprobs(req, a, logits[0])
        req.prefilled = b
        if b % self.block == 0 and b // self.block <= len(req.keys):
            key = req.keys[b // self.block - 1]
            if key not in self.prefix:
                self.prefix.put(key, gather([(req.cache, [0])]))
        if b == n:
            if req.params.max_tokens == 0:
                req.finish_reason = "length"
            else:
                self._sample([req], logits[:, -1])
        return b - a

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
        their prefill (then released); rows not listed retire. A new request takes a free row in place when one is
        there and its prompt fits the batch's time axis; otherwise (or when free rows or padding pile up) the batch
        is rebuilt compactly."""
        if not rows:
            self.batch, self.rows = None, []
            return
        wanted = {id(r) for r in rows}
        slots = [r if r is not None and id(r) in wanted else None for r in self.rows]
        have = {id(r) for r in slots if r is not None}
        new = [r for r in rows if id(r) not in have]
        free = [i for i, r in enumerate(slots) if r is None]
        if self.batch is not None and new and len(new) <= len(free) \
                and all(r.cache.seen <= self.batch.seen for r in new):
            for r, i in zip(new, free):
                place(self.batch, i, r.cache)
                slots[i] = r
                r.cache = None
            new = []
        live = [i for i, r in enumerate(slots) if r is not None]
        dead = len(slots) - len(live)
        if not new and live and dead <= len(live) // 4 and not self._padded(live):
            self.rows = slots
            return
        sources = ([(self.batch, live)] if live else []) + [(r.cache, [0]) for r in new]
        self.batch = gather(sources, extra=16)
        self.rows = [slots[i] for i in live] + new
        for r in new:
            r.cache = None

    def _padded(self, live: list[int]) -> bool:
        """Whether the batch's time axis has grown well past what its live rows need (rows that joined in place
        and retired rows leave columns of padding): then a rebuild trims it."""
        span = int((self.batch.seen - first_real(self.batch)[live]).max())
        return self.batch.seen > 2 * span + 64

    @torch.inference_mode()
    def decode(self):
        """One new token for every running row (one forward pass over the batch; free rows run a dummy token at
        position 0 and their output is dropped)."""
        live = [i for i, r in enumerate(self.rows) if r is not None]
        ids = torch.tensor([[r.output[-1] if r is not None else 0] for r in self.rows], dtype=torch.long,
                           device=self.device)
        if len(live) < len(self.rows):
            dead = torch.tensor([i for i, r in enumerate(self.rows) if r is None], device=self.device)
            self.batch.next_pos[dead] = 0      # positions stay inside a learned position table
        logits = self.model.decode_step(ids, self.batch)
        self._sample([self.rows[i] for i in live], logits[live] if len(live) < len(self.rows) else logits)

    def _sample(self, reqs: list[Request], logits):
        """Sample each request's next token from logits [B, V] (its logprobs first, when asked for) and note
        whether it is finished. Penalties and filters run batched over the rows; only the draw is per row (each
        request has its own generator, so a seed gives the same tokens in any batch)."""
        ps = [r.params for r in reqs]
        dev = logits.device
        x = logits.float()
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
            r.output.append(t)
            if r.first_token_at is None:
                r.first_token_at = now
            if t == self.eos_id and not r.params.ignore_eos:
                r.finish_reason = "stop"
            elif len(r.output) >= r.params.max_tokens:
                r.finish_reason = "length"

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
