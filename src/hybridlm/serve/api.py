"""The OpenAI-compatible HTTP API (Starlette on uvicorn): parses, validates, streams and reports; the model runs
in the scheduler's thread and is never waited on by the event loop.

Routes: POST /v1/completions, POST /v1/chat/completions (the tokenizer's chat template), GET /v1/models,
GET /health (no key needed), GET /metrics (Prometheus text). Errors are OpenAI's shape,
{"error": {"message", "type", "param", "code"}}: 400 bad input, 401 no or wrong key, 404 unknown model or route,
413 body too large, 429 queue full and 503 shutting down (both with Retry-After).
"""
import asyncio
import json
import time
import uuid
from functools import partial

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from ..errors import HybridLMError
from .engine import Request, SamplingParams
from .scheduler import NotAccepting, QueueFull
from .text import TextStream


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.type = type_ or {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
                              503: "server_error"}.get(status, "invalid_request_error")


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}},
                        status_code=e.status, headers=e.headers)


# ------------------------------------------------------------------ request fields
_MISSING = object()


def _get(body: dict, name: str, types, default=_MISSING, check=None, why: str = ""):
    """body[name] checked to be of `types` (bool is not a number) and to pass `check`; 400 otherwise."""
    v = body.get(name, _MISSING)
    if v is _MISSING or (v is None and default is not _MISSING):
        if default is _MISSING:
            raise APIError(400, f"'{name}' is required", name)
        return default
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(v, bool) and bool not in types or not isinstance(v, types):
        names = " or ".join({int: "an integer", float: "a number", str: "a string", bool: "a boolean",
                             list: "an array", dict: "an object"}[t] for t in types)
        raise APIError(400, f"'{name}' must be {names}, got {json.dumps(v)[:50]}", name)
    if check is not None and not check(v):
        raise APIError(400, f"'{name}' {why}, got {json.dumps(v)[:50]}", name)
    return v


def _sampling(body: dict, default_max_tokens: int) -> tuple[SamplingParams, list[str]]:
    n = _get(body, "n", int, 1)
    if n != 1:
        raise APIError(400, "only n=1 is supported", "n")
    if _get(body, "logprobs", (bool, int), None):
        raise APIError(400, "logprobs are not supported", "logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        if _get(body, name, (int, float), 0):
            raise APIError(400, f"'{name}' is not supported (only 0)", name)
    for name in ("tools", "functions", "logit_bias", "best_of"):
        if body.get(name) not in (None, [], {}, 1):
            raise APIError(400, f"'{name}' is not supported", name)
    stop = _get(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > 4 or not all(isinstance(s, str) for s in stop):
        raise APIError(400, "'stop' must be a string or an array of up to 4 strings", "stop")
    max_tokens = body.get("max_completion_tokens") if body.get("max_tokens") is None else body.get("max_tokens")
    max_tokens = _get({"max_tokens": max_tokens}, "max_tokens", int, default_max_tokens, lambda v: v >= 1,
                      "must be >= 1")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=float(_get(body, "temperature", (int, float), 1.0, lambda v: 0 <= v <= 2, "must be in [0, 2]")),
        top_p=float(_get(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "must be in (0, 1]")),
        top_k=_get(body, "top_k", int, None, lambda v: v >= -1 and v != 0, "must be >= 1 (or -1: off)"),
        seed=_get(body, "seed", int, None),
        ignore_eos=_get(body, "ignore_eos", bool, False))
    if params.top_k == -1:
        params.top_k = None
    if params.top_p == 1.0:
        params.top_p = None
    return params, stop


class Server:
    """The routes over one scheduler and tokenizer. `model_name`: the id clients send as `model`."""

    def __init__(self, scheduler, tokenizer, model_name: str, api_key: str | None = None,
                 max_body_bytes: int = 4 << 20):
        self.scheduler, self.tok, self.model_name = scheduler, tokenizer, model_name
        self.api_key, self.max_body_bytes = api_key, max_body_bytes
        self.created = int(time.time())
        self.draining = False

    # -------------------------------------------------------------- plumbing
    async def _json(self, request: HTTPRequest) -> dict:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.max_body_bytes:
            raise APIError(413, f"the request body exceeds {self.max_body_bytes} bytes", code="request_too_large")
        chunks, total = [], 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > self.max_body_bytes:
                raise APIError(413, f"the request body exceeds {self.max_body_bytes} bytes", code="request_too_large")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        model = _get(body, "model", str, None)
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist (this server has '{self.model_name}')",
                           "model", "model_not_found")
        return body

    def _submit(self, prompt: list[int], params: SamplingParams, loop, queue) -> Request:
        def on_token(req, token):            # the engine's thread
            loop.call_soon_threadsafe(queue.put_nowait, token)
        req = Request(prompt, params, on_token=on_token, id=uuid.uuid4().hex)
        try:
            self.scheduler.submit(req)
        except HybridLMError as e:
            msg = str(e)
            raise APIError(400, msg, "max_tokens" if "context" in msg else None,
                           "context_length_exceeded" if "context" in msg else None) from None
        except QueueFull as e:
            raise APIError(429, f"{e}; retry later", code="queue_full", headers={"Retry-After": "1"}) from None
        except NotAccepting as e:
            raise APIError(503, str(e), code="shutting_down", headers={"Retry-After": "5"}) from None
        return req

    def _encode(self, text: str) -> list[int]:
        ids = self.tok.encode(text)
        if not ids:
            raise APIError(400, "the prompt is empty", "prompt")
        return ids

    # -------------------------------------------------------------- generation
    async def _generate(self, request: HTTPRequest, prompt: list[int], params: SamplingParams, stop: list[str],
                        stream: bool, include_usage: bool, chat: bool):
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        req = self._submit(prompt, params, loop, queue)
        rid = ("chatcmpl-" if chat else "cmpl-") + req.id
        obj = "chat.completion" if chat else "text_completion"
        text = TextStream(self.tok, stop)
        eos = self.scheduler.engine.eos_id

        async def pieces():
            """(text piece, finish_reason or None) as tokens arrive."""
            while True:
                token = await queue.get()
                if token is None:
                    yield text.finish(), req.finish_reason
                    return
                if token == eos and not params.ignore_eos:
                    continue
                piece = text.add(token)
                if text.stopped:
                    self.scheduler.abort(req, "stop")
                    yield piece, "stop"
                    return
                if piece:
                    yield piece, None

        def usage():
            n = text.tokens if text.stopped else len(req.output)   # a stop string: the tokens up to it
            return {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n,
                    "prompt_tokens_details": {"cached_tokens": req.cached_tokens}}

        def finish_reason(reason):
            if reason == "error":
                return "error"
            return "length" if reason == "length" else "stop"

        if not stream:
            async def watch():                # a client that goes away frees the slot (as a stream's does)
                while not req.finished:
                    if await request.is_disconnected():
                        self.scheduler.abort(req)
                        return
                    await asyncio.sleep(0.25)
            watcher = asyncio.ensure_future(watch())
            out, reason = [], None
            try:
                async for piece, reason in pieces():
                    out.append(piece)
            finally:
                watcher.cancel()
                if not req.finished:
                    self.scheduler.abort(req)
            if reason == "error":
                raise APIError(500, f"generation failed: {req.error}", type_="server_error")
            content = "".join(out)
            choice = {"index": 0, "finish_reason": finish_reason(reason), "logprobs": None}
            choice.update({"message": {"role": "assistant", "content": content}} if chat else {"text": content})
            return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": self.model_name,
                                 "choices": [choice], "usage": usage()})

        def chunk(piece, reason, first=False):
            if chat:
                delta = ({"role": "assistant", "content": piece} if first else {"content": piece}) \
                    if piece or first else {}
                choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
                body = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                        "model": self.model_name, "choices": [choice]}
            else:
                body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                        "choices": [{"index": 0, "text": piece, "finish_reason": reason, "logprobs": None}]}
            if include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body)}\n\n"

        async def events():
            try:
                first = True
                async for piece, reason in pieces():
                    if reason is not None:
                        if piece or first:
                            yield chunk(piece, None, first)
                        yield chunk("", finish_reason(reason))
                        break
                    yield chunk(piece, None, first)
                    first = False
                if include_usage:
                    yield "data: " + json.dumps({"id": rid, "object": obj + ("" if not chat else ".chunk"),
                                                 "created": int(time.time()), "model": self.model_name,
                                                 "choices": [], "usage": usage()}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:                          # the client went away (cancelled) or the stream ended
                if not req.finished:
                    self.scheduler.abort(req)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -------------------------------------------------------------- routes
    async def completions(self, request: HTTPRequest):
        body = await self._json(request)
        prompt = _get(body, "prompt", (str, list))
        if isinstance(prompt, list):
            if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]                      # one prompt in a batch of one
            elif prompt and all(isinstance(p, (str, list)) for p in prompt):
                raise APIError(400, "one prompt per request (n=1, no batches)", "prompt")
        if isinstance(prompt, str):
            ids = self._encode(prompt)
        else:
            if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise APIError(400, "'prompt' must be a string or a non-empty array of token ids", "prompt")
            V = self.scheduler.engine.model.config.vocab_size
            bad = next((t for t in prompt if not 0 <= t < V), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} is out of range for vocab_size {V}", "prompt")
            ids = prompt
        params, stop = _sampling(body, 16)
        stream = _get(body, "stream", bool, False)
        opts = _get(body, "stream_options", dict, {})
        return await self._generate(request, ids, params, stop, stream, bool(opts.get("include_usage")), chat=False)

    async def chat_completions(self, request: HTTPRequest):
        body = await self._json(request)
        messages = _get(body, "messages", list, check=lambda v: len(v) > 0, why="must not be empty")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise APIError(400, f"messages[{i}] must be an object with a string 'role'", "messages")
            content = m.get("content")
            if isinstance(content, list):               # content parts: the text ones
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported", "messages")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise APIError(400, f"messages[{i}].content must be a string", "messages")
            clean.append({"role": m["role"], "content": content})
        from ..data.tokenizer import apply_chat_template
        try:
            text = apply_chat_template(self.tok, clean)
        except HybridLMError as e:
            raise APIError(400, str(e), "messages") from None
        except Exception as e:                          # the template's own error (jinja raise_exception)
            raise APIError(400, f"the chat template failed: {e}", "messages") from None
        ids = self._encode(text)
        room = self.scheduler.engine.context - len(ids)
        params, stop = _sampling(body, max(1, room))
        stream = _get(body, "stream", bool, False)
        opts = _get(body, "stream_options", dict, {})
        return await self._generate(request, ids, params, stop, stream, bool(opts.get("include_usage")), chat=True)

    async def models(self, request: HTTPRequest):
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "hybridlm",
             "max_model_len": self.scheduler.engine.context}]})

    async def health(self, request: HTTPRequest):
        if self.draining or not self.scheduler.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: HTTPRequest):
        sch, eng = self.scheduler, self.scheduler.engine
        c = sch.counts()
        batch = eng.batch
        gauges = {
            "requests_running": ("Requests in the decode batch", c["running"]),
            "requests_prefilling": ("Requests being prefilled", c["prefilling"]),
            "requests_waiting": ("Requests in the queue", c["waiting"]),
            "slots": ("Cache slots (requests decoded together at most)", eng.max_slots),
            "slot_occupancy": ("Fraction of the slots in use", (c["running"] + c["prefilling"]) / eng.max_slots),
            "state_bytes": ("Bytes of inference state of the running batch", batch.nbytes if batch else 0),
            "slot_fixed_bytes": ("Fixed state bytes of one request (recurrent states, rings)", eng.fixed_bytes),
            "slot_token_bytes": ("State bytes per token of one request (attention K/V)", eng.token_bytes),
            "prefix_cache_hits_total": ("Requests that resumed from the prefix cache", eng.prefix.hits),
            "prefix_cache_misses_total": ("Requests with full blocks and no cached prefix", eng.prefix.misses),
            "prefix_cache_hit_tokens_total": ("Prompt tokens resumed from the prefix cache", eng.prefix.hit_tokens),
            "prefix_cache_bytes": ("Bytes held by the prefix cache", eng.prefix.nbytes),
        }
        return PlainTextResponse(sch.metrics.render(gauges), media_type="text/plain; version=0.0.4")


class _Guard:
    """ASGI middleware: the API key on every route but /health, and OpenAI-shaped errors for what the routes
    raise."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        key = self.server.api_key
        if key and scope["path"] != "/health":
            headers = dict(scope["headers"])
            auth = headers.get(b"authorization", b"").decode("latin-1")
            if auth != f"Bearer {key}":
                msg = "missing API key (Authorization: Bearer KEY)" if not auth else "incorrect API key"
                return await error_response(APIError(401, msg, code="invalid_api_key"))(scope, receive, send)
        return await self.app(scope, receive, send)


def create_app(scheduler, tokenizer, model_name: str, api_key: str | None = None,
               max_body_bytes: int = 4 << 20) -> Starlette:
    """The ASGI app; its lifespan starts the scheduler's thread and, at shutdown, drains and stops it."""
    from contextlib import asynccontextmanager
    server = Server(scheduler, tokenizer, model_name, api_key, max_body_bytes)

    def wrap(fn):
        async def route(request):
            try:
                return await fn(request)
            except APIError as e:
                return error_response(e)
        return route

    async def not_found(request, exc: HTTPException):
        code = exc.status_code
        msg = f"no route {request.method} {request.url.path}" if code in (404, 405) else str(exc.detail)
        return error_response(APIError(404 if code == 404 else code, msg, code="not_found" if code == 404 else None))

    @asynccontextmanager
    async def lifespan(app):
        if scheduler._thread is None:
            scheduler.start()
        yield
        # uvicorn has let open responses finish (or ended them after its graceful-shutdown timeout): what is still
        # in flight has no client left
        server.draining = True
        await asyncio.get_running_loop().run_in_executor(None, partial(scheduler.stop, drain=False))

    routes = [Route("/v1/completions", wrap(server.completions), methods=["POST"]),
              Route("/v1/chat/completions", wrap(server.chat_completions), methods=["POST"]),
              Route("/v1/models", wrap(server.models), methods=["GET"]),
              Route("/health", wrap(server.health), methods=["GET"]),
              Route("/metrics", wrap(server.metrics), methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={HTTPException: not_found}, lifespan=lifespan)
    app.state.server = server
    app.add_middleware(_Guard, server=server)
    return app
