"""Continuous batching: which requests run, in what order, between the engine's steps.

One iteration (`step`):
  1. retire: rows finished or aborted (a client that went away) leave at once, their slots free for step 2
  2. admit: waiting requests start, first come first served, while a slot is free and their state fits the budget
  3. prefill: chunks of the requests being prefilled, up to one block of tokens per iteration, so a long prompt is
     interleaved with decode steps and running streams keep flowing
  4. decode: the prefilled requests join the batch and every running row gets one token
The engine runs in one thread (`start`); other threads only `submit` and `abort`, and hear back through each
request's `on_token` callback.
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

    # ------------------------------------------------------------ the engine's thread
    def _finish(self, req: Request, reason: str | None = None, error: str | None = None):
        if reason is not None and req.finish_reason is None:
            req.finish_reason = reason
        req.error = error
        req.finished_at = time.perf_counter()
        req.cache = None
        self.metrics.finished(req)
        self._emit(req, None)

    def _emit(self, req: Request, token):
        if req.on_token is not None:
            try:
                req.on_token(req, token)
            except Exception:          # a listener's failure is its own: the engine goes on
                log.exception("on_token callback failed")

    def _in_flight_bytes(self) -> int:
        eng = self.engine
        return sum(eng.request_bytes(r) for r in self.prefilling + [r for r in eng.running if not r.finished])

    def step(self) -> bool:
        """One iteration; returns whether anything ran."""
        eng = self.engine
        # 1. retire
        for r in eng.running:
            if r.aborted and not r.finished:
                self._finish(r, r.abort_reason)
        with self.cv:
            for r in [r for r in self.waiting if r.aborted]:
                self.waiting.remove(r)
                self._finish(r, r.abort_reason)
            for r in [r for r in self.prefilling if r.aborted]:
                self.prefilling.remove(r)
                self._finish(r, r.abort_reason)
            # 2. admit
            live = [r for r in eng.running if not r.finished]
            used = self._in_flight_bytes()
            while self.waiting and len(live) + len(self.prefilling) < eng.max_slots:
                need = eng.request_bytes(self.waiting[0])
                if eng.memory_bytes is not None and used + need > eng.memory_bytes:
                    break
                self.prefilling.append(self.waiting.popleft())
                used += need
        # 3. prefill, one block of tokens per iteration (at least one chunk)
        joined, budget = [], eng.block
        for r in list(self.prefilling):
            if budget <= 0:
                break
            try:
                if r.cache is None:
                    eng.start(r)
                budget -= eng.prefill(r)
            except Exception as e:          # this request alone fails
                log.exception("prefill failed")
                with self.cv:
                    self.prefilling.remove(r)
                self._finish(r, "error", error=str(e))
                continue
            if r.prefilled == len(r.prompt):
                with self.cv:
                    self.prefilling.remove(r)
                if r.output:                  # none when only the prompt is scored (max_tokens 0)
                    self._emit(r, r.output[-1])
                if r.finished:
                    self._finish(r)
                else:
                    joined.append(r)
        # 4. decode
        rows = [r for r in eng.running if not r.finished] + joined
        with eng.lock:
            eng.set_rows(rows)
            if not rows:
                return bool(joined)
            try:
                eng.decode()
            except Exception as e:
                log.exception("decode step failed")
                for r in rows:
                    self._finish(r, "error", error=str(e))
                eng.set_rows([])
                return True
        for r in rows:
            self._emit(r, r.output[-1])
            if r.finished:
                self._finish(r)
        if all(r.finished for r in rows):         # nothing left running: free the batch's state now
            with eng.lock:
                eng.set_rows([])
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
        self.engine.set_rows([])

    def _fail_all(self, why: str):
        with self.cv:
            reqs = list(self.waiting) + self.prefilling + self.engine.running
            self.waiting.clear()
            self.prefilling.clear()
        for r in reqs:
            if not r.finished:
                self._finish(r, "error", error=why)
        with self.engine.lock:
            self.engine.set_rows([])

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
