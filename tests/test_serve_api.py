"""The OpenAI-compatible server, live on a loopback port, through the official `openai` client."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from hybridlm.serve import Request, SamplingParams  # noqa: E402
from hybridlm.serve.text import TextStream  # noqa: E402
from serve_helpers import FAMILIES, ChatBytes, free_port, live_server, tiny  # noqa: E402

KEY = "sk-test"


@pytest.fixture(scope="module")
def model():
    return tiny("mamba2-attention")


@pytest.fixture(scope="module")
def server(model):
    with live_server(model, api_key=KEY, max_slots=4) as (url, sch):
        yield url, sch


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=30)


def expected(model, ids, n, eos=256):
    """The text `generate` gives greedily for prompt ids (up to the end of text), and its token count."""
    out = model.generate(torch.tensor([ids]), n, temperature=0)[0, len(ids):].tolist()
    cut = out.index(eos) + 1 if eos in out else len(out)
    return ChatBytes().decode([t for t in out[:cut] if t != eos]), cut


def test_completion_text_and_usage(client, model):
    prompt = "def add(a, b):"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    text, n = expected(model, list(prompt.encode()), 12)
    assert r.choices[0].text == text and r.object == "text_completion"
    assert r.choices[0].finish_reason == ("length" if n == 12 else "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(prompt), n, len(prompt) + n)
    ids = [5, 77, 250, 31]                             # a prompt of token ids
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    want = model.generate(torch.tensor([ids]), 5, temperature=0)[0, 4:].tolist()
    assert r.choices[0].text == ChatBytes().decode(want)
    assert r.usage.completion_tokens == 5


def test_chat_uses_the_template(client, model):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    text, n = expected(model, list("<system>be brief\n<user>hi\n<assistant>".encode()), 8)
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == n and r.object == "chat.completion"
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_streaming_sse_and_usage(server, client, model):
    url, _ = server
    kw = dict(model="tiny", prompt="import os\n", max_tokens=10, temperature=0)
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == 10
    with httpx.stream("POST", url + "/v1/completions", json={**kw, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [x for x in r.iter_lines() if x]
    assert lines[-1] == "data: [DONE]" and all(x.startswith("data: ") for x in lines)


def test_stop_strings_cut_as_openai(server, client, model):
    ids = [1, 2, 3]
    full = ChatBytes().decode(model.generate(torch.tensor([ids]), 30, temperature=0)[0, 3:].tolist())
    stop = next(ch for ch in full[2:] if ch != "\ufffd" and ch.isprintable())     # (two bytes: "ö")
    want = full[:full.find(stop)]
    kw = dict(model="tiny", prompt=ids, max_tokens=30, temperature=0, stop=[stop, "never-seen"],
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    assert r.usage.completion_tokens < 30
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want and chunks[-1].choices[0].finish_reason == "stop"
    assert "abort" not in server[1].metrics.requests             # a stop string is a stop


class _Chars:
    def decode(self, ids):
        return "".join(ids)


def test_text_stream_holds_back_a_possible_stop():
    t = TextStream(_Chars(), ["cd", "xyz"])
    assert [t.add(c) for c in "abc"] == ["a", "b", ""]        # "c" may start "cd"
    assert t.add("e") == "ce" and t.add("x") == "" and t.add("y") == ""
    assert t.add("c") == "xy" and t.add("d") == "" and t.stopped and t.text == "abcexy"
    t = TextStream(_Chars(), ["cd"])
    assert t.add("a") == "a" and t.add("c") == "" and t.finish() == "c"


class _Counting(ChatBytes):
    """The byte tokenizer, counting the token ids it decodes."""
    decoded = 0

    def decode(self, ids):
        ids = list(ids)
        self.decoded += len(ids)
        return super().decode(ids)


def test_text_stream_is_incremental_and_whole_characters():
    text = "héllo wörld — 日本語 🎉 naïve " * 200
    tok = _Counting()
    t = TextStream(tok, [])
    pieces = [t.add(b) for b in text.encode()]
    assert "".join(pieces) + t.finish() == text
    assert not any("\ufffd" in p for p in pieces)                # a character is sent whole, never half
    assert sum(1 for p in pieces if p) == len(text)               # each as soon as its last byte arrives
    assert tok.decoded < 8 * len(text.encode())                    # a short window per token, not the whole output
    t = TextStream(ChatBytes(), ["日本", "🎉"])                    # stop strings met across tokens, multi-byte
    out = "".join(t.add(b) for b in "ab 日本語".encode())
    assert (out, t.stopped, t.tokens) == ("ab ", True, 9)
    t = TextStream(ChatBytes(), [])
    assert t.add(0xE6) == "" and t.finish() == "\ufffd"           # an unfinished character at the end


@pytest.mark.parametrize("name", FAMILIES)
def test_server_greedy_equals_generate_concurrently(name):
    """Requests of mixed lengths, sent at once so they share the batch and join it mid-flight, some sharing a
    prefix of two blocks: each gets exactly what `generate` gives it alone."""
    m = tiny(name)
    g = torch.Generator().manual_seed(2)
    base = torch.randint(0, 256, (40,), generator=g).tolist()
    prompts = [base[:n] for n in (3, 40, 17)] + [base[:32] + [1, 2, 3], base[:33], torch.randint(0, 256, (9,)).tolist()]
    ns = [9, 4, 7, 6, 5, 8]
    results = [None] * len(prompts)
    with live_server(m, max_slots=3, block=16) as (url, sch):
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)

        def ask(i):
            time.sleep(0.02 * i)
            r = c.completions.create(model="tiny", prompt=prompts[i], max_tokens=ns[i], temperature=0,
                                     extra_body={"ignore_eos": True})
            results[i] = r.choices[0].text
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert sch.engine.prefix.hits >= 1
    for p, n, got in zip(prompts, ns, results):
        assert got == ChatBytes().decode(m.generate(torch.tensor([p]), n, temperature=0)[0, len(p):].tolist()), name


def _post(url, body, key=KEY, raw=None):
    h = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        return httpx.post(url + "/v1/completions", content=raw, headers={**h, "Content-Type": "application/json"})
    return httpx.post(url + "/v1/completions", json=body, headers=h)


def test_errors_are_openai_shaped(server, client):
    url, sch = server
    ok = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    cases = [
        (_post(url, None, raw=b'{"prompt": '), 400, None),
        (_post(url, None, raw=b'[1, 2]'), 400, None),
        (_post(url, {**ok, "max_tokens": "5"}), 400, "max_tokens"),
        (_post(url, {**ok, "temperature": "hot"}), 400, "temperature"),
        (_post(url, {**ok, "stream": 1}), 400, "stream"),
        (_post(url, {**ok, "max_tokens": 0}), 400, "max_tokens"),
        (_post(url, {**ok, "max_tokens": 120, "prompt": "x" * 20}), 400, "max_tokens"),
        (_post(url, {**ok, "prompt": [1, 300]}), 400, "prompt"),
        (_post(url, {**ok, "prompt": [-1]}), 400, "prompt"),
        (_post(url, {**ok, "n": 0}), 400, "n"),
        (_post(url, {**ok, "frequency_penalty": 2.5}), 400, "frequency_penalty"),
        (_post(url, {**ok, "grammar": "root ::= x"}), 400, "grammar"),
        (_post(url, {**ok, "no_such_field": 1}), 400, "no_such_field"),
        (_post(url, {k: v for k, v in ok.items() if k != "prompt"}), 400, "prompt"),
        (_post(url, ok, key=None), 401, None),
        (_post(url, ok, key="wrong"), 401, None),
        (_post(url, {**ok, "model": "gpt-4"}), 404, "model"),
        (httpx.get(url + "/v1/nothing", headers={"Authorization": f"Bearer {KEY}"}), 404, None),
        (_post(url, {**ok, "prompt": "x" * 70000}), 413, None),
    ]
    for r, status, param in cases:
        assert r.status_code == status, (r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        assert err["param"] == param, err
    assert _post(url, {**ok, "max_tokens": 120, "prompt": "x" * 20}).json()["error"]["code"] == \
        "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="bad", max_retries=0).models.list()
    assert httpx.get(url + "/health").json() == {"status": "ok"}          # no key needed
    assert httpx.get(url + "/metrics").status_code == 401
    sch.max_queue = 0                                                       # a full queue
    try:
        r = _post(url, ok)
        assert r.status_code == 429 and r.headers["retry-after"] and r.json()["error"]["code"] == "queue_full"
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    finally:
        sch.max_queue = 64


def test_bad_requests_do_not_disturb_a_stream(server, client, model):
    url, _ = server
    ids = [3, 1, 4, 1, 5]
    want = ChatBytes().decode(model.generate(torch.tensor([ids]), 25, temperature=0)[0, 5:].tolist())
    got = []

    def stream():
        for c in client.completions.create(model="tiny", prompt=ids, max_tokens=25, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}):
            got.append(c.choices[0].text)
    t = threading.Thread(target=stream)
    t.start()
    for body in ({"prompt": [999]}, {"prompt": "x", "max_tokens": -3}, {"prompt": "x", "top_p": 7}):
        assert _post(url, {"model": "tiny", **body}).status_code == 400
    assert _post(url, None, raw=b"\xff\xfe").status_code == 400
    t.join(60)
    assert "".join(got) == want


def test_models_health_metrics(server, client):
    url, _ = server
    assert [m.id for m in client.models.list().data] == ["tiny"]
    client.completions.create(model="tiny", prompt="hello", max_tokens=3)
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for name in ('request_success_total{finished_reason="length"}', "generation_tokens_total",
                 "num_requests_running", "num_requests_waiting", "slot_occupancy", "prefix_cache_hits_total",
                 "time_to_first_token_seconds_bucket", "time_per_output_token_seconds_count",
                 "e2e_request_latency_seconds_sum"):
        assert f"hybridlm:{name}" in text, name
    from prometheus_client.parser import text_string_to_metric_families
    assert {f.name for f in text_string_to_metric_families(text)} >= {"hybridlm:num_requests_running",
                                                                      "hybridlm:request_success"}


def test_disconnect_frees_the_slot(model):
    with live_server(model, max_slots=1) as (url, sch):
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "abc", "max_tokens": 100, "stream": True,
                                                                   "ignore_eos": True, "temperature": 0}) as r:
            next(r.iter_lines())                        # the stream is flowing, then the client goes away
        deadline = time.time() + 10
        while sch.counts()["running"] and time.time() < deadline:
            time.sleep(0.01)
        assert sch.counts()["running"] == 0
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
        assert c.completions.create(model="tiny", prompt="x", max_tokens=3, extra_body={"ignore_eos": True}) \
            .usage.completion_tokens == 3                # the one slot serves the next request
        assert sch.metrics.requests.get("abort") == 1


def test_model_names():
    from hybridlm.commands.serve import model_names
    assert model_names("runs/m2a/", None) == ["runs/m2a/", "m2a"]
    assert model_names("runs/m2a", ["prod", "m2a"]) == ["prod", "m2a", "runs/m2a"]
    from hybridlm.serve import Engine, Scheduler
    from hybridlm.serve.api import create_app
    app = create_app(Scheduler(Engine(tiny("mamba2"), eos_id=256, block=8)), ChatBytes(), ["runs/m2a", "m2a"])
    from starlette.testclient import TestClient
    with TestClient(app) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["runs/m2a", "m2a"]
        for name in ("runs/m2a", "m2a"):
            r = c.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 1})
            assert r.status_code == 200 and r.json()["model"] == name
        r = c.post("/v1/completions", json={"model": "m2", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 404 and "'runs/m2a', 'm2a'" in r.json()["error"]["message"]


def _checkpoint(tmp_path, name="mamba2"):
    from hybridlm.checkpoint import save_checkpoint
    from hybridlm.data.tokenizer import ByteTokenizer
    return save_checkpoint(str(tmp_path), tiny(name), tokenizer=ByteTokenizer())


def test_sigterm_finishes_streams_and_exits_0(tmp_path):
    ckpt = _checkpoint(tmp_path)
    sock = free_port()
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYBRIDLM_API_KEY": KEY,
           "PYTHONPATH": os.pathsep.join(p for p in [os.path.join(os.path.dirname(__file__), "..", "src"),
                                                     os.environ.get("PYTHONPATH")] if p)}
    proc = subprocess.Popen([sys.executable, "-m", "hybridlm", "serve", "--checkpoint", ckpt, "--port", str(port),
                             "--dtype", "float32"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read().decode()
            time.sleep(0.1)
        body = {"prompt": "abc", "max_tokens": 40, "stream": True, "ignore_eos": True, "temperature": 0}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            lines = r.iter_lines()
            got = [next(lines)]
            proc.send_signal(signal.SIGTERM)
            got += list(lines)
        events = [x for x in got if x]
        assert events[-1] == "data: [DONE]"
        texts = [json.loads(e[6:])["choices"][0] for e in events[:-1]]
        assert texts[-1]["finish_reason"] == "length"
        assert proc.wait(30) == 0
        with pytest.raises(httpx.TransportError):       # no longer admitting
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_rss_stable_over_1000_requests(model):
    import psutil
    proc = psutil.Process()
    with live_server(model, max_slots=8) as (url, _):
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        g = torch.Generator().manual_seed(0)

        def burst(n):
            for i in range(n):
                ids = torch.randint(0, 256, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
                c.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0.7, seed=i)
        burst(100)
        after_100 = proc.memory_info().rss
        burst(900)
        assert proc.memory_info().rss <= after_100 * 1.05


def test_serve_command_errors_are_one_line(tmp_path, capsys):
    from hybridlm.cli import main
    ckpt = _checkpoint(tmp_path)
    for flags, msg in ((["--max-slots", "0"], "--max-slots must be >= 1"),
                       (["--prefix-cache-mb", "-1"], "--prefix-cache-mb must be >= 0"),
                       (["--memory-mb", "0.000001"], "memory budget")):
        assert main(["serve", "--checkpoint", ckpt, *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("hybridlm: error: ") and msg in err and len(err.strip().splitlines()) == 1
    assert main(["serve", "--checkpoint", str(tmp_path / "none")]) == 2


def test_serve_command_builds_a_quantized_app(tmp_path):
    import argparse
    from hybridlm.commands import serve
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    app, sch = serve.build(p.parse_args(["--checkpoint", _checkpoint(tmp_path, "transformer++"), "--quantize", "int8",
                                         "--max-slots", "2", "--dtype", "float32"]))
    from hybridlm.layers.quantized import QuantizedLinear
    assert any(isinstance(m, QuantizedLinear) for m in sch.engine.model.modules())
    r = Request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0))
    sch.submit(r)
    with torch.inference_mode():
        sch.run_until_idle()
    assert len(r.output) >= 1 and r.finish_reason in ("stop", "length")


@pytest.mark.slow
def test_serve_bench_smoke(tmp_path):
    from hybridlm.bench.serve import run_serve_bench
    out = str(tmp_path / "serve.json")
    res = run_serve_bench(["rodimus++"], (1, 2), params=None, d_model=32, n_layers=1, requests_per_level=3,
                          max_tokens=4, prefix_len=64, context=256, dtype="float32", out=out, log=lambda *_: None)
    row = res["presets"]["rodimus++"]
    assert [lv["requests"] for lv in row["levels"]] == [3, 3] and row["prefix"]["ttft_hit_s"] > 0
    assert row["burst"]["requests"] == 16 and row["burst"]["peak_rss_bytes"] >= row["burst"]["idle_rss_bytes"]
    assert os.path.exists(str(tmp_path / "serve.png"))


def test_a_non_streaming_client_that_leaves_frees_its_slot():
    with live_server(tiny("mamba2", max_seq_len=4096), max_slots=1) as (url, sch):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 4000, "ignore_eos": True,
                                                      "temperature": 0}, timeout=0.3)
        deadline = time.time() + 10
        while sch.metrics.requests.get("abort") != 1 and time.time() < deadline:
            time.sleep(0.02)
        assert sch.metrics.requests.get("abort") == 1 and sch.counts()["running"] == 0


def test_a_busy_port_is_one_line(tmp_path, capsys):
    from hybridlm.cli import main
    sock = free_port()
    sock.listen()
    try:
        assert main(["serve", "--checkpoint", str(tmp_path), "--port", str(sock.getsockname()[1])]) == 2
    finally:
        sock.close()
    err = capsys.readouterr().err
    assert err.startswith("hybridlm: error: cannot listen on 127.0.0.1:") and len(err.strip().splitlines()) == 1


def test_serve_suite_through_the_bench_command(tmp_path):
    """`hybridlm bench --suite serve --quick`: a tiny mamba2 served and loaded at concurrency 1 and 2, JSON written."""
    from hybridlm.cli import main
    out = tmp_path / "serve.json"
    assert main(["bench", "--suite", "serve", "--quick", "--requests", "2", "--dtype", "float32",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    levels = res["presets"]["mamba2"]["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2] and all(lv["output_tokens"] > 0 for lv in levels)
    burst = res["presets"]["mamba2"]["burst"]
    assert burst["requests"] == 4 and burst["prompt_tokens"] == [8, 64] and burst["ttft_p99_s"] >= burst["ttft_p50_s"]
    assert "peak_state_bytes" in burst and res["meta"]["cpu_count"] and "machine" not in res


class _Silent(ChatBytes):
    """A tokenizer whose tokens have no text (as random weights repeating a special token produce)."""

    def decode(self, ids):
        return ""


def _stdlib_stream(url: str, body: dict) -> dict:
    """An independent client (http.client, a line at a time): TTFT and TPOT from its own receipt times."""
    import http.client
    import urllib.parse
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    stamps, tokens = [], 0
    while line := r.readline():
        now = time.perf_counter()
        if line.startswith(b"data: {"):
            ev = json.loads(line[6:])
            tokens = (ev.get("usage") or {}).get("completion_tokens", tokens)
            if ev["choices"] and not ev["choices"][0]["finish_reason"]:
                stamps.append(now)
    conn.close()
    return {"ttft": stamps[0] - t0, "tpot": (stamps[-1] - stamps[0]) / (tokens - 1), "events": len(stamps)}


@pytest.mark.parametrize("silent", [False, True])
def test_the_bench_clock_agrees_with_a_plain_client(model, silent):
    """bench/serve.py's TTFT / TPOT against a stdlib client's on the same server and request, each decode step
    slowed to ~25 ms so the gaps are well above scheduling noise; also when no token has text."""
    import asyncio
    from hybridlm.bench.serve import _one
    with live_server(model, _Silent() if silent else None, max_slots=2) as (url, sch):
        real = sch.engine.decode

        def slow(*a, **k):
            time.sleep(0.025)
            return real(*a, **k)
        sch.engine.decode = slow
        prompt, n = [5, 6, 7], 12

        async def bench():
            async with httpx.AsyncClient(timeout=60) as c:
                return await _one(c, url, prompt, n)
        ours = asyncio.run(bench())
        plain = _stdlib_stream(url, {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                                     "stream": True, "stream_options": {"include_usage": True}})
    assert ours["tokens"] == n and plain["events"] in (n, n + 1)    # an event per token, text or not (+ a held tail)
    for r in (ours, plain):
        assert 0.02 < r["tpot"] < 0.1, r
    assert abs(ours["tpot"] - plain["tpot"]) < 0.015 and abs(ours["ttft"] - plain["ttft"]) < 0.1


def test_serve_without_the_extra_is_one_line(tmp_path, capsys, monkeypatch):
    from hybridlm.cli import main
    monkeypatch.setitem(sys.modules, "uvicorn", None)                 # import uvicorn -> ImportError
    assert main(["serve", "--checkpoint", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "pip install 'hybridlm[serve]'" in err and len(err.strip().splitlines()) == 1


def test_serve_takes_a_transformers_directory(tmp_path):
    """A transformers Llama directory, converted on load by convert --from-hf's code: greedy = transformers'."""
    import argparse
    transformers = pytest.importorskip("transformers")
    from hybridlm.commands import serve
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=None, eos_token_id=None)).eval()
    hf.save_pretrained(tmp_path / "hf")
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    _, sch = serve.build(p.parse_args(["--checkpoint", str(tmp_path / "hf"), "--tokenizer", "byte",
                                       "--dtype", "float32"]))
    ids = [1, 2, 3]
    r = Request(ids, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    sch.submit(r)
    sch.run_until_idle()
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, 3:].tolist()
    assert r.output == want
