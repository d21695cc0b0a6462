"""Continuous batching: which requests run, in what order, between the engine's steps.

One iteration (`step`):
  1. `_retire`: rows finished or aborted (a client that went away) leave at once, their slots free for step 2
  2. `_admit`: waiting requests start, first come first served, while a slot is free and their state fits the
     memory budget
  3. `_prefill`: chunks of the requests being prefilled within a token budget per iteration shared with decode
     (`engine.step_tokens` minus `engine.row_tokens` per running row: 1, or K + 1 when speculating; at least one
     chunk), as vLLM's chunked prefill; the chunks with the fewest prompt tokens left go first, and a request passed
     over gains a block of credit per iteration (aging), so a short prompt is not left behind a long one and a long
     one is not starved. First chunks of fresh prompts run as left-padded forward passes, a prompt under way alone in
     its own cache
  4. `_decode`: the prefilled requests join the batch and every running row gets one token
A fault in any of these fails exactly the requests it touched (finish reason "error", `error` set), frees their
state, and the next iteration goes on. The engine runs in one thread (`start`); other threads only `submit` and
`abort`, and hear back through each request's `on_token` callback.
"""
import logging
import threading
import time
from collections import deque

import torch

from .engine import Engine, Request
from .metrics import Metrics

log = logging.getLogger("hybridlm.serve")


class QueueFull(Exception):
    """The waiting queue is at its bound (HTTP 429)."""


class NotAccepting(Exception):
    """The scheduler is shutting down (HTTP 503)."""


class Scheduler:
    def __init__(self, engine: Engine, max_queue: int = 256):
        self.engine = engine
        self.max_queue = max_queue
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.cv = threading.Condition()
        self.accepting = True
        self.metrics = Metrics()
        self._stop = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ any thread
    def submit(self, req: Request):
        """Queue `req` (validated by the engine first: InputError; QueueFull; NotAccepting when stopping)."""
        self.engine.validate(req)
        with self.cv:
            if not self.accepting:
                raise NotAccepting("the server is shutting down")
            if len(self.waiting) >= self.max_queue:
                self.metrics.rejected += 1
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)")
            req.arrival = time.perf_counter()
            self.waiting.append(req)
            self.cv.notify()

    def abort(self, req: Request, reason: str = "abort"):
        """Stop `req` (its slot is freed before the next decode step); it finishes with `reason`."""
        req.abort(reason)
        with self.cv:
            self.cv.notify()

    @property
    def running(self) -> list[Request]:
        return [r for r in self.engine.running if not r.finished]

    def counts(self) -> dict:
        with self.cv:
            return {"waiting": len(self.waiting), "prefilling": len(self.prefilling),
                    "running": sum(not r.finished for r in self.engine.running)}

    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or any(not r.finished for r in self.engine.running))

    def gauges(self) -> dict:
        """The engine's gauges for /metrics: name -> (help, value), read consistently under the engine's lock."""
        eng, c = self.engine, self.counts()
        mem = eng.memory()
        return {
            "requests_running": ("Requests in the decode batch", c["running"]),
            "requests_prefilling": ("Requests being prefilled", c["prefilling"]),
            "requests_waiting": ("Requests in the queue", c["waiting"]),
            "slots": ("Cache slots (requests decoded together at most)", eng.max_slots),
            "slot_occupancy": ("Fraction of the slots in use", (c["running"] + c["prefilling"]) / eng.max_slots),
            "state_bytes": ("Bytes of inference state allocated: batch, prefill caches and prefix cache",
                            mem["state_bytes"]),
            "batch_bytes": ("Bytes allocated by the running batch (capacity and padding included)",
                            mem["batch_bytes"]),
            "prefill_bytes": ("Bytes allocated by the caches of requests being prefilled", mem["prefill_bytes"]),
            "memory_budget_bytes": ("The memory budget of inference state (0: none)", eng.memory_bytes or 0),
            "slot_fixed_bytes": ("Fixed state bytes of one request (recurrent states, rings)", eng.fixed_bytes),
            "slot_token_bytes": ("State bytes per token of one request (attention K/V)", eng.token_bytes),
            "prefix_cache_hits_total": ("Requests that resumed from the prefix cache", eng.prefix.hits),
            "prefix_cache_misses_total": ("Requests with full blocks and no cached prefix", eng.prefix.misses),
            "prefix_cache_hit_tokens_total": ("Prompt tokens resumed from the prefix cache", eng.prefix.hit_tokens),
            "prefix_cache_bytes": ("Bytes allocated by the prefix cache", mem["prefix_cache_bytes"]),
            "spec_decode_num_drafts_total": ("Speculative checks (one forward over every row's drafts)",
                                             eng.spec_stats.checks),
            "spec_decode_num_draft_tokens_total": ("Draft tokens checked", eng.spec_stats.drafted),
            "spec_decode_num_accepted_tokens_total": ("Draft tokens the model accepted", eng.spec_stats.accepted),
            "spec_decode_num_row_checks_total": ("Rows checked (a check of 3 rows counts 3)", eng.spec_stats.rows),
            "spec_decode_num_emitted_tokens_total": ("Tokens added by speculative checks", eng.spec_stats.emitted),
            "spec_decode_acceptance_rate": ("Accepted over checked draft tokens", eng.spec_stats.acceptance),
            "spec_decode_tokens_per_step": ("Tokens added per row per speculative check",
                                            eng.spec_stats.tokens_per_check),
        }

    # ------------------------------------------------------------ the engine's thread
    def _finish(self, req: Request, reason: str | None = None, error: str | None = None):
        if error is not None:
            req.finish_reason = "error"
        elif reason is not None and req.finish_reason is None:
            req.finish_reason = reason
        req.error = error
        req.finished_at = time.perf_counter()
        self.engine.release(req)
        self.metrics.finished(req)
        self._emit(req, None)

    def _fail(self, reqs: list[Request], e: Exception, what: str):
        """A fault of one operation: the requests it touched end with an error, their state freed."""
        log.error("%s failed", what, exc_info=e)
        why = f"{what} failed: {type(e).__name__}: {e}"
        with self.cv:
            for r in reqs:
                if r in self.prefilling:
                    self.prefilling.remove(r)
        for r in reqs:
            if r.finished_at is None:
                self._finish(r, error=why)

    def _emit(self, req: Request, token):
        if req.on_token is not None:
            try:
                req.on_token(req, token)
            except Exception:          # a listener's failure is its own: the engine goes on
                log.exception("on_token callback failed")

    def step(self) -> bool:
        """One iteration; returns whether anything ran."""
        self._retire()
        self._admit()
        joined = self._prefill()
        return self._decode(joined) or bool(joined)

    def _retire(self):
        for r in self.engine.running:
            if r.aborted and not r.finished:
                self._finish(r, r.abort_reason)
        with self.cv:
            gone = [r for r in self.waiting if r.aborted] + [r for r in self.prefilling if r.aborted]
            for r in gone:
                (self.waiting if r in self.waiting else self.prefilling).remove(r)
        for r in gone:
            self._finish(r, r.abort_reason)

    def _admit(self):
        eng = self.engine
        started = []
        with self.cv:
            live = [r for r in eng.running if not r.finished]
            while self.waiting and len(live) + len(self.prefilling) < eng.max_slots \
                    and eng.fits(self.waiting[0], started):
                r = self.waiting.popleft()
                self.prefilling.append(r)
                started.append(r)
        for r in started:
            try:
                with eng.lock:
                    eng.start(r)
            except Exception as e:
                self._fail([r], e, "start")

    def _pick_chunks(self) -> list[Request]:
        """The prefill chunks of this iteration within the token budget left by the decode rows (at least one):
        fewest prompt tokens left first, less a block per iteration a request was passed over."""
        eng = self.engine
        budget = eng.step_tokens - eng.row_tokens * sum(not r.finished for r in eng.running)
        order = sorted(self.prefilling, key=lambda r: len(r.prompt) - r.prefilled - eng.block * r.passed_over)
        chosen = []
        for r in order:
            c = eng.chunk(r)
            if chosen and c > budget:
                r.passed_over += 1
                continue
            chosen.append(r)
            budget -= c
            r.passed_over = 0
        return chosen

    def _prefill(self) -> list[Request]:
        """Run this iteration's chunks; returns the requests whose prefill ended and which go on to decode."""
        eng, joined = self.engine, []
        for group in eng.plan_prefill(self._pick_chunks()):
            try:
                with eng.lock:
                    eng.prefill(group)
            except Exception as e:
                self._fail(group, e, "prefill")
                continue
            for r in group:
                if r.prefilled < len(r.prompt):
                    continue
                with self.cv:
                    self.prefilling.remove(r)
                if r.output:                  # none when only the prompt is scored (max_tokens 0)
                    self._emit(r, r.output[-1])
                if r.finished:
                    self._finish(r)
                else:
                    joined.append(r)
        return joined

    def _decode(self, joined: list[Request]) -> bool:
        """The prefilled requests join the batch; every running row gets one token."""
        eng = self.engine
        rows = [r for r in eng.running if not r.finished] + joined
        with eng.lock:
            try:
                eng.set_rows(rows)
            except Exception as e:
                eng.clear()
                self._fail(rows, e, "joining the batch")
                return True
            if not rows:
                return False
            before = [len(r.output) for r in rows]
            try:
                eng.decode()
            except Exception as e:
                eng.clear()
                self._fail(rows, e, "decode")
                return True
        for r, b in zip(rows, before):
            for t in r.output[b:]:          # one token, or several with speculative decoding
                self._emit(r, t)
            if r.finished:
                self._finish(r)
        if all(r.finished for r in rows):         # nothing left running: free the batch's state now
            with eng.lock:
                eng.clear()
        return True

    def run_until_idle(self):
        """Step until nothing is waiting or running (for use without the thread)."""
        while self.busy():
            self.step()

    def _loop(self):
        with torch.inference_mode():
            while True:
                with self.cv:
                    while not self.busy() and not self._stop:
                        self.cv.wait()
                    if self._stop and not self.busy():
                        break
                try:
                    self.step()
                except Exception as e:           # a bug of ours: fail what is in flight, keep serving
                    log.exception("engine step failed")
                    self._fail_all(str(e))
        self.engine.clear()

    def _fail_all(self, why: str):
        with self.cv:
            reqs = list(self.waiting) + self.prefilling + self.engine.running
            self.waiting.clear()
            self.prefilling.clear()
        for r in reqs:
            if r.finished_at is None:
                self._finish(r, error=why)
        with self.engine.lock:
            self.engine.clear()

    def start(self):
        """Run the engine in a daemon thread."""
        self._thread = threading.Thread(target=self._loop, name="hybridlm-engine", daemon=True)
        self._thread.start()

    def stop(self, drain: bool = True, timeout: float | None = None):
        """Stop admitting; finish what is in flight (drain) or abort it; then end the engine's thread."""
        with self.cv:
            self.accepting = False
            if not drain:
                for r in list(self.waiting) + self.prefilling + self.engine.running:
                    r.abort()
            self._stop = True
            self.cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
