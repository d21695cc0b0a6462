"""Structured output and tool calls on the API side: which constraint a request body asks for (OpenAI's
`response_format`, vLLM's `guided_*` and `structured_outputs`, llama-server's `json_schema` and `grammar`), its
`tools` and `tool_choice`, the chat messages that carry tool calls and results, and the tool calls parsed out of a
reply. The constraint itself (compile, mask, accept) is models/structured.py's.

Tool calls use the Qwen / Hermes form, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`: `auto`
finds every such block in the reply; `required` and a named function constrain the reply to one of them with a
grammar made from the functions' parameter schemas, so even a small model returns a call whose arguments validate."""
import json
import re
import uuid
from dataclasses import dataclass

from ..models.structured import GrammarError, Spec
from .fields import FieldError

CONSTRAINT_FIELDS = ("response_format", "json_schema", "grammar", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "structured_outputs")
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def _spec(field: str, make, *args) -> Spec:
    try:
        return make(*args)
    except GrammarError as e:
        raise FieldError(f"'{field}': {e}", field) from None


def _one(field: str, v) -> Spec | None:
    """The Spec one constraint field asks for (None: nothing)."""
    if field == "response_format":
        kind = v.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return Spec.json_schema({"type": "object"})
        if kind == "json_schema":
            js = v.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), (dict, bool)):
                raise FieldError("'response_format' json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": "
                                 "{...}}}", field)
            return _spec(field, Spec.json_schema, js.get("schema", {}))
        raise FieldError(f"'response_format' type must be text, json_object or json_schema, got {json.dumps(kind)}",
                         field)
    if field in ("json_schema", "guided_json"):
        return _spec(field, Spec.json_schema, v)
    if field in ("grammar", "guided_grammar"):
        return Spec("grammar", v) if v else None
    if field == "guided_regex":
        return Spec("regex", v)
    if field == "guided_choice":
        return _spec(field, Spec.choice, v)
    # structured_outputs: vLLM's object, one of its keys
    keys = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar"}
    given = {k: x for k, x in v.items() if x is not None and x is not False}
    if len(given) != 1 or next(iter(given)) not in (*keys, "json_object"):
        raise FieldError("'structured_outputs' takes exactly one of json, regex, choice, grammar, json_object", field)
    k, x = next(iter(given.items()))
    if k == "json_object":
        return Spec.json_schema({"type": "object"})
    if k in ("regex", "grammar") and not isinstance(x, str) or k == "choice" and not isinstance(x, list):
        raise FieldError(f"'structured_outputs' {k} has the wrong type", field)
    return _spec(field, Spec.json_schema if k == "json" else Spec.choice if k == "choice" else
                 (lambda t: Spec(k, t)), x)


def constraint(body: dict) -> tuple[Spec, str] | None:
    """(Spec, the field that asked for it) of a request body (after fields.check has passed it), or None. One
    constraint per request: two are a 400 naming the second."""
    found = None
    for field in CONSTRAINT_FIELDS:
        v = body.get(field)
        spec = None if v is None else _one(field, v)
        if spec is not None:
            if found is not None:
                raise FieldError(f"'{field}' and '{found[1]}' both constrain the output: give one", field)
            found = (spec, field)
    return found


@dataclass
class Tools:
    """A chat request's tools: `functions` in OpenAI's form (what the chat template renders), `choice` "auto",
    "required" or a function's name; `spec` the constraint of required / named (None for auto); `every` the
    constraint of a call to any of them (compiled for auto too: a bad parameters schema is a 400 either way)."""
    functions: list[dict]
    choice: str
    spec: Spec | None
    every: Spec


def tools(body: dict) -> Tools | None:
    """The request's tools and tool_choice, checked (None: no tools, or tool_choice "none")."""
    fns = body.get("tools") or []
    choice = body.get("tool_choice")
    names = []
    for i, t in enumerate(fns):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise FieldError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        if not isinstance(f.get("name"), str) or not NAME.match(f["name"]):
            raise FieldError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'", "tools")
        if not isinstance(f.get("parameters", {}), dict):
            raise FieldError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        if f["name"] in names:
            raise FieldError(f"tools[{i}]: a second function named {f['name']!r}", "tools")
        names.append(f["name"])
    if isinstance(choice, dict):
        f = choice.get("function")
        if choice.get("type") != "function" or not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise FieldError("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": "
                             "{\"name\": ...}}", "tool_choice")
        choice = f["name"]
        if choice not in names:
            raise FieldError(f"'tool_choice' names {choice!r}, which is not among the tools", "tool_choice")
    elif choice not in (None, "none", "auto", "required"):
        raise FieldError(f"'tool_choice' must be none, auto, required or a named function, got {json.dumps(choice)}",
                         "tool_choice")
    elif choice in ("auto", "required") and not fns:
        raise FieldError(f"'tool_choice' {choice} needs 'tools'", "tool_choice")
    choice = choice or ("auto" if fns else "none")
    if choice == "none":
        return None
    every = _spec("tools", Spec.tools, [t["function"] for t in fns])
    named = [t["function"] for t in fns if t["function"]["name"] == choice]
    spec = None if choice == "auto" else every if choice == "required" else _spec("tools", Spec.tools, named)
    return Tools(fns, choice, spec, every)


def messages(raw: list) -> list[dict]:
    """Chat messages as the template reads them: content as text (text parts joined; "" for an assistant turn
    that only calls tools), an assistant's `tool_calls` with their arguments as objects (as transformers'
    templates expect), a tool result's `tool_call_id` and `name`."""
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise FieldError(f"messages[{i}] must be an object with a string 'role'", "messages")
        content = m.get("content")
        if isinstance(content, list):               # content parts: the text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise FieldError(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        calls = m.get("tool_calls")
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise FieldError(f"messages[{i}].content must be a string", "messages")
        msg = {"role": m["role"], "content": content}
        if calls:
            msg["tool_calls"] = [_history_call(i, c) for c in calls]
        for key in ("tool_call_id", "name"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        out.append(msg)
    return out


def _history_call(i: int, c) -> dict:
    f = c.get("function") if isinstance(c, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise FieldError(f"messages[{i}].tool_calls: each is {{\"type\": \"function\", \"function\": {{\"name\", "
                         "\"arguments\"}}}}", "messages")
    args = f.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except json.JSONDecodeError:
            raise FieldError(f"messages[{i}].tool_calls: arguments of {f['name']!r} are not JSON", "messages") \
                from None
    return {"id": c.get("id"), "type": "function", "function": {"name": f["name"], "arguments": args}}


def parse_calls(text: str) -> tuple[str | None, list[dict]]:
    """(the content left, OpenAI tool_calls) of a reply: every `<tool_call>{"name", "arguments"}</tool_call>`
    block whose body is a JSON object with a string name; other text (and blocks that are not) stays content."""
    calls, kept, at = [], [], 0
    for m in CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": obj["name"],
                                   "arguments": args if isinstance(args, str) else json.dumps(args)}})
        kept.append(text[at:m.start()])
        at = m.end()
    kept.append(text[at:])
    content = "".join(kept).strip() if calls else text
    return (content or None) if calls else text, calls
