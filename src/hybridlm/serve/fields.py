"""The request fields the API knows: every field of OpenAI's completions and chat-completions request schemas and
the common extras of vLLM and llama.cpp's llama-server, each supported or refused (docs/serving.md renders this
table). A refused field is a 400 naming it unless its value is one that asks for nothing (null, or e.g.
`"typical_p": 1`); a field in none of the tables is a 400 too. Nothing is accepted and dropped.

A supported field carries its own parse and range check (`Check`): the API parses request bodies with it and the
engine checks a request's SamplingParams with the same checks (`check_sampling`), so a range is written once."""
import json
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import InputError

MAX_LOGPROBS = 20                     # alternatives per token at most (OpenAI's top_logprobs bound)
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "an array",
               dict: "an object"}


class FieldError(InputError):
    """A field's value is of the wrong type or out of range; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Check:
    """A value's types (bool is not a number) and range: `check(name, v)` returns v or raises FieldError."""
    types: tuple
    ok: Callable | None = None
    why: str = ""

    def __call__(self, name: str, v):
        if isinstance(v, bool) and bool not in self.types or not isinstance(v, self.types):
            names = " or ".join(dict.fromkeys(_TYPE_NAMES[t] for t in self.types))
            raise FieldError(f"'{name}' must be {names}, got {json.dumps(v)[:50]}", name)
        if self.ok is not None and not self.ok(v):
            raise FieldError(f"'{name}' {self.why}, got {json.dumps(v)[:50]}", name)
        return v


NUM = (int, float)


def _range(lo, hi, why=None) -> Check:
    return Check(NUM, lambda v: lo <= v <= hi, why or f"must be in [{lo}, {hi}]")


LOGPROBS = Check((int,), lambda v: 0 <= v <= MAX_LOGPROBS, f"must be in 0..{MAX_LOGPROBS}")
TEXT, FLAG, OBJECT = Check((str,)), Check((bool,)), Check((dict,))


@dataclass(frozen=True)
class Field:
    routes: str                   # "completions", "chat" or "both"
    supported: bool
    note: str
    neutral: tuple = ()           # values of a refused field that ask for nothing (accepted)
    origin: str = "OpenAI"        # whose schema it comes from
    check: Check | None = None    # a supported field's parse and range check


def _r(routes, note, *neutral, origin="OpenAI"):
    return Field(routes, False, note, neutral, origin)


def _s(routes, note, check=None, origin="OpenAI"):
    return Field(routes, True, note, (), origin, check)


VLLM, LLAMA, BOTH_ENGINES = "vLLM", "llama-server", "vLLM, llama-server"
PENALTY = Check(NUM, lambda v: 0 < v <= 100, "must be > 0 (1: off)")
GRAMMAR = "an xgrammar token mask (docs/serving.md, Structured output)"

FIELDS: dict[str, Field] = {
    # --- OpenAI: both routes
    "model": _s("both", "the served model's id (`--checkpoint` as typed, its directory name, or a "
                        "`--served-model-name`)", TEXT),
    "max_tokens": _s("both", "tokens to generate (completions: 0 with `echo` scores the prompt only)",
                      Check((int,), lambda v: v >= 0, "must be >= 0")),
    "n": _s("both", "choices per prompt, decoded as rows of the same batch (seeded: seed + choice index)",
             Check((int,), lambda v: 1 <= v <= 128, "must be in 1..128")),
    "temperature": _s("both", "0..2; 0 is greedy", _range(0, 2)),
    "top_p": _s("both", "nucleus sampling, (0, 1]", Check(NUM, lambda v: 0 < v <= 1, "must be in (0, 1]")),
    "seed": _s("both", "per-request generator; the same seed gives the same sample", Check((int,))),
    "stop": _s("both", "a string or up to 16 strings; the output ends before the first one",
                Check((str, list), lambda v: isinstance(v, str) or len(v) <= 16 and all(isinstance(x, str) for x in v),
                      "must be a string or an array of up to 16 strings")),
    "stream": _s("both", "server-sent events, one per token, `data: [DONE]` at the end", FLAG),
    "stream_options": _s("both", "`include_usage` only", OBJECT),
    "presence_penalty": _s("both", "-2..2, subtracted once from every token already generated", _range(-2, 2)),
    "frequency_penalty": _s("both", "-2..2, subtracted per occurrence in the generated tokens", _range(-2, 2)),
    "logprobs": _s("both", "completions: an integer 0..20 (alternatives per token); chat: a boolean", LOGPROBS),
    "user": _s("both", "accepted; an id for the caller's own records, no effect on the output", TEXT),
    "response_format": _s("both", '`{"type": "text"}`, `"json_object"` (any JSON object) or `"json_schema"` (its '
                          '`json_schema.schema`; `strict` accepted): ' + GRAMMAR, OBJECT),
    "logit_bias": _r("both", "no per-token bias", {}),
    # --- OpenAI: completions
    "prompt": _s("completions", "a string, an array of token ids, or an array of either (one choice set each)",
                  Check((str, list))),
    "echo": _s("completions", "the prompt before the output, with its log probabilities when `logprobs` is set", FLAG),
    "best_of": _r("completions", "no server-side best-of ranking", 1),
    "suffix": _r("completions", "no fill-in-the-middle", ""),
    # --- OpenAI: chat
    "messages": _s("chat", "text content (strings or text parts), `tool` results and assistant `tool_calls`, through "
                    "the tokenizer's chat template (or `--chat-template`)",
                    Check((list,), lambda v: len(v) > 0, "must not be empty")),
    "max_completion_tokens": _s("chat", "the same as max_tokens", Check((int,), lambda v: v >= 1, "must be >= 1")),
    "top_logprobs": _s("chat", "0..20 alternatives per token (with `logprobs: true`)", LOGPROBS),
    "audio": _r("chat", "text only"),
    "modalities": _r("chat", "text only", ["text"]),
    "tools": _s("chat", "functions (`type: function`, `name`, `parameters` schema) rendered by the chat template; "
                "a reply's `<tool_call>{...}</tool_call>` (Qwen / Hermes form) becomes `message.tool_calls`",
                Check((list,))),
    "tool_choice": _s("chat", "`none`, `auto` (the model decides; calls parsed from its text), `required` or a named "
                      "function (one call, its arguments constrained to the function's schema)", Check((str, dict))),
    "parallel_tool_calls": _s("chat", "accepted; `auto` returns every call in the reply, a constrained one is one call",
                              FLAG),
    "functions": _r("chat", "no function calling", []),
    "function_call": _r("chat", "no function calling", "none"),
    "metadata": _r("chat", "completions are not stored", {}),
    "store": _r("chat", "completions are not stored", False),
    "prediction": _r("chat", "no predicted outputs"),
    "prompt_cache_key": _r("chat", "the prefix cache needs no key"),
    "reasoning_effort": _r("chat", "not a reasoning model"),
    "verbosity": _r("chat", "not a reasoning model"),
    "safety_identifier": _r("chat", "no safety monitoring"),
    "service_tier": _r("chat", "one tier", "auto", "default"),
    "web_search_options": _r("chat", "no web search"),
    # --- engine extras
    "ignore_eos": _s("both", "keep generating past the end-of-text token", FLAG, BOTH_ENGINES),
    "top_k": _s("both", "keep the k most likely tokens (0 or -1: off)",
                 Check((int,), lambda v: v >= -1, "must be >= 1 (0 or -1: off)"), BOTH_ENGINES),
    "min_p": _s("both", "drop tokens below min_p x the top probability, 0..1", _range(0, 1), BOTH_ENGINES),
    "repetition_penalty": _s("both", "> 0; logits of tokens in the prompt or output divided (positive) or "
                             "multiplied (negative) by it, as in CTRL (Keskar et al., 2019)", PENALTY, VLLM),
    "repeat_penalty": _s("both", "llama-server's name for repetition_penalty", PENALTY, LLAMA),
    "typical_p": _r("both", "no locally typical sampling", 1, 1.0, origin=BOTH_ENGINES),
    "grammar": _s("both", "a GBNF grammar (\"\": none); " + GRAMMAR, TEXT, LLAMA),
    "json_schema": _s("both", "a JSON schema; " + GRAMMAR, Check((dict, bool)), LLAMA),
    "guided_json": _s("both", "a JSON schema (an object or its text); " + GRAMMAR, Check((dict, str)), VLLM),
    "guided_regex": _s("both", "a regular expression; " + GRAMMAR, TEXT, VLLM),
    "guided_choice": _s("both", "one of these strings; " + GRAMMAR, Check((list,)), VLLM),
    "guided_grammar": _s("both", "an EBNF grammar; " + GRAMMAR, TEXT, VLLM),
    "guided_decoding_backend": _s("both", "`xgrammar` or `auto`",
                                  Check((str,), lambda v: v in ("xgrammar", "auto"), "must be 'xgrammar' or 'auto'"),
                                  VLLM),
    "structured_outputs": _s("both", "`json`, `regex`, `choice`, `grammar` or `json_object` (one of them); " + GRAMMAR,
                             OBJECT, VLLM),
    "min_tokens": _r("both", "no minimum length", 0, origin=VLLM),
    "stop_token_ids": _r("both", "stop strings only", [], origin=VLLM),
    "include_stop_str_in_output": _r("both", "the stop string is never returned", False, origin=VLLM),
    "skip_special_tokens": _r("both", "special tokens are always skipped", True, origin=VLLM),
    "spaces_between_special_tokens": _r("both", "special tokens are always skipped", True, origin=VLLM),
    "use_beam_search": _r("both", "no beam search", False, origin=VLLM),
    "length_penalty": _r("both", "no beam search", 1, 1.0, origin=VLLM),
    "bad_words": _r("both", "no banned words", [], origin=VLLM),
    "allowed_token_ids": _r("both", "no token whitelist", origin=VLLM),
    "truncate_prompt_tokens": _r("both", "a prompt too long is refused, never cut", origin=VLLM),
    "prompt_logprobs": _r("both", "use `echo` with `logprobs` (completions)", origin=VLLM),
    "add_special_tokens": _r("both", "the tokenizers here add no special tokens", False, origin=VLLM),
    "return_tokens_as_token_ids": _r("both", "tokens are returned as text", False, origin=VLLM),
    "logits_processors": _r("both", "no custom logits processors", [], origin=VLLM),
    "priority": _r("both", "one priority", 0, origin=VLLM),
    "request_id": _r("both", "the server names requests", origin=VLLM),
    "cache_salt": _r("both", "one prefix cache for all", origin=VLLM),
    "add_generation_prompt": _r("chat", "the template always ends where the assistant speaks", True, origin=VLLM),
    "continue_final_message": _r("chat", "the template always ends where the assistant speaks", False,
                                 origin=VLLM),
    "chat_template": _r("chat", "the server's template only (`--chat-template`)", origin=VLLM),
    "chat_template_kwargs": _r("chat", "the server's template only (`--chat-template`)", {}, origin=VLLM),
    "documents": _r("chat", "no retrieval documents", [], origin=VLLM),
    "mirostat": _r("both", "no Mirostat sampling", 0, origin=LLAMA),
    "mirostat_tau": _r("both", "no Mirostat sampling", origin=LLAMA),
    "mirostat_eta": _r("both", "no Mirostat sampling", origin=LLAMA),
    "tfs_z": _r("both", "no tail-free sampling", 1, 1.0, origin=LLAMA),
    "repeat_last_n": _r("both", "the penalties see the whole prompt and output", origin=LLAMA),
    "penalize_nl": _r("both", "no per-token exemptions from the penalties", origin=LLAMA),
    "presence_penalty_last_n": _r("both", "the penalties see the whole output", origin=LLAMA),
    "dynatemp_range": _r("both", "no dynamic temperature", 0, 0.0, origin=LLAMA),
    "dynatemp_exponent": _r("both", "no dynamic temperature", origin=LLAMA),
    "xtc_probability": _r("both", "no XTC sampling", 0, 0.0, origin=LLAMA),
    "xtc_threshold": _r("both", "no XTC sampling", origin=LLAMA),
    "dry_multiplier": _r("both", "no DRY repetition penalty", 0, 0.0, origin=LLAMA),
    "dry_base": _r("both", "no DRY repetition penalty", origin=LLAMA),
    "dry_allowed_length": _r("both", "no DRY repetition penalty", origin=LLAMA),
    "dry_penalty_last_n": _r("both", "no DRY repetition penalty", origin=LLAMA),
    "dry_sequence_breakers": _r("both", "no DRY repetition penalty", origin=LLAMA),
    "top_n_sigma": _r("both", "no top-n-sigma sampling", -1, origin=LLAMA),
    "min_keep": _r("both", "no minimum candidate count", 0, origin=LLAMA),
    "samplers": _r("both", "a fixed sampler order", origin=LLAMA),
    "n_predict": _r("both", "use max_tokens", origin=LLAMA),
    "n_probs": _r("both", "use logprobs", 0, origin=LLAMA),
    "n_keep": _r("both", "a prompt too long is refused, never cut", origin=LLAMA),
    "n_indent": _r("both", "no indentation stop", 0, origin=LLAMA),
    "cache_prompt": _r("both", "the prefix cache is always on", True, origin=LLAMA),
    "id_slot": _r("both", "slots are assigned by the scheduler", -1, origin=LLAMA),
    "t_max_predict_ms": _r("both", "no time limit per request", 0, origin=LLAMA),
    "post_sampling_probs": _r("both", "log probabilities are of the raw logits", False, origin=LLAMA),
    "return_tokens": _r("both", "tokens are returned as text", False, origin=LLAMA),
    "timings_per_token": _r("both", "no per-token timings", False, origin=LLAMA),
    "lora": _r("both", "no adapters", [], origin=LLAMA),
    "image_data": _r("both", "text only", [], origin=LLAMA),
}


def same(v, x) -> bool:
    """v == x without True == 1."""
    return v == x and isinstance(v, bool) == isinstance(x, bool)


def check(body: dict, route: str):
    """None or (message, field) for the first field of `body` that this route does not take."""
    other = "chat" if route == "completions" else "completions"
    for name, v in body.items():
        f = FIELDS.get(name)
        if f is None:
            return f"unknown field '{name}'", name
        if f.routes == other:
            path = "/v1/chat/completions" if other == "chat" else "/v1/completions"
            return f"'{name}' is a field of {path}, not of this route", name
        if not f.supported and v is not None and not any(same(v, x) for x in f.neutral):
            return f"'{name}' is not supported: {f.note}", name
    return None


def parse(body: dict, name: str, default=None):
    """body[name] through its field's check (a refused field passed by `check` holds a neutral value: as it is);
    `default` when absent or null."""
    v = body.get(name)
    if v is None:
        return default
    f = FIELDS[name]
    return f.check(name, v) if f.check is not None else v


# SamplingParams attribute -> the check of its field
SAMPLING_CHECKS = {"temperature": FIELDS["temperature"].check, "top_p": FIELDS["top_p"].check,
                   "top_k": FIELDS["top_k"].check, "min_p": FIELDS["min_p"].check,
                   "repetition_penalty": PENALTY, "presence_penalty": FIELDS["presence_penalty"].check,
                   "frequency_penalty": FIELDS["frequency_penalty"].check, "logprobs": LOGPROBS,
                   "prompt_logprobs": LOGPROBS}


def check_sampling(params):
    """FieldError for the first SamplingParams value out of its field's range (the engine's check)."""
    for name, check in SAMPLING_CHECKS.items():
        v = getattr(params, name)
        if v is not None:
            check(name, v)


def markdown_table() -> str:
    """The table docs/serving.md shows (tests/test_docs keeps them equal)."""
    rows = ["| field | route | from | | |", "|---|---|---|---|---|"]
    for name, f in FIELDS.items():
        rows.append(f"| `{name}` | {f.routes} | {f.origin} | {'supported' if f.supported else 'refused'} | {f.note} |")
    return "\n".join(rows)
