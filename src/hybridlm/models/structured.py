"""Constrained decoding: the next token restricted to those that keep the output inside a JSON schema, a regular
expression, a list of choices, an EBNF (GBNF) grammar or a tool call, with XGrammar (Dong et al., 2024, "XGrammar:
Flexible and Efficient Structured Generation Engine for Large Language Models").

A `Spec` names what is wanted (kind + canonical text); `Grammars` compiles it once against one tokenizer's
vocabulary (an LRU cache keyed by the spec) and hands out a `Constraint` per row: a matcher that fills the row's
token bitmask before sampling (`mask_logits`: disallowed tokens -inf, so every sampler option still applies to the
tokens left) and accepts the sampled token after. A matcher that accepted the end-of-text token is `finished`.
Matchers roll back (`rollback(n)`): a verify step over k drafted tokens accepts them one by one, filling the mask
of each position in turn, then rolls back the rejected ones.

Tokenizers: the byte tokenizer (id i is byte i), and any `tokenizers.Tokenizer` behind a BPETokenizer (byte-level
BPE, SentencePiece-style byte-fallback and raw vocabularies: xgrammar reads the kind from the tokenizer's JSON).
"""
import json
import logging
import re
import time
from collections import OrderedDict
from dataclasses import dataclass

from torch import Tensor

from ..errors import InputError

log = logging.getLogger(__name__)
TOOL_OPEN, TOOL_CLOSE = "<tool_call>\n", "\n</tool_call>"   # the Qwen / Hermes form
WHAT = {"json": "the JSON schema", "regex": "the regex", "choice": "the choices", "grammar": "the grammar",
        "tools": "a tool's parameters schema"}


class GrammarError(InputError):
    """A schema, regex, choice list or grammar that cannot be compiled."""


@dataclass(frozen=True)
class Spec:
    """What to constrain to. kind: "json" (a JSON schema; text "" for any JSON object), "regex", "choice" (text:
    a JSON array of strings), "grammar" (EBNF / GBNF) or "tools" (text: a JSON array of function definitions,
    {"name", "parameters"}; the output is one `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`)."""
    kind: str
    text: str

    @staticmethod
    def json_schema(schema) -> "Spec":
        """A schema as a dict or JSON text; key order is kept (it orders the generated properties)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema is an object, got {json.dumps(schema)[:50]}")
        return Spec("json", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))

    @staticmethod
    def choice(options) -> "Spec":
        if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
            raise GrammarError("choices are a non-empty array of non-empty strings")
        return Spec("choice", json.dumps(options, ensure_ascii=False))

    @staticmethod
    def tools(functions: list[dict]) -> "Spec":
        """functions: [{"name": str, "parameters": JSON schema}] (one of them is called; no parameters: an empty
        parameter list, as OpenAI reads a function without them)."""
        empty = {"type": "object", "properties": {}, "additionalProperties": False}
        return Spec("tools", json.dumps([{"name": f["name"], "parameters": f.get("parameters") or empty}
                                         for f in functions], separators=(",", ":"), ensure_ascii=False))


def vocab_info(tok, vocab_size: int):
    """xgrammar.TokenizerInfo of tokenizer `tok` for a model of `vocab_size` logits (ids the tokenizer lacks, the
    model's padding, are never allowed). Its end-of-text id is the stop token."""
    import xgrammar as xgr
    if getattr(tok, "kind", None) == "byte":
        vocab = [bytes([i]) for i in range(256)] + [tok.eos_token.encode()]
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[tok.eos_id])
    backend = getattr(tok, "tok", None)
    if backend is None or not hasattr(backend, "to_str"):
        raise InputError(f"constrained decoding needs the byte tokenizer or a `tokenizers` one, not "
                         f"{type(tok).__name__}")
    from transformers import PreTrainedTokenizerFast       # xgrammar reads the vocabulary's kind through it
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=tok.eos_token)
    return xgr.TokenizerInfo.from_huggingface(fast, vocab_size=vocab_size, stop_token_ids=[tok.eos_id])


def _message(e: Exception) -> str:
    """xgrammar's error without its log prefix ("[time] file.cc:line: ")."""
    return re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", str(e).strip()).strip()


class Grammars:
    """Compiles Specs for one tokenizer and model vocabulary; the `size` most recently used are kept.
    `last_compile_s`: seconds the latest compile took (0 for a cache hit)."""

    def __init__(self, tok, vocab_size: int, size: int = 64):
        try:
            import xgrammar as xgr
        except ImportError:
            raise InputError("constrained decoding needs xgrammar: pip install 'hybridlm[serve]'") from None
        self.info = vocab_info(tok, vocab_size)
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.cache: OrderedDict[Spec, object] = OrderedDict()
        self.size = size
        self.last_compile_s = 0.0

    def compile(self, spec: Spec):
        hit = self.cache.get(spec)
        if hit is not None:
            self.cache.move_to_end(spec)
            self.last_compile_s = 0.0
            return hit
        t = time.perf_counter()
        try:
            compiled = self.compiler.compile_grammar(_grammar(spec))
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"{WHAT[spec.kind]} does not compile: {_message(e)}") from None
        self.last_compile_s = time.perf_counter() - t
        log.debug("compiled a %s constraint (%d chars) in %.1f ms", spec.kind, len(spec.text),
                  1e3 * self.last_compile_s)
        self.cache[spec] = compiled
        if len(self.cache) > self.size:
            self.cache.popitem(last=False)
        return compiled

    def constraint(self, spec: Spec) -> "Constraint":
        return Constraint(self.compile(spec), self.vocab_size)


def _grammar(spec: Spec):
    import xgrammar as xgr
    if spec.kind == "json":
        if not spec.text:
            return xgr.Grammar.builtin_json_grammar()
        return xgr.Grammar.from_json_schema(spec.text, any_whitespace=False, strict_mode=True)
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.text)
    if spec.kind == "choice":
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                for c in json.loads(spec.text)))
    if spec.kind == "grammar":
        return xgr.Grammar.from_ebnf(spec.text)
    if spec.kind == "tools":
        calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                  "required": ["name", "arguments"], "additionalProperties": False} for f in json.loads(spec.text)]
        body = xgr.Grammar.from_json_schema(json.dumps(calls[0] if len(calls) == 1 else {"anyOf": calls}),
                                            any_whitespace=False, strict_mode=True)
        lit = [xgr.Grammar.from_ebnf(f"root ::= {json.dumps(s)}") for s in (TOOL_OPEN, TOOL_CLOSE)]
        return xgr.Grammar.concat(lit[0], body, lit[1])
    raise GrammarError(f"unknown constraint kind {spec.kind!r}")


class Constraint:
    """One row's matcher: the logits processor a request holds. `fill(bitmask, row)` writes the allowed tokens of
    the next position, `accept(token)` advances (False: the token was not allowed), `finished` once the grammar has
    accepted the end-of-text token, `rollback(n)` undoes the last n accepted tokens."""

    def __init__(self, compiled, vocab_size: int):
        import xgrammar as xgr
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size

    def fill(self, bitmask: Tensor, row: int):
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(int(token))

    def rollback(self, n: int):
        self.matcher.rollback(n)

    @property
    def finished(self) -> bool:
        return self.matcher.is_terminated()


_SHARED: dict = {}          # (id(tokenizer), vocab_size) -> (tokenizer, Grammars): one compile cache per vocabulary


def grammars_for(tok, vocab_size: int) -> Grammars:
    """The shared Grammars of a tokenizer and model vocabulary (generate's; a server holds its own)."""
    key = (id(tok), vocab_size)
    if key not in _SHARED or _SHARED[key][0] is not tok:
        _SHARED[key] = (tok, Grammars(tok, vocab_size))
    return _SHARED[key][1]


def constraints_for(tok, vocab_size: int, rows: int, *, json_schema=None, regex=None, grammar=None):
    """One Constraint per row for generate's json_schema / regex / grammar (at most one of them), or None."""
    given = {k: v for k, v in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar)) if v is not None}
    if not given:
        return None
    if len(given) > 1:
        raise InputError(f"give one of json_schema, regex and grammar, not {' and '.join(given)}")
    if tok is None:
        raise InputError(f"{next(iter(given))} needs the tokenizer (tokenizer=...)")
    spec = Spec.json_schema(json_schema) if json_schema is not None else Spec("regex", regex) if regex is not None \
        else Spec("grammar", grammar)
    g = grammars_for(tok, vocab_size)
    g.compile(spec)
    return [g.constraint(spec) for _ in range(rows)]


def mask_logits(logits: Tensor, constraints: list, rows: list[int] | None = None) -> Tensor:
    """Set to -inf, in place, the tokens each constraint forbids: logits [B, V] (float); constraints[j] masks row
    rows[j] (default: row j). Returns logits."""
    import xgrammar as xgr
    rows = list(range(len(constraints))) if rows is None else rows
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    if len(constraints) > 1:          # the rows' masks filled in parallel, on xgrammar's threads
        _batch_filler().batch_fill_next_token_bitmask([c.matcher for c in constraints], bitmask, rows)
    else:
        for c, i in zip(constraints, rows):
            c.fill(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
    return logits


_FILLER = []


def _batch_filler():
    """One xgrammar BatchGrammarMatcher (its thread pool: half the hardware threads) for every batch."""
    if not _FILLER:
        import xgrammar as xgr
        _FILLER.append(xgr.BatchGrammarMatcher("auto"))
    return _FILLER[0]
