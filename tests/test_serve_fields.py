"""Every field of the API's table (serve/fields.py, docs/serving.md): a refused one is a 400 naming it (and its
neutral values pass), a supported one has its effect, checked against the model run directly."""
import json
import math
import threading

import pytest
import torch

pytest.importorskip("starlette")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from hybridlm.serve.fields import FIELDS, markdown_table  # noqa: E402
from hybridlm.serve.text import token_text  # noqa: E402
from serve_helpers import ChatBytes, live_server, tiny  # noqa: E402

EOS = 256


@pytest.fixture(scope="module")
def model():
    return tiny("mamba2-attention")


@pytest.fixture(scope="module")
def server(model):
    with live_server(model, max_slots=8) as (url, sch):
        yield url, sch


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=60)


def post(url, body, route="completions"):
    return httpx.post(f"{url}/v1/{'chat/completions' if route == 'chat' else 'completions'}", json=body, timeout=60)


def base(route):
    return {"messages": [{"role": "user", "content": "hi"}]} if route == "chat" else {"prompt": "hi"}


@torch.inference_mode()
def reference(model, ids, n, *, rep=1.0, presence=0.0, frequency=0.0):
    """Greedy tokens by full forward passes, the penalties applied to the raw logits as vLLM applies them
    (repetition: prompt and output tokens, divided when positive and multiplied when negative; presence and
    frequency: output tokens), and each step's log_softmax of the raw logits."""
    seq, out, lps = list(ids), [], []
    for _ in range(n):
        logits = model(torch.tensor([seq])).logits[0, -1].float()
        lps.append(torch.log_softmax(logits, -1))
        z = logits.clone()
        if rep != 1.0:
            seen = torch.tensor(sorted(set(seq)))
            z[seen] = torch.where(z[seen] > 0, z[seen] / rep, z[seen] * rep)
        if out:
            counts = torch.bincount(torch.tensor(out), minlength=z.numel()).float()
            z -= presence * (counts > 0).float() + frequency * counts
        t = int(z.argmax())
        out.append(t)
        seq.append(t)
    return out, lps


def text_of(ids):
    return ChatBytes().decode([t for t in ids if t != EOS])


PROMPT = [7, 100, 42, 42, 9, 13]


# ------------------------------------------------------------------ refused
REFUSED = [(k, f) for k, f in FIELDS.items() if not f.supported]


@pytest.mark.parametrize("name,f", REFUSED, ids=[k for k, _ in REFUSED])
def test_a_refused_field_is_a_400_naming_it(server, name, f):
    url, _ = server
    route = "chat" if f.routes == "chat" else "completions"
    r = post(url, {**base(route), "max_tokens": 1, name: {"asks": "something"}}, route)
    assert r.status_code == 400, (name, r.text)
    err = r.json()["error"]
    assert err["param"] == name and name in err["message"] and err["type"] == "invalid_request_error"
    for v in (None, *f.neutral):                                   # values that ask for nothing pass
        assert post(url, {**base(route), "max_tokens": 1, name: v}, route).status_code == 200, (name, v)


def test_unknown_and_other_routes_fields_are_refused(server):
    url, _ = server
    for body, route, param in (({"prompt": "x", "temprature": 0}, "completions", "temprature"),
                               ({"prompt": "x", "messages": []}, "completions", "messages"),
                               ({**base("chat"), "echo": True}, "chat", "echo"),
                               ({**base("chat"), "prompt": "x"}, "chat", "prompt")):
        r = post(url, body, route)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_docs_show_the_table():
    import os
    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "serving.md")).read()
    assert markdown_table() in doc


# ------------------------------------------------------------------ supported: each one's effect
def check_model(url, client, model):
    assert post(url, {"prompt": "x", "max_tokens": 1, "model": "tiny"}).status_code == 200
    r = post(url, {"prompt": "x", "max_tokens": 1, "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def check_prompt(url, client, model):
    want = text_of(reference(model, PROMPT, 5)[0])
    r = client.completions.create(model="tiny", prompt=[PROMPT, "ab", PROMPT], max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.choices[0].text == r.choices[2].text == want
    assert r.choices[1].text == text_of(reference(model, list(b"ab"), 5)[0])
    assert r.usage.prompt_tokens == 2 * len(PROMPT) + 2 and r.usage.completion_tokens == 15


def check_messages(url, client, model):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
        {"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}], max_tokens=4, temperature=0)
    want = reference(model, list(b"<user>hi\n<assistant>"), 4)[0]
    assert r.choices[0].message.content == text_of(want[:want.index(EOS)] if EOS in want else want)


def check_max_tokens(url, client, model, name="max_tokens", route="completions"):
    body = {**base(route), name: 7, "ignore_eos": True}
    assert post(url, body, route).json()["usage"]["completion_tokens"] == 7


def check_max_completion_tokens(url, client, model):
    check_max_tokens(url, client, model, "max_completion_tokens", "chat")


def check_ignore_eos(url, client, model):
    check_max_tokens(url, client, model)
    ids, _ = reference(model, PROMPT, 30)
    r = post(url, {"prompt": PROMPT, "max_tokens": 30, "temperature": 0}).json()
    n = ids.index(EOS) + 1 if EOS in ids else 30
    assert r["usage"]["completion_tokens"] == n


def check_temperature(url, client, model):
    greedy = text_of(reference(model, PROMPT, 12)[0])
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text == greedy
    hot = {client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=2, seed=s,
                                     extra_body={"ignore_eos": True}).choices[0].text for s in range(4)}
    assert hot - {greedy}                             # sampling at 2 leaves the greedy path


def greedy_by(client, model, **kw):
    """A sampler setting that must reduce temperature-1 sampling to greedy decoding."""
    want, extra = text_of(reference(model, PROMPT, 12)[0]), kw.pop("extra", {})
    for s in range(3):
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1, seed=s,
                                      extra_body={"ignore_eos": True, **extra}, **kw)
        assert r.choices[0].text == want, kw


def check_top_p(url, client, model):
    greedy_by(client, model, top_p=1e-6)


def check_top_k(url, client, model):
    greedy_by(client, model, extra={"top_k": 1})
    assert post(url, {"prompt": "x", "max_tokens": 1, "top_k": -2}).json()["error"]["param"] == "top_k"


def check_min_p(url, client, model):
    greedy_by(client, model, extra={"min_p": 1.0})
    assert post(url, {"prompt": "x", "max_tokens": 1, "min_p": 1.5}).json()["error"]["param"] == "min_p"


def check_seed(url, client, model):
    def one(seed):
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.5, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text
    assert one(3) == one(3) and len({one(s) for s in range(4)}) > 1


def check_n(url, client, model):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, n=3,
                                  extra_body={"ignore_eos": True})
    want = text_of(reference(model, PROMPT, 8)[0])
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.text == want for c in r.choices)
    assert r.usage.prompt_tokens == len(PROMPT) and r.usage.completion_tokens == 24
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.5, n=4, seed=1,
                                  extra_body={"ignore_eos": True})
    assert len({c.text for c in r.choices}) > 1           # each choice its own generator (seed + index)
    first = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.5, seed=1,
                                      extra_body={"ignore_eos": True}).choices[0].text
    assert r.choices[0].text == first
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}],
                                                 max_tokens=4, temperature=0, n=2, stream=True))
    done = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(done) == [0, 1]


def check_stop(url, client, model):
    full = text_of(reference(model, PROMPT, 20)[0])
    stop = next(ch for ch in full[3:] if ch.isprintable() and ch != "\ufffd")
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stop=stop,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[:full.find(stop)] and r.choices[0].finish_reason == "stop"


def check_stream(url, client, model):
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0).choices[0].text
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole


def check_stream_options(url, client, model):
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].choices == []
    r = post(url, {"prompt": "x", "stream_options": {"include_usage": True}})         # without stream
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def penalised(client, model, **pen):
    kw = {"repetition_penalty": "rep", "repeat_penalty": "rep", "presence_penalty": "presence",
          "frequency_penalty": "frequency"}
    ids, _ = reference(model, PROMPT, 24, **{kw[k]: v for k, v in pen.items()})
    plain, _ = reference(model, PROMPT, 24)
    assert ids != plain, "the penalty should change this greedy output"
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True, **pen})
    assert r.choices[0].text == text_of(ids)


def check_presence_penalty(url, client, model):
    penalised(client, model, presence_penalty=2.0)


def check_frequency_penalty(url, client, model):
    penalised(client, model, frequency_penalty=1.5)


def check_repetition_penalty(url, client, model):
    penalised(client, model, repetition_penalty=3.0)


def check_repeat_penalty(url, client, model):
    penalised(client, model, repeat_penalty=3.0)
    r = post(url, {"prompt": "x", "repeat_penalty": 2, "repetition_penalty": 3})
    assert r.json()["error"]["param"] == "repeat_penalty"


def check_logprobs(url, client, model):
    ids, lps = reference(model, PROMPT, 6)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert r.choices[0].text == text_of(ids) and lp.tokens == [token_text(ChatBytes(), t)[0] for t in ids]
    for i, t in enumerate(ids):
        assert math.isclose(lp.token_logprobs[i], lps[i][t].item(), abs_tol=1e-4)
        assert len(lp.top_logprobs[i]) in (3, 4) and max(lp.top_logprobs[i].values()) == pytest.approx(
            lps[i].max().item(), abs=1e-4)
    assert lp.text_offset == [sum(len(x) for x in lp.tokens[:i]) for i in range(6)]
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-5)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0, logprobs=True)
    content = r.choices[0].logprobs.content
    assert bytes(b for c in content for b in c.bytes).decode(errors="replace") == r.choices[0].message.content
    assert all(c.top_logprobs == [] for c in content)


def check_top_logprobs(url, client, model):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)      # greedy: the top one
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs) == 4
    r = post(url, {**base("chat"), "top_logprobs": 2}, "chat")
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


@torch.inference_mode()
def check_echo(url, client, model):
    text = "The box holds kqzv."
    ids = list(text.encode())
    lps = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    # lm-eval's loglikelihood request, exactly as local-completions sends it
    r = post(url, {"model": "tiny", "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
                   "echo": True}).json()
    c = r["choices"][0]
    assert c["text"].startswith(text)
    tl = c["logprobs"]["token_logprobs"]
    assert len(tl) == len(ids) + 1 and tl[0] is None and c["logprobs"]["top_logprobs"][0] is None
    assert tl[1:len(ids)] == pytest.approx([lps[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=1e-4)
    assert all(len(t) >= 1 for t in c["logprobs"]["top_logprobs"][1:])
    r = post(url, {"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 0}).json()       # score only
    assert r["choices"][0]["text"] == text and r["usage"]["completion_tokens"] == 0
    assert len(r["choices"][0]["logprobs"]["token_logprobs"]) == len(ids)
    r = post(url, {"prompt": text, "max_tokens": 2, "echo": True, "temperature": 0, "ignore_eos": True}).json()
    c = r["choices"][0]
    assert c["text"] == text + text_of(reference(model, ids, 2)[0]) and c["logprobs"] is None


def check_user(url, client, model):
    a = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, user="me")
    b = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0)
    assert a.choices[0].text == b.choices[0].text


def _constrained(url, body, pattern, route="completions"):
    """A request with a constraint field: the text matches `pattern`; a bad value of the field is a 400 naming it."""
    import re
    r = post(url, {**base(route), "max_tokens": 60, "temperature": 1, "seed": 1, **body}, route)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    text = c["message"]["content"] if route == "chat" else c["text"]
    assert re.fullmatch(pattern, text) and c["finish_reason"] == "stop", (body, text)


def _refused(url, body, route="completions"):
    name = next(iter(body))
    r = post(url, {**base(route), "max_tokens": 2, **body}, route)
    assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text


SCHEMA = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"], "additionalProperties": False}


def check_response_format(url, client, model):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       response_format={"type": "text"})
    assert r.choices[0].finish_reason in ("stop", "length")
    _constrained(url, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
                 r'\{"a": [12]\}', "chat")
    _refused(url, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 1}}}})


def check_json_schema(url, client, model):
    _constrained(url, {"json_schema": SCHEMA}, r'\{"a": [12]\}')
    _refused(url, {"json_schema": {"type": "nope"}})


def check_guided_json(url, client, model):
    _constrained(url, {"guided_json": json.dumps(SCHEMA)}, r'\{"a": [12]\}', "chat")
    _refused(url, {"guided_json": "{"})


def check_grammar(url, client, model):
    _constrained(url, {"grammar": 'root ::= "x" [0-3]{1,4}'}, r"x[0-3]{1,4}")
    _refused(url, {"grammar": "root ::= ("})


def check_guided_grammar(url, client, model):
    _constrained(url, {"guided_grammar": 'root ::= ("no" | "yes") "."'}, r"(no|yes)\.", "chat")
    _refused(url, {"guided_grammar": "x"})


def check_guided_regex(url, client, model):
    _constrained(url, {"guided_regex": "[ab]{2,3}"}, "[ab]{2,3}")
    _refused(url, {"guided_regex": "[a"})


def check_guided_choice(url, client, model):
    _constrained(url, {"guided_choice": ["left", "right"]}, "left|right")
    _refused(url, {"guided_choice": [1]})


def check_guided_decoding_backend(url, client, model):
    _constrained(url, {"guided_decoding_backend": "xgrammar", "guided_choice": ["z"]}, "z")
    _refused(url, {"guided_decoding_backend": "outlines"})


def check_structured_outputs(url, client, model):
    _constrained(url, {"structured_outputs": {"choice": ["p", "q"]}}, "p|q")
    _refused(url, {"structured_outputs": {"json_object": True, "regex": "a"}})


TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}


def check_tools(url, client, model):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=90,
                                       tools=[TOOL], tool_choice="required")
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "f" and json.loads(call.function.arguments) in ({"a": 1}, {"a": 2})
    _refused(url, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]}, "chat")


def check_tool_choice(url, client, model):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=90,
                                       tools=[TOOL, {"type": "function", "function": {"name": "g"}}],
                                       tool_choice={"type": "function", "function": {"name": "g"}})
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls[0].function.name == "g"
    _refused(url, {"tool_choice": "required"}, "chat")                     # no tools


def check_parallel_tool_calls(url, client, model):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=90,
                                       tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    assert len(r.choices[0].message.tool_calls) == 1
    _refused(url, {"parallel_tool_calls": "yes"}, "chat")


SUPPORTED = {k: f for k, f in FIELDS.items() if f.supported}


@pytest.mark.parametrize("name", list(SUPPORTED))
def test_a_supported_field_has_its_effect(server, client, model, name):
    globals()[f"check_{name}"](server[0], client, model)


def test_every_supported_field_has_a_check():
    assert all(callable(globals().get(f"check_{k}")) for k in SUPPORTED)


# ------------------------------------------------------------------ the rest of the surface
def test_tokenize_and_detokenize(server):
    url, _ = server
    r = httpx.post(url + "/tokenize", json={"prompt": "héllo"}).json()
    assert r == {"tokens": list("héllo".encode()), "count": 6, "max_model_len": 128}
    assert httpx.post(url + "/tokenize", json={"content": "hi"}).json()["tokens"] == [104, 105]      # llama-server
    assert httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "héllo",
                                                                                   "content": "héllo"}
    info = httpx.get(url + "/tokenizer_info").json()
    assert info["eos_token"] == ChatBytes.eos_token and info["chat_template"] == ChatBytes.chat_template
    for path, body, param in (("/detokenize", {"tokens": [999]}, "tokens"), ("/tokenize", {"prompt": 3}, "prompt"),
                              ("/tokenize", {"prompt": "x", "bogus": 1}, "bogus")):
        r = httpx.post(url + path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_a_failed_generation_is_an_openai_error(model):
    """A fault inside a step: the stream gets an error event then [DONE]; a plain request a 500 body;
    finish_reason never says "error"."""
    with live_server(model, max_slots=2) as (url, sch):
        eng = sch.engine
        real = eng.decode
        fired = threading.Event()

        def boom(*a, **k):
            if not fired.is_set():
                fired.set()
                raise RuntimeError("injected fault")
            return real(*a, **k)
        eng.decode = boom
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "abc", "max_tokens": 5, "stream": True,
                                                                   "ignore_eos": True}) as r:
            events = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["type"] == "server_error" and "injected fault" in err["message"]
        fired.clear()
        r = httpx.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 5, "ignore_eos": True})
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
