"""Structured output and tool calls: xgrammar against every tokenizer kind, `generate` constrained, and the live
server through the official `openai` client (JSON schemas, regexes, choices, grammars, tool calls)."""
import json
import re

import pytest
import torch

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from hybridlm.data.tokenizer import BPETokenizer, ByteTokenizer  # noqa: E402
from hybridlm.models.structured import Grammars, Spec, mask_logits  # noqa: E402
from serve_helpers import ChatBytes, tiny  # noqa: E402

SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                         "maximum": 99}},
     "required": ["ok", "n"], "additionalProperties": False},
    # (not maxLength: xgrammar 0.2.9 lets a raw control character into such a string, which JSON forbids)
    {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "tag": {"type": "string",
                                                                                          "pattern": "^[a-z]{1,3}$"}},
     "required": ["city", "tag"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 3},
]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}},
                                       "required": ["utc"], "additionalProperties": False}}}


def walk(tok, V, spec, seed=0, steps=300):
    """Sample a random-logits walk through the constraint: (decoded text, finished)."""
    c = Grammars(tok, V).constraint(spec)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = mask_logits(torch.randn(1, V, generator=g), [c])
        t = int(torch.multinomial(torch.softmax(x, -1), 1, generator=g))
        assert c.accept(t)
        if c.finished:
            assert t == tok.eos_id
            return tok.decode(out), True
        out.append(t)
    return tok.decode(out), False


def _sentencepiece_like() -> BPETokenizer:
    """A Llama-style vocabulary: ▁ for spaces, <0xNN> byte fallback, </s> (what converted checkpoints carry)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for w in ["▁", "▁true", "▁false", "{\"", "\":", ",", "}", "ok", "n", "1", "2", "ue", "\""]:
        vocab.setdefault(w, len(vocab))
    sp = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    sp.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    sp.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    sp.add_special_tokens([AddedToken("</s>", special=True)])
    return BPETokenizer(sp, "</s>")


TOKENIZERS = {
    "byte": lambda: (ByteTokenizer(), 300),                 # the model's vocabulary padded past the tokenizer's
    "bpe": lambda: (BPETokenizer.train(['{"ok": true, "n": 12, "city": "Paris"} hello world'] * 20, 300), 320),
    "sentencepiece": lambda: (_sentencepiece_like(), 300),
}


@pytest.mark.parametrize("kind", list(TOKENIZERS))
def test_every_tokenizer_kind_gives_valid_json(kind):
    tok, V = TOKENIZERS[kind]()
    info = Grammars(tok, V).info
    assert info.vocab_size == V and info.stop_token_ids == [tok.eos_id]
    if kind == "byte":
        assert info.vocab_type == xgr.VocabType.RAW and info.decoded_vocab[65] == b"A"
    if kind == "sentencepiece":
        assert info.vocab_type == xgr.VocabType.BYTE_FALLBACK
    for seed in range(3):
        for schema in SCHEMAS:
            text, done = walk(tok, V, Spec.json_schema(schema), seed)
            assert done, text
            jsonschema.validate(json.loads(text), schema)


def test_regex_choice_grammar_and_tools_specs():
    tok = ByteTokenizer()
    assert re.fullmatch(r"[a-c]{2}\d", walk(tok, 257, Spec("regex", r"[a-c]{2}\d"))[0])
    assert walk(tok, 257, Spec.choice(["yes", "no", "a \"quoted\" é"]), 3)[0] in ("yes", "no", "a \"quoted\" é")
    assert re.fullmatch(r"x[0-9]+y", walk(tok, 257, Spec("grammar", 'root ::= "x" [0-9]+ "y"'))[0])
    text = walk(tok, 257, Spec.tools([WEATHER["function"], TIME["function"]]), 1)[0]
    m = re.fullmatch(r"<tool_call>\n(.*)\n</tool_call>", text, re.S)
    call = json.loads(m.group(1))
    fn = {"get_weather": WEATHER, "get_time": TIME}[call["name"]]["function"]
    jsonschema.validate(call["arguments"], fn["parameters"])


def test_batched_fill_equals_one_row_at_a_time():
    g = Grammars(ByteTokenizer(), 300)
    specs = [Spec.json_schema(SCHEMAS[0]), Spec("regex", "[0-9]+"), Spec.choice(["ab", "cd"])]
    rows = [g.constraint(s) for s in specs]
    for c, t in zip(rows, b"{1a"):
        c.accept(t)
    x = torch.randn(5, 300)
    one = x.clone()
    for c, i in zip(rows, [4, 0, 2]):
        mask_logits(one[i:i + 1], [c])
    assert torch.equal(mask_logits(x.clone(), rows, [4, 0, 2]), one)


def test_rollback_replays_the_masks():
    """A verify step over drafted tokens (speculative decoding) accepts them one by one, each position's mask filled
    in turn, then rolls back the rejected ones: the masks after a rollback are those of the first pass."""
    c = Grammars(ByteTokenizer(), 257).constraint(Spec("regex", "ab[0-9]+(x|y)"))
    bm, masks = xgr.allocate_token_bitmask(1, 257), []
    for t in b"ab12x":
        c.fill(bm, 0)
        masks.append(bm.clone())
        assert c.accept(t)
    assert c.finished is False and not c.accept(ord("z"))
    c.rollback(4)
    for t, m in zip(b"b12x", masks[1:]):
        c.fill(bm, 0)
        assert torch.equal(bm, m)
        assert c.accept(t)


def test_compile_cache_and_bad_specs():
    from hybridlm.models.structured import GrammarError
    g = Grammars(ByteTokenizer(), 257, size=2)
    a = g.compile(Spec.json_schema(SCHEMAS[0]))
    assert g.compile(Spec.json_schema(json.dumps(SCHEMAS[0]))) is a and g.last_compile_s == 0    # same text: a hit
    g.compile(Spec("regex", "a+"))
    g.compile(Spec("regex", "b+"))
    assert Spec.json_schema(SCHEMAS[0]) not in g.cache and len(g.cache) == 2                      # LRU: 2 kept
    for spec, what in ((Spec.json_schema({"type": 5}), "JSON schema"), (Spec("regex", "("), "regex"),
                       (Spec("grammar", "root ::= "), "grammar")):
        with pytest.raises(GrammarError, match=what):
            g.compile(spec)


def test_generate_json_schema_and_regex():
    m, tok = tiny("mamba2-attention", max_seq_len=256), ChatBytes()
    ids = torch.tensor([list(b"hello"), list(b"world")])
    for schema in SCHEMAS:
        out = m.generate(ids, 120, temperature=0.7, json_schema=schema, tokenizer=tok,
                         generator=torch.Generator().manual_seed(0))
        for row in out[:, 5:].tolist():
            assert tok.eos_id in row
            jsonschema.validate(json.loads(tok.decode(row[:row.index(tok.eos_id)])), schema)
    out = m.generate(ids[:1], 30, temperature=0, regex=r"(ab|cd){1,3}x", tokenizer=tok)[0, 5:].tolist()
    assert re.fullmatch(r"(ab|cd){1,3}x", tok.decode(out[:out.index(tok.eos_id)]))
    from hybridlm.errors import InputError
    with pytest.raises(InputError, match="tokenizer"):
        m.generate(ids, 5, regex="a+")
    with pytest.raises(InputError, match="one of"):
        m.generate(ids, 5, regex="a+", grammar='root ::= "a"', tokenizer=tok)


def test_generate_command_json_schema(tmp_path):
    from hybridlm.checkpoint import save_checkpoint
    from hybridlm.cli import main
    m = tiny("mamba2", max_seq_len=256)
    save_checkpoint(str(tmp_path / "run"), m, tokenizer=ByteTokenizer())
    (tmp_path / "s.json").write_text(json.dumps(SCHEMAS[1]))
    out = tmp_path / "out.txt"
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "x", "--max-new-tokens", "60",
                     "--json-schema", str(tmp_path / "s.json"), "--temperature", "0"]) == 0
    text = buf.getvalue()
    jsonschema.validate(json.loads(text[text.index("x") + 1:].strip()), SCHEMAS[1])
    del out


# ------------------------------------------------------------------ the live server
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")


class ToolBytes(ChatBytes):
    """The byte tokenizer with a Hermes-style template: tools listed, assistant tool calls and tool results shown."""
    chat_template = (
        "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}</tools>\n{% endif %}"
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
        "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
        "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def model():
    return tiny("mamba2-attention", max_seq_len=512)


@pytest.fixture(scope="module")
def server(model):
    from serve_helpers import live_server
    with live_server(model, ToolBytes(), max_slots=4) as (url, sch):
        yield url, sch


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=120)


def chat(client, **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=kw.pop("max_tokens", 150), **kw)


def test_json_schema_answers_validate(client):
    for i, schema in enumerate(SCHEMAS):
        r = chat(client, temperature=0.8, seed=i, top_p=0.9, presence_penalty=0.5, response_format={
            "type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    done = 0
    for seed in range(4):                    # any object: an untrained model may run out of tokens inside it
        r = chat(client, temperature=1, seed=seed, max_tokens=200, response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
            done += 1
    assert done


def test_three_schemas_in_one_batch(server, model):
    """Three rows, three schemas, decoded together (and each as `generate` gives it alone, greedily)."""
    import threading
    url, _ = server
    out = [None] * 3

    def one(i):
        out[i] = httpx.post(url + "/v1/completions", timeout=120, json={
            "prompt": "data:", "max_tokens": 100, "temperature": 0, "json_schema": SCHEMAS[i]}).json()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tok = ToolBytes()
    for i, r in enumerate(out):
        text = r["choices"][0]["text"]
        jsonschema.validate(json.loads(text), SCHEMAS[i])
        want = model.generate(torch.tensor([list(b"data:")]), 100, temperature=0, json_schema=SCHEMAS[i],
                              tokenizer=tok)[0, 5:].tolist()
        assert text == tok.decode(want[:want.index(tok.eos_id)])


def test_regex_choice_grammar_fields(server, client):
    url, _ = server
    for body, pattern in (({"guided_regex": r"\d{3}-[a-z]{2}"}, r"\d{3}-[a-z]{2}"),
                          ({"structured_outputs": {"regex": r"(yes|no)!"}}, r"(yes|no)!"),
                          ({"guided_choice": ["red", "green", "blue"]}, r"red|green|blue"),
                          ({"structured_outputs": {"choice": ["up", "down"]}}, r"up|down"),
                          ({"grammar": 'root ::= "<" [a-z]+ ">"'}, r"<[a-z]+>"),
                          ({"guided_grammar": 'root ::= ("ab")+ "."'}, r"(ab)+\.")):
        for route in ("completions", "chat"):
            r = client.completions.create(model="tiny", prompt="q:", max_tokens=60, temperature=1, seed=3,
                                          extra_body=body) if route == "completions" else \
                chat(client, max_tokens=60, temperature=1, seed=3, extra_body=body)
            text = r.choices[0].text if route == "completions" else r.choices[0].message.content
            assert re.fullmatch(pattern, text) and r.choices[0].finish_reason == "stop", (body, text)
    for body in ({"guided_json": json.dumps(SCHEMAS[0])}, {"structured_outputs": {"json": SCHEMAS[0]}}):
        jsonschema.validate(json.loads(client.completions.create(model="tiny", prompt="q", max_tokens=60,
                                                                 temperature=0, extra_body=body).choices[0].text),
                            SCHEMAS[0])


def test_streaming_equals_non_streaming(client):
    kw = dict(temperature=0.9, seed=5, logprobs=True, top_logprobs=2,
              response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMAS[1]}})
    whole = chat(client, **kw)
    chunks = list(chat(client, stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert [e.token for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content] == \
        [e.token for e in whole.choices[0].logprobs.content]
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        kw = dict(temperature=1, seed=2, tools=[WEATHER, TIME], tool_choice=tool_choice)
        whole = chat(client, **kw).choices[0]
        chunks = list(chat(client, stream=True, **kw))
        calls = {}
        for c in chunks:
            for d in c.choices[0].delta.tool_calls or []:
                e = calls.setdefault(d.index, {"name": "", "arguments": ""})
                e["name"] += d.function.name or ""
                e["arguments"] += d.function.arguments or ""
        assert [(t.function.name, t.function.arguments) for t in whole.message.tool_calls] == \
            [(e["name"], e["arguments"]) for _, e in sorted(calls.items())]
        assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "tool_calls"


def _check_call(call, tools):
    fn = next(t["function"] for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), fn["parameters"])
    assert call.type == "function" and call.id.startswith("call_")


def test_named_and_required_tool_choice(client):
    tools = [WEATHER, TIME]
    for seed in range(3):
        r = chat(client, temperature=1, seed=seed, tools=tools, tool_choice="required").choices[0]
        assert r.finish_reason == "tool_calls" and len(r.message.tool_calls) == 1 and r.message.content is None
        _check_call(r.message.tool_calls[0], tools)
        r = chat(client, temperature=1, seed=seed, tools=tools,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
        assert r.message.tool_calls[0].function.name == "get_weather"
        _check_call(r.message.tool_calls[0], tools)
    # the call and its result go back into the history: the template renders both
    call = r.message.tool_calls[0]
    r = client.chat.completions.create(model="tiny", max_tokens=5, temperature=0, tools=tools, messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}], tool_choice="none")
    assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls


def test_auto_parses_the_hermes_form():
    from hybridlm.serve.api import Shape
    from hybridlm.serve.structured import parse_calls
    text = 'let me look\n<tool_call>\n{"name": "get_time", "arguments": {"utc": true}}\n</tool_call>\n' \
           '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>not json</tool_call>'
    content, calls = parse_calls(text)
    assert content == "let me look\n\n<tool_call>not json</tool_call>"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_time", {"utc": True}), ("f", {})]
    assert parse_calls("plain text") == ("plain text", [])
    body, reason = Shape(chat=True, tools=True).message(text, "stop")
    assert reason == "tool_calls" and len(body["message"]["tool_calls"]) == 2
    deltas, reason = Shape(chat=True, tools=True).closing(text, "stop")       # streamed: content, then each call
    assert reason == "tool_calls" and deltas[0] == {"content": content}
    assert [d["tool_calls"][0]["index"] for d in deltas[1:]] == [0, 0, 1, 1]
    assert deltas[1]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": ""}
    assert deltas[2]["tool_calls"][0]["function"] == {"arguments": '{"utc": true}'}
    assert Shape(chat=True, tools=True).closing("no call", "length") == ([{"content": "no call"}], "length")


def test_auto_tool_choice_renders_the_tools(server, client):
    url, _ = server
    r = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200
    r = chat(client, max_tokens=4, temperature=0, tools=[WEATHER])           # auto: free text here (untrained)
    assert r.choices[0].finish_reason in ("stop", "length")


BAD = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
        "response_format"),
       ({"response_format": {"type": "xml"}}, "response_format"),
       ({"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}, "json_schema"),
       ({"guided_json": "{not json"}, "guided_json"),
       ({"guided_regex": "(unclosed"}, "guided_regex"),
       ({"guided_choice": []}, "guided_choice"),
       ({"grammar": "root ::= "}, "grammar"),
       ({"guided_grammar": "nonsense"}, "guided_grammar"),
       ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
       ({"guided_regex": "a", "grammar": 'root ::= "a"'}, "guided_regex"),
       ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
       ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
       ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]}, "tools"),
       ({"tools": [{"type": "code"}]}, "tools"),
       ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
       ({"tool_choice": "required"}, "tool_choice"),
       ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
       ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice")]


@pytest.mark.parametrize("body,param", BAD, ids=[p + str(i) for i, (_, p) in enumerate(BAD)])
def test_bad_constraints_are_a_400_naming_the_field(server, body, param):
    url, _ = server
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 3, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_schema_bench_through_the_bench_command(tmp_path):
    """`hybridlm bench --suite serve --quick --schema FILE`: mask and decode step per batch size, compile times."""
    from hybridlm.cli import main
    (tmp_path / "s.json").write_text(json.dumps(SCHEMAS[0]))
    out = tmp_path / "schema.json"
    assert main(["bench", "--suite", "serve", "--quick", "--schema", str(tmp_path / "s.json"), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = res["presets"]["mamba2"]["batches"]
    assert list(rows) == ["1", "2"] and all(r["mask_ms"] > 0 and r["decode_ms"] > 0 for r in rows.values())
    assert res["compile_s"][str(tmp_path / "s.json")] > 0 and res["vocab_size"] == 257


def test_chat_template_flag(tmp_path):
    """`hybridlm serve --chat-template FILE`: a run whose tokenizer has no template chats (and renders tools) with it;
    a file that cannot be read is one clear error."""
    from starlette.testclient import TestClient
    from hybridlm.checkpoint import save_checkpoint
    from hybridlm.cli import build_parser
    from hybridlm.commands.serve import build
    from hybridlm.errors import InputError
    save_checkpoint(str(tmp_path / "run"), tiny("mamba2", max_seq_len=256), tokenizer=ByteTokenizer())
    (tmp_path / "t.jinja").write_text(ToolBytes.chat_template)
    argv = ["serve", "--checkpoint", str(tmp_path / "run"), "--dtype", "float32", "--chat-template"]
    app, _ = build(build_parser().parse_args(argv + [str(tmp_path / "t.jinja")]))
    with TestClient(app) as c:
        assert c.get("/tokenizer_info").json()["chat_template"] == ToolBytes.chat_template
        r = c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.json()["tokens"] == list(b"<user>hi\n<assistant>")
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 90,
                                                 "tools": [TIME], "tool_choice": "required"})
        assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time"
    with pytest.raises(InputError, match="--chat-template"):
        build(build_parser().parse_args(argv + [str(tmp_path / "missing.jinja")]))


def _trained():
    """A tiny model trained for ~100 steps (seconds) on answers in one JSON shape."""
    import random
    m = tiny("mamba2-attention", max_seq_len=256, d_model=64).train()
    rng = random.Random(0)

    def doc():
        return "Q: city?\nA: " + json.dumps({"city": rng.choice(["Paris", "Rome", "Oslo"]), "n": rng.randint(0, 9)}) \
            + "\n"
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    for _ in range(100):
        ids = torch.tensor([list("".join(doc() for _ in range(3)).encode())[:96] for _ in range(8)])
        loss = m(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m.eval()


@pytest.mark.slow
def test_a_trained_model_keeps_its_answer_under_its_schema():
    """A model that already answers in the schema's shape answers the same under the mask (greedy), and one that
    the schema contradicts still validates; a named tool call's arguments validate."""
    from serve_helpers import live_server
    torch.manual_seed(0)
    m = _trained()
    prompt = list(b"Q: city?\nA: ")
    free = m.generate(torch.tensor([prompt]), 30, temperature=0)[0, len(prompt):].tolist()
    free = bytes(t for t in free if t < 256).decode(errors="replace").split("\n")[0]
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["city", "n"], "additionalProperties": False}
    jsonschema.validate(json.loads(free), schema)
    other = {"type": "object", "properties": {"town": {"enum": ["Bergen", "Graz"]}}, "required": ["town"],
             "additionalProperties": False}
    with live_server(m, ToolBytes()) as (url, _):
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        r = c.completions.create(model="tiny", prompt="Q: city?\nA: ", max_tokens=40, temperature=0,
                                 extra_body={"json_schema": schema})
        assert r.choices[0].text == free
        r = c.completions.create(model="tiny", prompt="Q: city?\nA: ", max_tokens=40, temperature=0,
                                 extra_body={"json_schema": other})
        jsonschema.validate(json.loads(r.choices[0].text), other)
        r = chat(c, temperature=0.5, seed=1, tools=[WEATHER], tool_choice={"type": "function",
                                                                          "function": {"name": "get_weather"}})
        _check_call(r.choices[0].message.tool_calls[0], [WEATHER])


def test_auto_end_to_end_through_the_client(client):
    """tool_choice auto: a reply holding text and a call (forced here by a choice constraint) comes back as content
    and tool_calls, streamed or not, and the official client parses both."""
    reply = 'sure <tool_call>\n{"name": "get_time", "arguments": {"utc": false}}\n</tool_call>'
    kw = dict(temperature=0, tools=[WEATHER, TIME], extra_body={"guided_choice": [reply]})
    r = chat(client, **kw).choices[0]
    assert r.finish_reason == "tool_calls" and r.message.content == "sure"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in r.message.tool_calls] == \
        [("get_time", {"utc": False})]
    chunks = list(chat(client, stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "sure"
    args = "".join(d.function.arguments or "" for c in chunks for d in c.choices[0].delta.tool_calls or [])
    assert json.loads(args) == {"utc": False} and chunks[-1].choices[0].finish_reason == "tool_calls"
