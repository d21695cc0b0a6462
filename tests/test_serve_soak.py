"""A soak test of the server (slow): 2,000 requests of random lengths at 24 concurrent, a fifth of the streaming
clients leaving mid-stream, bad bodies mixed in. Every well-formed request that stays gets exactly what `generate`
gives, every bad one a 4xx; the process's memory settles; the metrics' counters add up.

    OMP_NUM_THREADS=1 python -m pytest tests/test_serve_soak.py -m slow
"""
import asyncio
import json
import random
import time

import pytest
import torch

pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")

from serve_helpers import ChatBytes, live_server, tiny  # noqa: E402

N, CONCURRENCY, POOL, EOS = 2000, 24, 160, 256

BAD = [b'{"prompt": ', b"[1, 2]", b"\xff\xfe", json.dumps({"prompt": [1, 999]}).encode(),
       json.dumps({"prompt": "x", "max_tokens": -1}).encode(), json.dumps({"prompt": "x", "max_tokens": 500}).encode(),
       json.dumps({"prompt": ""}).encode(), json.dumps({"prompt": "x", "grammar": "root ::= x"}).encode(),
       json.dumps({"prompt": "x", "tempreature": 0}).encode(), json.dumps({"prompt": "x", "n": 0}).encode(),
       json.dumps({"prompt": "x", "top_p": 0}).encode(), json.dumps({"messages": "hi"}).encode(),
       json.dumps({"prompt": "x", "stream": "yes"}).encode(), json.dumps({"prompt": "x", "logprobs": 99}).encode()]


def want(model, prompt, n, ignore_eos):
    out = model.generate(torch.tensor([prompt]), n, temperature=0)[0, len(prompt):].tolist()
    if not ignore_eos and EOS in out:
        out = out[:out.index(EOS) + 1]
    return ChatBytes().decode([t for t in out if t != EOS])


@pytest.mark.slow
def test_soak():
    torch.set_num_threads(1)
    model = tiny("mamba2-attention")
    rng = random.Random(0)
    pool = []
    for _ in range(POOL):       # the prompts (some sharing a 32-token prefix: prefix-cache hits and misses)
        head = [7] * 32 if rng.random() < 0.3 else []
        prompt = head + [rng.randrange(256) for _ in range(rng.randint(1, 60))]
        n, ignore = rng.randint(1, 24), rng.random() < 0.5
        pool.append((prompt, n, ignore, want(model, prompt, n, ignore)))
    plan = []
    for i in range(N):
        r = rng.random()
        plan.append(("bad", rng.choice(BAD)) if r < 0.1 else
                    ("leave", rng.randrange(POOL)) if r < 0.3 else
                    ("stream" if r < 0.64 else "plain", rng.randrange(POOL)))
    proc = psutil.Process()
    with live_server(model, max_slots=16, block=16, max_queue=256) as (url, sch):
        results, rss = [], {}

        async def one(client, i, kind, what):
            if kind == "bad":
                r = await client.post("/v1/completions", content=what, headers={"Content-Type": "application/json"})
                results.append((kind, 400 <= r.status_code < 500, r.status_code))
                return
            prompt, n, ignore, text = pool[what]
            body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": ignore}
            if kind == "plain":
                r = await client.post("/v1/completions", json={**body, **({"n": 2} if i % 7 == 0 else {})})
                got = [c["text"] for c in r.json()["choices"]]
                results.append((kind, r.status_code == 200 and got == [text] * len(got), got))
                return
            pieces, leave_after = [], rng.randint(1, 3) if kind == "leave" else None
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        pieces.append(json.loads(line[6:])["choices"][0]["text"])
                        if leave_after is not None and len(pieces) >= leave_after:
                            break              # the client goes away mid-stream
            results.append((kind, kind == "leave" or "".join(pieces) == text, "".join(pieces)))

        async def run():
            queue = list(enumerate(plan))
            limits = httpx.Limits(max_connections=CONCURRENCY + 4)
            async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
                async def worker():
                    while queue:
                        i, (kind, what) = queue.pop(0)
                        await one(client, i, kind, what)
                        if len(results) == 200 and "first" not in rss:
                            rss["first"] = proc.memory_info().rss
                await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))

        t0 = time.time()
        asyncio.run(run())
        took = time.time() - t0
        deadline = time.time() + 30
        while sch.busy() and time.time() < deadline:
            time.sleep(0.05)
        rss["end"] = proc.memory_info().rss
        counts, m = sch.counts(), sch.metrics
        metrics_text = httpx.get(url + "/metrics").text
    bad = [r for r in results if not r[1]]
    assert len(results) == N and not bad, bad[:5]
    assert counts == {"waiting": 0, "prefilling": 0, "running": 0}
    kinds = [k for k, _ in plan]
    submitted = [pool[w] for k, w in plan if k != "bad"]
    n_choices = len(submitted) + sum(1 for i, (k, _) in enumerate(plan) if k == "plain" and i % 7 == 0)
    assert sum(m.requests.values()) == n_choices                              # every request finished once
    assert m.requests.get("abort", 0) <= kinds.count("leave") and set(m.requests) <= {"stop", "length", "abort"}
    assert m.prompt_tokens == sum(len(pool[w][0]) * (2 if k == "plain" and i % 7 == 0 else 1)
                                  for i, (k, w) in enumerate(plan) if k != "bad")
    total = sum(float(line.split()[-1]) for line in metrics_text.splitlines()
                if line.startswith("hybridlm_requests_total{"))
    assert total == n_choices
    assert rss["end"] <= rss["first"] * 1.05, (rss, took)
    print(f"soak: {N} requests in {took:.0f} s; RSS {rss['first'] / 2**20:.0f} -> {rss['end'] / 2**20:.0f} MiB")
