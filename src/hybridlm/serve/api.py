"""The OpenAI-compatible HTTP API (Starlette on uvicorn): parses, validates, streams and reports; the model runs
in the scheduler's thread and is never waited on by the event loop.

Routes: POST /v1/completions, POST /v1/chat/completions (the tokenizer's chat template), GET /v1/models,
POST /tokenize and /detokenize (vLLM's and llama-server's), GET /tokenizer_info (vLLM's), GET /health (no key
needed), GET /metrics (Prometheus, through prometheus_client). The request fields: serve/fields.py (every one
supported or refused, each with its own check); structured output and tool calls: serve/structured.py.
Errors are OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 bad input, 401 no or wrong key,
404 unknown model or route, 413 body too large, 429 queue full and 503 shutting down (both with Retry-After), 500
a generation that failed; a stream that fails ends with an `error` event (as vLLM's do) and `data: [DONE]`.
"""
import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from functools import partial

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from ..errors import HybridLMError
from .engine import Request, SamplingParams
from .fields import Check, FieldError, parse
from .fields import check as check_fields
from .scheduler import NotAccepting, QueueFull
from .structured import Tools, constraint, messages, parse_calls, tools
from .text import TextStream, token_text

LOGPROB_FLOOR = -9999.0          # JSON has no -inf (vLLM's floor)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.type = type_ or {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
                              500: "server_error", 503: "server_error"}.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


# ------------------------------------------------------------------ request fields
_MISSING = object()


def _get(body: dict, name: str, types, default=_MISSING, check=None, why: str = ""):
    """body[name] (a field outside the table) checked to be of `types` and to pass `check`; 400 otherwise."""
    v = body.get(name)
    if v is None:
        if default is _MISSING:
            raise APIError(400, f"'{name}' is required", name)
        return default
    return Check(types if isinstance(types, tuple) else (types,), check, why)(name, v)


@dataclass(frozen=True)
class Shape:
    """The response's form, chosen once per request: a text completion, a chat message, or a chat message whose
    tool calls are parsed out of its text (`tools`: the text is held back while streaming and sent, with the calls,
    at the end)."""
    chat: bool = False
    tools: bool = False

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def logprobs(self, entries: list) -> dict:
        return _chat_logprobs(entries) if self.chat else _completion_logprobs(entries)

    def message(self, text: str, reason: str) -> tuple[dict, str]:
        """(the non-streaming choice's body, finish_reason) of a finished choice's whole text."""
        if not self.chat:
            return {"text": text}, reason
        content, calls = parse_calls(text) if self.tools else (text, [])
        if calls:
            return {"message": {"role": "assistant", "content": content, "tool_calls": calls}}, "tool_calls"
        return {"message": {"role": "assistant", "content": text}}, reason

    def delta(self, piece: str, role: bool) -> dict:
        """A streamed piece of text."""
        if not self.chat:
            return {"text": piece}
        return {"delta": {"role": "assistant", "content": piece} if role else ({"content": piece} if piece else {})}

    def closing(self, text: str, reason: str) -> tuple[list[dict], str]:
        """(the deltas of a tools shape's held text at the end: its content, then each call as OpenAI streams
        them, its id and name first and its arguments after; finish_reason)."""
        content, calls = parse_calls(text)
        out = [{"content": content}] if content else []
        for k, c in enumerate(calls):
            f = c["function"]
            out.append({"tool_calls": [{"index": k, "id": c["id"], "type": "function",
                                        "function": {"name": f["name"], "arguments": ""}}]})
            out.append({"tool_calls": [{"index": k, "function": {"arguments": f["arguments"]}}]})
        return out, "tool_calls" if calls else reason


@dataclass
class Options:
    """What one request asks for, beyond the prompts: parsed and checked."""
    params: SamplingParams
    stop: list[str]
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None      # alternatives per token (0: the chosen token's own); None: no logprobs
    echo: bool = False
    shape: Shape = Shape()
    constraint: tuple | None = None  # (models.structured.Spec, the field that asked for it)
    tools: Tools | None = None


def parse_options(body: dict, route: str, default_max_tokens: int, want_tools: Tools | None = None) -> Options:
    """The sampling and response fields of a request body (after fields.check has passed it), each through its
    field's check (serve/fields.py); `want_tools`: the chat request's tools (structured.tools)."""
    chat = route == "chat"
    for name in body:                 # every field's type and range, once (chat's logprobs: a boolean, below)
        if not (chat and name == "logprobs"):
            parse(body, name)
    n = parse(body, "n", 1)
    stop = parse(body, "stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    echo = False if chat else parse(body, "echo", False)
    if chat:
        want = Check((bool,))("logprobs", body["logprobs"]) if body.get("logprobs") is not None else False
        top = parse(body, "top_logprobs")
        if top is not None and not want:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs = (top or 0) if want else None
    else:
        logprobs = parse(body, "logprobs")
    name = "max_completion_tokens" if chat and body.get("max_tokens") is None else "max_tokens"
    max_tokens = parse(body, name, default_max_tokens)
    if max_tokens < (0 if echo else 1):
        raise APIError(400, f"'{name}' must be >= 1 (0 only with echo), got {max_tokens}", name)
    parse(body, "response_format")
    stream = parse(body, "stream", False)
    opts = parse(body, "stream_options")
    if opts is not None and (not stream or set(opts) - {"include_usage"}):
        raise APIError(400, "'stream_options' goes with 'stream': true and takes 'include_usage' only",
                       "stream_options")
    fixed = constraint(body)
    if want_tools is not None and want_tools.spec is not None:
        if fixed is not None:
            raise APIError(400, f"'tool_choice' {want_tools.choice} and '{fixed[1]}' both constrain the output: "
                                "give one", "tool_choice")
        fixed = (want_tools.spec, "tools")
    top_k = parse(body, "top_k")
    top_p = parse(body, "top_p", 1.0)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=float(parse(body, "temperature", 1.0)),
        top_p=None if top_p == 1.0 else float(top_p),
        top_k=None if top_k in (None, 0, -1) else top_k,
        min_p=float(parse(body, "min_p", 0.0)),
        repetition_penalty=_penalty(body),
        presence_penalty=float(parse(body, "presence_penalty", 0.0)),
        frequency_penalty=float(parse(body, "frequency_penalty", 0.0)),
        seed=parse(body, "seed"),
        ignore_eos=parse(body, "ignore_eos", False),
        logprobs=logprobs,
        prompt_logprobs=(logprobs if logprobs is not None else 0) if echo and (logprobs is not None or not max_tokens)
        else None)
    return Options(params, stop, n, stream, bool(opts and opts.get("include_usage")), logprobs, echo,
                   Shape(chat, want_tools is not None), fixed, want_tools)


def _penalty(body: dict) -> float:
    """repetition_penalty (vLLM) or repeat_penalty (llama-server): one value > 0 (1: off)."""
    vals = {k: float(parse(body, k)) for k in ("repetition_penalty", "repeat_penalty") if body.get(k) is not None}
    if len(set(vals.values())) > 1:
        raise APIError(400, "'repetition_penalty' and 'repeat_penalty' disagree (give one)", "repeat_penalty")
    return next(iter(vals.values()), 1.0)


# ------------------------------------------------------------------ one choice
@dataclass(eq=False)
class Choice:
    """One Request of a response and what has been made of its tokens: text, log probabilities, finish reason."""
    index: int
    req: Request
    prompt_text: str
    text: TextStream
    logprobs: list = field(default_factory=list)   # TokenLogprob of tokens not yet reported
    started: bool = False                            # the echo (prompt) part has been reported
    reason: str | None = None                        # OpenAI's finish_reason once done
    pieces: list[str] = field(default_factory=list)  # the whole text (non-streaming)
    entries: list = field(default_factory=list)      # the whole logprobs (non-streaming)
    offset: int = 0                                  # text_offset of the next token

    @property
    def completion_tokens(self) -> int:
        return self.text.tokens if self.text.stopped else len(self.req.output)


def _finish_reason(req: Request) -> str:
    """OpenAI's values only: "stop" (end of text or a stop string) or "length"."""
    return "length" if req.finish_reason == "length" else "stop"


class Server:
    """The routes over one scheduler and tokenizer. `model_name`: the id clients send as `model`, or several (the
    first is the one /v1/models lists first and a response names when the request names none)."""

    def __init__(self, scheduler, tokenizer, model_name: str | list[str], api_key: str | None = None,
                 max_body_bytes: int = 4 << 20):
        names = [model_name] if isinstance(model_name, str) else list(dict.fromkeys(model_name))
        self.scheduler, self.tok, self.model_name, self.model_names = scheduler, tokenizer, names[0], names
        self.api_key, self.max_body_bytes = api_key, max_body_bytes
        self.created = int(time.time())
        self.draining = False
        self._token_text: dict[int, str] = {}
        self._grammars = None

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
        if model is not None and model not in self.model_names:
            raise APIError(404, f"the model '{model}' does not exist (this server has "
                                f"{', '.join(repr(n) for n in self.model_names)})", "model", "model_not_found")
        return body

    async def _fields(self, request: HTTPRequest, route: str) -> dict:
        body = await self._json(request)
        bad = check_fields(body, route)
        if bad is not None:
            raise APIError(400, bad[0], bad[1], "unsupported_parameter")
        return body

    def _encode(self, text: str, param: str = "prompt") -> list[int]:
        ids = self.tok.encode(text)
        if not ids:
            raise APIError(400, "the prompt is empty", param)
        return ids

    def _token_ids(self, ids, param: str) -> list[int]:
        V = self.scheduler.engine.model.config.vocab_size
        if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise APIError(400, f"'{param}' must be a string or a non-empty array of token ids", param)
        bad = next((t for t in ids if not 0 <= t < V), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of range for vocab_size {V}", param)
        return ids

    @property
    def grammars(self):
        """The compile cache of this tokenizer and model vocabulary (made on first use: xgrammar loads then)."""
        if self._grammars is None:
            from ..models.structured import Grammars
            try:
                self._grammars = Grammars(self.tok, self.scheduler.engine.model.config.vocab_size)
            except HybridLMError as e:
                raise APIError(400, f"no constrained decoding here: {e}") from None
        return self._grammars

    def _compile(self, constraint: tuple):
        """The Spec of (Spec, field), compiled once; a bad one is a 400 naming the field."""
        from ..models.structured import GrammarError
        spec, name = constraint
        try:
            self.grammars.compile(spec)
        except GrammarError as e:
            raise APIError(400, f"'{name}': {e}", name) from None
        return spec

    def token_text(self, t: int) -> tuple[str, bytes | None]:
        """(text, bytes) of one token for logprobs (text.token_text), remembered."""
        s = self._token_text.get(t)
        if s is None:
            s = self._token_text[t] = token_text(self.tok, t)
        return s

    # -------------------------------------------------------------- generation
    def _submit(self, prompts: list[tuple[list[int], str]], o: Options, loop, queue) -> list[Choice]:
        """n Requests per prompt into the scheduler at once (rows of one batch); all or none. A constrained
        request's grammar is compiled (or found in the cache) first; each Request gets its own matcher."""
        spec = self._compile(o.constraint) if o.constraint is not None else None
        choices = []
        try:
            for ids, text in prompts:
                for j in range(o.n):
                    params = o.params if o.n == 1 else _with_seed(o.params, j)
                    req = Request(ids, params, on_token=partial(_on_token, loop, queue, len(choices)),
                                  id=uuid.uuid4().hex, constraint=self.grammars.constraint(spec) if spec else None)
                    self.scheduler.submit(req)
                    choices.append(Choice(len(choices), req, text, TextStream(self.tok, o.stop)))
        except (HybridLMError, QueueFull, NotAccepting) as e:
            for c in choices:
                self.scheduler.abort(c.req)
            raise _submit_error(e) from None
        return choices

    async def _events(self, choices: list[Choice], o: Options, queue):
        """(choice, text piece, logprob entries) as tokens arrive; a choice's last has choice.reason set. A failed
        request raises APIError (500) after the others are aborted."""
        eos, left = self.scheduler.engine.eos_id, len(choices)
        while left:
            i, token, lp = await queue.get()
            c = choices[i]
            if c.reason is not None:
                continue
            prefix, entries = self._echo(c, o) if not c.started else ("", [])
            c.started = True
            if token is None:
                if c.req.finish_reason in ("error", "abort"):
                    raise APIError(500 if c.req.finish_reason == "error" else 503,
                                   f"generation failed: {c.req.error}" if c.req.error
                                   else "the request was aborted (the server is shutting down)", type_="server_error")
                c.reason = _finish_reason(c.req)
                left -= 1
                yield c, prefix + c.text.finish(), entries + self._take(c)
                continue
            if token == eos and not c.req.params.ignore_eos:
                if prefix or entries:
                    yield c, prefix, entries
                continue
            piece = c.text.add(token)
            if lp is not None and not c.text.stopped:
                c.logprobs.append(lp)
            if c.text.stopped:
                self.scheduler.abort(c.req, "stop")
                c.reason = "stop"
                left -= 1
            # one event per token, its text possibly "" (held back, or a token with no text), as vLLM sends them
            yield c, prefix + piece, entries + self._take(c)

    def _echo(self, c: Choice, o: Options) -> tuple[str, list]:
        """The prompt's text and its logprob entries, reported once before a choice's first output (echo)."""
        if not o.echo:
            return "", []
        lps = c.req.prompt_logprobs if o.logprobs is not None else None
        entries = [] if lps is None else [self._entry(c, t, lp) for t, lp in zip(c.req.prompt, lps)]
        return c.prompt_text, entries

    def _take(self, c: Choice) -> list:
        """Logprob entries of the tokens that arrived since the last report."""
        out = [self._entry(c, lp.token, lp) for lp in c.logprobs]
        c.logprobs.clear()
        return out

    def _entry(self, c: Choice, token: int, lp) -> tuple:
        """((token text, bytes), logprob or None, [((alt text, bytes), logprob)], text_offset) of one token."""
        s = self.token_text(token)
        entry = (s, None if lp is None else max(lp.logprob, LOGPROB_FLOOR),
                 [] if lp is None else [(self.token_text(t), max(v, LOGPROB_FLOOR)) for t, v in lp.top], c.offset)
        c.offset += len(s[0])
        return entry

    def _cleanup(self, choices: list[Choice]):
        for c in choices:
            if not c.req.finished:
                self.scheduler.abort(c.req)

    async def _watch(self, request: HTTPRequest, choices: list[Choice]):
        """A non-streaming client that goes away frees its slots (as a stream's does)."""
        while not all(c.req.finished for c in choices):
            if await request.is_disconnected():
                self._cleanup(choices)
                return
            await asyncio.sleep(0.25)

    async def _generate(self, request: HTTPRequest, prompts: list[tuple[list[int], str]], o: Options, model: str):
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        choices = self._submit(prompts, o, loop, queue)
        head = {"id": ("chatcmpl-" if o.shape.chat else "cmpl-") + choices[0].req.id, "model": model}
        if o.stream:
            return StreamingResponse(self._stream(choices, o, queue, head), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watcher = asyncio.ensure_future(self._watch(request, choices))
        try:
            async for c, piece, entries in self._events(choices, o, queue):
                c.pieces.append(piece)
                c.entries += entries
        finally:
            watcher.cancel()
            self._cleanup(choices)
        out = []
        for c in choices:
            body, reason = o.shape.message("".join(c.pieces), c.reason)
            lp = None if o.logprobs is None else o.shape.logprobs(c.entries)
            out.append({"index": c.index, **body, "logprobs": lp, "finish_reason": reason})
        return JSONResponse({**head, "object": o.shape.object, "created": int(time.time()), "choices": out,
                             "usage": _usage(choices)})

    async def _stream(self, choices: list[Choice], o: Options, queue, head: dict):
        """Server-sent events: per choice a first chunk (chat: the role), text pieces, a chunk with finish_reason;
        then the usage chunk (include_usage) and [DONE]. The tools shape holds a choice's text and logprobs back
        and sends them at its end, its calls as tool-call deltas. A failure: an error event, then [DONE]."""
        shape = o.shape
        usage = {"usage": None} if o.include_usage else {}

        def chunk(c, body: dict, entries, reason=None):
            lp = shape.logprobs(entries) if o.logprobs is not None and entries else None
            choice = {"index": c.index, **body, "logprobs": lp, "finish_reason": reason}
            return _sse({**head, "object": shape.chunk_object, "created": int(time.time()), "choices": [choice],
                         **usage})

        try:
            first = set()
            try:
                async for c, piece, entries in self._events(choices, o, queue):
                    role = shape.chat and c.index not in first
                    first.add(c.index)
                    if shape.tools:
                        c.pieces.append(piece)
                        c.entries += entries
                        piece, entries = "", []
                    if c.reason is None or piece or entries or role:
                        yield chunk(c, shape.delta(piece, role), entries)
                    if c.reason is None:
                        continue
                    reason = c.reason
                    if shape.tools:
                        deltas, reason = shape.closing("".join(c.pieces), c.reason)
                        for k, d in enumerate(deltas):
                            yield chunk(c, {"delta": d}, c.entries if k == 0 else [])
                        if not deltas and c.entries:
                            yield chunk(c, {"delta": {}}, c.entries)
                    yield chunk(c, shape.delta("", False), [], reason)
            except APIError as e:
                self._cleanup(choices)
                yield _sse(e.body())
                yield "data: [DONE]\n\n"
                return
            if o.include_usage:
                yield _sse({**head, "object": shape.chunk_object, "created": int(time.time()), "choices": [],
                            "usage": _usage(choices)})
            yield "data: [DONE]\n\n"
        finally:                          # the client went away (cancelled) or the stream ended
            self._cleanup(choices)

    # -------------------------------------------------------------- routes
    async def completions(self, request: HTTPRequest):
        body = await self._fields(request, "completions")
        prompt = _get(body, "prompt", (str, list))
        batch = prompt if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt) \
            else [prompt]
        prompts = []
        for p in batch:
            if isinstance(p, str):
                prompts.append((self._encode(p), p))
            else:
                ids = self._token_ids(p, "prompt")
                prompts.append((ids, self.tok.decode(ids)))
        o = parse_options(body, "completions", 16)
        return await self._generate(request, prompts, o, body.get("model") or self.model_name)

    async def chat_completions(self, request: HTTPRequest):
        body = await self._fields(request, "chat")
        clean = messages(parse(body, "messages"))
        want_tools = tools(body)
        if want_tools is not None:
            self._compile((want_tools.every, "tools"))
        from ..data.tokenizer import apply_chat_template
        try:
            text = apply_chat_template(self.tok, clean, want_tools.functions if want_tools else None)
        except HybridLMError as e:
            raise APIError(400, str(e), "messages") from None
        except Exception as e:                          # the template's own error (jinja raise_exception)
            raise APIError(400, f"the chat template failed: {e}", "messages") from None
        ids = self._encode(text, "messages")
        o = parse_options(body, "chat", max(1, self.scheduler.engine.context - len(ids)), want_tools)
        return await self._generate(request, [(ids, text)], o, body.get("model") or self.model_name)

    async def tokenize(self, request: HTTPRequest):
        """vLLM's {"prompt"} or {"messages"}, llama-server's {"content"} -> {"tokens", "count", "max_model_len"}."""
        body = await self._json(request)
        extra = set(body) - {"model", "prompt", "content", "messages", "add_special_tokens", "add_special",
                             "add_generation_prompt", "with_pieces"}
        if extra:
            name = sorted(extra)[0]
            raise APIError(400, f"unknown field '{name}'", name)
        for name in ("add_special_tokens", "add_special", "add_generation_prompt", "with_pieces"):
            _get(body, name, bool, False)
        if "messages" in body:
            from ..data.tokenizer import apply_chat_template
            text = apply_chat_template(self.tok, messages(_get(body, "messages", list)))
        else:
            key = "content" if "content" in body else "prompt"
            text = _get(body, key, str)
        ids = self.tok.encode(text)
        out = {"tokens": ids, "count": len(ids), "max_model_len": self.scheduler.engine.context}
        if body.get("with_pieces"):
            out["tokens"] = [{"id": t, "piece": self.tok.decode([t])} for t in ids]
        return JSONResponse(out)

    async def detokenize(self, request: HTTPRequest):
        """{"tokens": [ids]} -> {"prompt": text} (vLLM) and {"content": text} (llama-server)."""
        body = await self._json(request)
        extra = set(body) - {"model", "tokens"}
        if extra:
            name = sorted(extra)[0]
            raise APIError(400, f"unknown field '{name}'", name)
        text = self.tok.decode(self._token_ids(_get(body, "tokens", list), "tokens"))
        return JSONResponse({"prompt": text, "content": text})

    async def tokenizer_info(self, request: HTTPRequest):
        """vLLM's tokenizer description (lm-eval's remote tokenizer reads it)."""
        return JSONResponse({"tokenizer_class": type(self.tok).__name__, "eos_token": self.tok.eos_token,
                             "bos_token": None, "pad_token": self.tok.eos_token,
                             "chat_template": getattr(self.tok, "chat_template", None),
                             "model_max_length": self.scheduler.engine.context})

    async def models(self, request: HTTPRequest):
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": self.created, "owned_by": "hybridlm",
             "max_model_len": self.scheduler.engine.context} for name in self.model_names]})

    async def health(self, request: HTTPRequest):
        if self.draining or not self.scheduler.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: HTTPRequest):
        sch = self.scheduler
        return PlainTextResponse(sch.metrics.render(sch.gauges()), media_type="text/plain; version=0.0.4")


def _on_token(loop, queue, index: int, req: Request, token):
    """The engine's thread: hand (choice index, token, its TokenLogprob) to the event loop. The engine appends a
    token's logprob before this call, so req.logprobs[-1] is this token's."""
    lp = req.logprobs[-1] if token is not None and req.params.logprobs is not None and req.logprobs else None
    loop.call_soon_threadsafe(queue.put_nowait, (index, token, lp))


def _with_seed(params: SamplingParams, j: int) -> SamplingParams:
    """Choice j of n: its own generator (seed + j when seeded), so the n samples differ."""
    from dataclasses import replace
    return replace(params, seed=None if params.seed is None else params.seed + j)


def _submit_error(e: Exception) -> APIError:
    if isinstance(e, QueueFull):
        return APIError(429, f"{e}; retry later", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(e, NotAccepting):
        return APIError(503, str(e), code="shutting_down", headers={"Retry-After": "5"})
    msg = str(e)
    if isinstance(e, FieldError):
        return APIError(400, msg, e.param)
    context = "context" in msg
    return APIError(400, msg, "max_tokens" if context else None, "context_length_exceeded" if context else None)


def _usage(choices: list[Choice]) -> dict:
    """Prompt tokens count once per prompt (not per choice), as OpenAI counts them."""
    seen = {id(c.req.prompt): len(c.req.prompt) for c in choices}
    p, n = sum(seen.values()), sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n,
            "prompt_tokens_details": {"cached_tokens": sum(c.req.cached_tokens for c in choices)}}


def _completion_logprobs(entries: list) -> dict:
    """OpenAI's legacy completions shape: parallel lists, top_logprobs as {token text: logprob} (the chosen token
    among them, as vLLM gives it; the first prompt token of an echo has None)."""
    return {"tokens": [e[0][0] for e in entries], "token_logprobs": [e[1] for e in entries],
            "top_logprobs": [None if e[1] is None else {e[0][0]: e[1], **{s: v for (s, _), v in e[2]}}
                             for e in entries],
            "text_offset": [e[3] for e in entries]}


def _chat_logprobs(entries: list) -> dict:
    """OpenAI's chat shape: content[] of {token, logprob, bytes, top_logprobs[{token, logprob, bytes}]}."""
    def one(s, v):
        return {"token": s[0], "logprob": v, "bytes": None if s[1] is None else list(s[1])}
    return {"content": [{**one(e[0], e[1]), "top_logprobs": [one(s, v) for s, v in e[2]]} for e in entries],
            "refusal": None}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


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


def create_app(scheduler, tokenizer, model_name: str | list[str], api_key: str | None = None,
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
            except FieldError as e:
                return error_response(APIError(400, str(e), e.param))
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
              Route("/tokenize", wrap(server.tokenize), methods=["POST"]),
              Route("/detokenize", wrap(server.detokenize), methods=["POST"]),
              Route("/tokenizer_info", wrap(server.tokenizer_info), methods=["GET"]),
              Route("/health", wrap(server.health), methods=["GET"]),
              Route("/metrics", wrap(server.metrics), methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={HTTPException: not_found}, lifespan=lifespan)
    app.state.server = server
    app.add_middleware(_Guard, server=server)
    return app
