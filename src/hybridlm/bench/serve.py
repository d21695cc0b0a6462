"""Serving benchmark: a real HTTP load generator against `hybridlm serve` servers it starts on loopback.

For each preset (random weights at one size, saved as a checkpoint): aggregate output tokens/s, time to first
token and time per output token (p50, p99) at each concurrency; the state one request holds (fixed + per token,
and how many fit a memory budget at a context); time to first token of a long prompt cold and after a
shared-prefix hit. Every load is bounded in requests and time. JSON + one PNG.

    python -m hybridlm.bench.serve --presets rodimus++ mamba2 --concurrency 1 4 16 --out serve.json

Client-side timing, each server-sent event stamped when the client receives it: TTFT is the time to the first
event of a choice, TPOT is (last token event - first) / (tokens - 1), the token count from the final usage. Both
servers send an event per token, its text possibly empty (held back inside a UTF-8 character or a possible stop
string, or a token with no text): counting only events with text made a generation whose tokens decode to nothing
(random weights repeating a special token) one event at the end, TTFT the whole request and TPOT 0.0.
tests/test_serve_api.py checks these clocks against a plain socket client's.

The burst figure: 16 requests arriving together, prompts of mixed length (64 to 2,048 tokens, spread
geometrically), TTFT p50 / p99; and, while they run in 16 slots, the server process's resident memory against the
state the memory budget counts for them (/metrics).

The decode figures (`decode_rows`, in process, after the server of the preset has stopped): the serving engine's
time per decode step over a batch, each batch's requests prefilled as the server prefills them and joined into one
batch, cases interleaved on one clock: one stream of `prompt_len` tokens, `burst` streams of it, `burst` streams of
the burst's mixed lengths (each row at its own length) and `burst` streams all of the mean of those lengths.
`streams_vs_1` is burst x t(one stream) / t(burst streams): how much more the batch decodes per second;
`mixed_vs_equal` is t(mixed) / t(equal, the mean length): 1.0 when a batch costs its tokens, not its longest row.
"""
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial

from .registry import cpu_host

PRESETS = ["transformer++", "mamba2", "rodimus++", "mamba2-attention"]
VOCAB = 128


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def make_checkpoint(preset: str, params: str | None, d_model: int | None, n_layers: int | None, context: int,
                    directory: str) -> str:
    """A random-weight checkpoint of `preset` sized by `params` or d_model/n_layers, with the byte tokenizer and a
    vocabulary of the 128 ASCII bytes: every generated token is a character, so every token is one streamed event
    and the client's clock sees each (random bytes >= 128 would often wait for the next to finish a character)."""
    import torch
    from ..checkpoint import save_checkpoint
    from ..data.tokenizer import ByteTokenizer
    from ..models import CausalLM, presets
    from ..models.sizing import fit_params, parse_count
    over = {"vocab_size": VOCAB, "max_seq_len": context}
    if n_layers:
        over["n_layers"] = n_layers
    if d_model:
        over["d_model"] = d_model
        cfg = presets.get(preset, **over)
    else:
        cfg, _ = fit_params(lambda d: presets.get(preset, **over, d_model=d), parse_count(params or "125M"),
                            range(64, 16385, 64), what="d_model")
    torch.manual_seed(0)
    model = CausalLM(cfg).eval()
    return save_checkpoint(directory, model, tokenizer=ByteTokenizer())


class ServerProcess:
    """`hybridlm serve` in a subprocess on a free loopback port."""

    def __init__(self, checkpoint: str, args: list[str], startup_s: float = 300):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "hybridlm", "serve", "--checkpoint", checkpoint,
                                      "--port", str(self.port), *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
        try:
            wait_ready(self.url, self.proc, startup_s)
        except RuntimeError as e:
            out = self.proc.stdout.read().decode(errors="replace") if self.proc.poll() is not None else ""
            self.stop()
            raise RuntimeError(f"{e}: {out[-2000:]}") from None

    def metrics(self) -> dict:
        import httpx
        vals = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, value = line.split()
                vals[name.removeprefix("hybridlm:")] = float(value)
        return vals

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def _one(client, url: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion -> {"ttft", "tpot", "tokens", "start", "end"}, each event stamped on receipt."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps, tokens = [], 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            now = time.perf_counter()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            choice = (ev.get("choices") or [None])[0]
            if choice is not None and (choice.get("text") or not choice.get("finish_reason")):
                stamps.append(now)                # a token's event (a finish-only event carries none)
    if not stamps:                                # e.g. a server whose engine died: no figure from this request
        raise RuntimeError(f"{url} streamed no token for a {len(prompt)}-token prompt (see the server's log)")
    tokens = tokens or len(stamps)                # a server without usage in its stream: one event per token
    first, last = stamps[0], stamps[-1]
    return {"ttft": first - t0, "tpot": (last - first) / (tokens - 1) if tokens > 1 else None, "tokens": tokens,
            "start": t0, "end": last}


async def _load(url: str, concurrency: int, n_requests: int, prompt_len: int, max_tokens: int, time_limit: float,
                seed: int) -> dict:
    """`n_requests` completions, `concurrency` at a time, none started after `time_limit` seconds."""
    import httpx
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(prompt_len)] for _ in range(n_requests)]
    results, queue = [], list(prompts)
    t_start = time.perf_counter()
    # a fresh connection per request: llama-server drops kept-alive ones between streamed responses
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def worker():
            while queue and time.perf_counter() - t_start < time_limit:
                results.append(await _one(client, url, queue.pop(), max_tokens))
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = max(r["end"] for r in results) - t_start
    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    return {"concurrency": concurrency, "requests": len(results), "output_tokens": sum(r["tokens"] for r in results),
            "wall_s": round(wall, 3), "tokens_per_s": round(sum(r["tokens"] for r in results) / wall, 2),
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99)}


async def _prefix(url: str, prefix_len: int, seed: int) -> dict:
    """TTFT of a `prefix_len`-token prompt (plus a short tail) cold, then of another prompt sharing the prefix."""
    import httpx
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(prefix_len)]
    async with httpx.AsyncClient(timeout=600) as client:
        cold = await _one(client, url, shared + [rng.randrange(VOCAB) for _ in range(16)], 2)
        hit = await _one(client, url, shared + [rng.randrange(VOCAB) for _ in range(16)], 2)
    return {"prompt_tokens": prefix_len + 16, "ttft_cold_s": cold["ttft"], "ttft_hit_s": hit["ttft"],
            "speedup": round(cold["ttft"] / hit["ttft"], 2)}


def burst_lengths(n: int, shortest: int, longest: int) -> list[int]:
    """`n` prompt lengths from `shortest` to `longest` tokens, spread geometrically."""
    return [round(shortest * (longest / shortest) ** (i / max(1, n - 1))) for i in range(n)]


async def _burst(url: str, n: int, shortest: int, longest: int, max_tokens: int, seed: int) -> dict:
    """`n` completions sent at once, prompts from `shortest` to `longest` tokens (geometric): TTFT p50 / p99."""
    import httpx
    rng = random.Random(seed)
    lens = burst_lengths(n, shortest, longest)
    rng.shuffle(lens)
    prompts = [[rng.randrange(VOCAB) for _ in range(k)] for k in lens]
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        res = await asyncio.gather(*(_one(client, url, p, max_tokens) for p in prompts))
    ttft = [r["ttft"] for r in res]
    return {"requests": n, "prompt_tokens": [min(lens), max(lens)], "max_tokens": max_tokens,
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "ttft_by_prompt": sorted(zip(lens, [round(t, 4) for t in ttft]))}


class Sampler:
    """The server process's resident memory and its /metrics state gauges, sampled in a thread (peaks)."""

    def __init__(self, server: "ServerProcess", every: float = 0.05):
        import psutil
        self.server, self.every, self.proc = server, every, psutil.Process(server.proc.pid)
        self.peak = {"rss_bytes": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            m = self.server.metrics()
            m["rss_bytes"] = self.proc.memory_info().rss
            for k in ("rss_bytes", "state_bytes", "batch_bytes", "prefill_bytes", "prefix_cache_bytes"):
                if k in m:
                    self.peak[k] = max(self.peak.get(k, 0), m[k])
            self._stop.wait(self.every)

    def __enter__(self):
        self.idle_rss = self.proc.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def burst_with_memory(server: "ServerProcess", s: dict, context: int, log=print) -> dict:
    """The burst figure, with the server's RSS and state sampled while it runs: the budget the scheduler counts
    for these requests (each at prompt + max_tokens tokens) against what the process holds."""
    m = server.metrics()
    longest = min(s["burst_max"], context - s["max_tokens"] - 1)
    with Sampler(server) as mem:
        row = asyncio.run(_burst(server.url, s["burst"], min(s["burst_min"], longest), longest, s["max_tokens"], 5))
    lens = [k for k, _ in row.pop("ttft_by_prompt")]
    row["budget_bytes"] = int(sum(m["slot_fixed_bytes"] + m["slot_token_bytes"] * (k + s["max_tokens"])
                                  for k in lens))
    row.update(idle_rss_bytes=mem.idle_rss, **{f"peak_{k}": v for k, v in mem.peak.items()})
    row["rss_growth_bytes"] = mem.peak["rss_bytes"] - mem.idle_rss
    log(f"burst of {row['requests']} ({row['prompt_tokens'][0]}-{row['prompt_tokens'][1]} tokens): TTFT p50 "
        f"{row['ttft_p50_s']:.3f}s p99 {row['ttft_p99_s']:.3f}s; budget {row['budget_bytes'] / 2**20:.1f} MiB, "
        f"RSS growth {row['rss_growth_bytes'] / 2**20:.1f} MiB")
    return row


def inference_model(checkpoint: str, dtype: str = "auto", quantize: str | None = None):
    """The checkpoint's model as `hybridlm serve` runs it on a CPU: quantized from the saved weights, cast, decode's
    matrix-vector products through the project's CPU kernels."""
    import torch
    from ..dtypes import resolve_dtype
    from ..models.quantize import quantize_, use_cpu_kernels_
    from ..train import load_checkpoint
    model = load_checkpoint(checkpoint)[0].eval()
    if quantize:
        quantize_(model, quantize)
    return use_cpu_kernels_(model.to(dtype=getattr(torch, resolve_dtype(dtype, "cpu")[0])))


def decode_rows(model, cases: dict, steps: int = 8, repeats: int = 3, seed: int = 0) -> dict:
    """Seconds per decode step of the serving engine over each case's batch ({name: prompt lengths}): the requests
    are prefilled as the server prefills them (`plan_prefill`, `prefill`) and join one batch (`set_rows`: rows at
    their own lengths); a timed call runs `steps` decode steps, the cases interleaved on one clock (bench/measure.py).
    -> {name: seconds per step (median)}."""
    import torch
    from ..serve import Engine, Request, SamplingParams
    from .measure import clock, median
    g = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    engines = {}
    with torch.inference_mode():
        for name, lens in cases.items():
            eng = Engine(model, eos_id=None, block=256, max_slots=len(lens))
            new = (repeats + 1) * steps + 1                      # every timed and warm-up step has room
            reqs = [Request(torch.randint(0, V, (n,), generator=g).tolist(),
                            SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)) for n in lens]
            for r in reqs:
                eng.start(r)
            while pending := [r for r in reqs if r.prefilled < len(r.prompt)]:
                for group in eng.plan_prefill(pending):
                    eng.prefill(group)
            eng.set_rows(reqs)
            engines[name] = eng

    times = clock({name: partial(_decode_steps, eng, steps) for name, eng in engines.items()}, repeats=repeats,
                  warmup=1)
    return {name: median(t) / steps for name, t in times.items()}


def _decode_steps(engine, steps: int):
    import torch
    with torch.inference_mode():
        for _ in range(steps):
            engine.decode()


def decode_figures(model, *, prompt_len: int, burst: int, burst_min: int, burst_max: int, steps: int,
                   repeats: int = 3, log=print, name: str = "") -> dict:
    """The decode figures of one model (see the module docstring): seconds per step of each case, `streams_vs_1`
    and `mixed_vs_equal`."""
    mixed = burst_lengths(burst, burst_min, burst_max)
    mean = round(sum(mixed) / len(mixed))
    cases = {f"1x{prompt_len}": [prompt_len], f"{burst}x{prompt_len}": [prompt_len] * burst,
             f"{burst} mixed {burst_min}-{burst_max}": mixed, f"{burst}x{mean}": [mean] * burst}
    t = decode_rows(model, cases, steps, repeats)
    one, many, mix, equal = (t[k] for k in cases)
    out = {"step_s": {k: round(v, 6) for k, v in t.items()}, "streams": burst, "mean_length": mean,
           "streams_vs_1": round(burst * one / many, 2), "mixed_vs_equal": round(mix / equal, 3)}
    log(f"{name:<18} decode step: 1 stream {one * 1e3:.1f} ms, {burst} streams {many * 1e3:.1f} ms "
        f"({out['streams_vs_1']}x the tokens/s); {burst} mixed {burst_min}-{burst_max} {mix * 1e3:.1f} ms vs "
        f"{burst}x{mean} {equal * 1e3:.1f} ms ({out['mixed_vs_equal']}x)")
    return out


def load_external(url: str, concurrencies=(1, 16), *, prompt_len: int = 64, max_tokens: int = 48,
                  requests_per_level: int | None = None, time_limit: float = 120, log=print) -> list[dict]:
    """The same load against a server already running at `url` (any OpenAI-compatible one, e.g. llama.cpp's
    `llama-server -np 16`, to compare on the same weights)."""
    levels = []
    for c in concurrencies:
        lv = asyncio.run(_load(url.rstrip("/"), c, requests_per_level or max(2 * c, 8), prompt_len, max_tokens,
                               time_limit, c))
        levels.append(lv)
        log(f"{url} c={c:<3} {lv['tokens_per_s']:>9.1f} tok/s  TTFT p50 {lv['ttft_p50_s']:.3f}s  "
            f"TPOT p50 {lv['tpot_p50_s'] or 0:.4f}s  ({lv['requests']} req)")
    return levels


def run_serve_bench(presets=PRESETS, concurrencies=(1, 4, 16, 64), *, params: str | None = "125M",
                    d_model: int | None = None, n_layers: int | None = None, prompt_len: int = 64,
                    max_tokens: int = 48, requests_per_level: int | None = None, time_limit: float = 120,
                    prefix_len: int = 2048, context: int = 4096, memory_budget_mb: float = 1024,
                    burst: int = 16, burst_min: int = 64, burst_max: int = 2048,
                    dtype: str = "auto", quantize: str | None = None, out: str = "serve-bench.json",
                    decode_steps: int = 0, decode_only: bool = False, speculative: str = "", plot: bool = True,
                    log=print) -> dict:
    """Start a server per preset, load it at each concurrency, measure; then, with `decode_steps`, the decode
    figures in process (`decode_figures`; `decode_only`: those alone, no server). `speculative`: serve with
    --speculative (each level reports drafts accepted and tokens per step). The results (the caller writes them,
    with the registry's meta) and a PNG beside `out`."""
    result = {"settings": {"params": params, "d_model": d_model, "n_layers": n_layers, "prompt_len": prompt_len,
                           "max_tokens": max_tokens, "prefix_len": prefix_len, "context": context, "dtype": dtype,
                           "quantize": quantize, "memory_budget_mb": memory_budget_mb, "burst": burst,
                           "burst_min": burst_min, "burst_max": burst_max, "decode_steps": decode_steps,
                           "speculative": speculative},
              "presets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in presets:
            ckpt = make_checkpoint(preset, params, d_model, n_layers, context, os.path.join(tmp, preset))
            if decode_only:
                result["presets"][preset] = {"decode": decode_figures(
                    inference_model(ckpt, dtype, quantize), prompt_len=prompt_len, burst=burst, burst_min=burst_min,
                    burst_max=burst_max, steps=decode_steps, log=log, name=preset)}
                continue
            args = ["--max-slots", str(max(concurrencies)), "--max-queue", "4096", "--dtype", dtype,
                    "--prefix-cache-mb", "2048"] + (["--quantize", quantize] if quantize else []) + \
                (["--speculative", speculative] if speculative else [])
            if burst:
                args += ["--max-slots", str(max(burst, *concurrencies))]
            server = ServerProcess(ckpt, args)
            try:
                m = server.metrics()
                per_slot = m["slot_fixed_bytes"] + m["slot_token_bytes"] * context
                row = {"state_fixed_bytes": m["slot_fixed_bytes"], "state_bytes_per_token": m["slot_token_bytes"],
                       f"state_bytes_at_{context}": per_slot,
                       f"slots_in_{memory_budget_mb:g}_mb_at_{context}": int(memory_budget_mb * 2**20 // per_slot),
                       "levels": []}
                asyncio.run(_load(server.url, 1, 2, prompt_len, 4, time_limit, 99))           # warm-up
                for c in concurrencies:
                    n = requests_per_level or max(2 * c, 8)
                    before = server.metrics()
                    lv = asyncio.run(_load(server.url, c, n, prompt_len, max_tokens, time_limit, c))
                    spec = _spec_figures(before, server.metrics()) if speculative else ""
                    if spec:
                        lv.update(spec)
                        spec = (f"  acceptance {spec['spec_acceptance']:.2f}, "
                                f"{spec['spec_tokens_per_step']:.2f} tokens/step")
                    row["levels"].append(lv)
                    log(f"{preset:<18} c={c:<3} {lv['tokens_per_s']:>9.1f} tok/s  TTFT p50 {lv['ttft_p50_s']:.3f}s "
                        f"p99 {lv['ttft_p99_s']:.3f}s  TPOT p50 {lv['tpot_p50_s'] or 0:.4f}s  ({lv['requests']} req)"
                        + spec)
                if prefix_len:
                    row["prefix"] = asyncio.run(_prefix(server.url, prefix_len, 7))
                    log(f"{preset:<18} prefix {prefix_len}: TTFT cold {row['prefix']['ttft_cold_s']:.3f}s, "
                        f"after a hit {row['prefix']['ttft_hit_s']:.3f}s ({row['prefix']['speedup']}x)")
                if burst:
                    row["burst"] = burst_with_memory(server, dict(burst=burst, burst_min=burst_min,
                                                                  burst_max=burst_max, max_tokens=max_tokens),
                                                     context, log)
            finally:
                server.stop()
            if decode_steps:
                row["decode"] = decode_figures(inference_model(ckpt, dtype, quantize), prompt_len=prompt_len,
                                               burst=burst, burst_min=burst_min, burst_max=burst_max,
                                               steps=decode_steps, log=log, name=preset)
            result["presets"][preset] = row
    if plot and not decode_only:
        _plot(result, os.path.splitext(out)[0] + ".png")
    return result


def _spec_figures(before: dict, after: dict) -> dict:
    """Speculative decoding over one load level, from the /metrics counters read before and after it: drafts
    accepted over drafts checked, and tokens added per row per check."""
    def delta(name):
        return after.get(name, 0) - before.get(name, 0)
    drafted, accepted = delta("spec_decode_num_draft_tokens_total"), delta("spec_decode_num_accepted_tokens_total")
    checks = delta("spec_decode_num_drafts_total")
    if not checks:
        return {"spec_acceptance": 0.0, "spec_tokens_per_step": 1.0, "spec_checks": 0}
    return {"spec_acceptance": round(accepted / drafted, 3) if drafted else 0.0,
            "spec_tokens_per_step": round(delta("spec_decode_num_emitted_tokens_total") /
                                          delta("spec_decode_num_row_checks_total"), 3),
            "spec_checks": int(checks)}


def _plot(result: dict, path: str):
    from ..plots import pyplot
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for preset, row in result["presets"].items():
        cs = [lv["concurrency"] for lv in row["levels"]]
        a.plot(cs, [lv["tokens_per_s"] for lv in row["levels"]], marker="o", label=preset)
    a.set(xscale="log", xlabel="concurrent requests", ylabel="output tokens/s", title="aggregate throughput")
    a.legend()
    names = [p for p, r in result["presets"].items() if "prefix" in r]
    if names:
        x = range(len(names))
        b.bar([i - 0.2 for i in x], [result["presets"][p]["prefix"]["ttft_cold_s"] for p in names], 0.4,
              label="cold")
        b.bar([i + 0.2 for i in x], [result["presets"][p]["prefix"]["ttft_hit_s"] for p in names], 0.4,
              label="prefix hit")
        b.set_xticks(list(x), names, rotation=15)
        b.set(ylabel="seconds", title=f"time to first token, {result['settings']['prefix_len']}-token prompt")
        b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def serve_suite(s: dict, log=print) -> dict:
    """`hybridlm bench --suite serve`. Settings (registry.py): presets, concurrency, params, d_model, n_layers,
    prompt_len, max_tokens, requests, time_limit, prefix_len, context, memory_budget_mb, dtype, quantize, url (load
    a running server instead), llama_server (also compare with llama.cpp's server), schema / schema_tokenizer /
    schema_steps (the cost of constrained decoding instead: bench/structured.py), decode_steps / decode_only (the
    in-process decode figures), speculative."""
    from ..errors import ConfigError
    if min(s["concurrency"]) < 1 or s["max_tokens"] < 1 or s["prompt_len"] < 1:
        raise ConfigError("--concurrency, --max-tokens and --prompt-len must be >= 1")
    if s["decode_steps"] < 0 or (s["decode_only"] and not (s["decode_steps"] and s["burst"])):
        raise ConfigError("--decode-only needs --decode-steps >= 1 and --burst >= 1")
    load = dict(prompt_len=s["prompt_len"], max_tokens=s["max_tokens"], requests_per_level=s["requests"],
                time_limit=s["time_limit"], log=log)
    if s["url"]:            # any server (e.g. an older hybridlm serve, for a before / after): no memory figures
        out = {"url": s["url"], "levels": load_external(s["url"], s["concurrency"], **load)}
        if s["burst"]:
            out["burst"] = asyncio.run(_burst(s["url"].rstrip("/"), s["burst"], s["burst_min"], s["burst_max"],
                                              s["max_tokens"], 5))
            log(f"burst of {s['burst']}: TTFT p50 {out['burst']['ttft_p50_s']:.3f}s p99 "
                f"{out['burst']['ttft_p99_s']:.3f}s")
        return out
    if s["llama_server"]:
        return compare_llama_server(s, log)
    if s["schema"]:         # constrained decoding: the grammar mask beside the decode step (bench/structured.py)
        from .structured import structured_cost
        return structured_cost(s, log)
    return run_serve_bench(s["presets"].split(","), s["concurrency"], params=s["params"] or None,
                           d_model=s["d_model"], n_layers=s["n_layers"], prefix_len=s["prefix_len"],
                           context=s["context"], memory_budget_mb=s["memory_budget_mb"], burst=s["burst"],
                           burst_min=s["burst_min"], burst_max=s["burst_max"], dtype=s["dtype"],
                           quantize=s["quantize"] or None, out=s["out"], decode_steps=s["decode_steps"],
                           decode_only=s["decode_only"], speculative=s["speculative"], **load)


def compare_llama_server(s: dict, log=print) -> dict:
    """llama.cpp's own server (`llama-server -np N -t <threads>`, the binary `s["llama_server"]`) and `hybridlm
    serve` on the same weights: a Llama in TinyLlama's shape (bench/llamacpp_families.py builds the transformers
    directory and llama.cpp converts it to a bf16 GGUF), the same load at each concurrency, one server at a time."""
    import torch
    from .llamacpp_families import build_family
    made = build_family("llama", os.path.join(s["dir"], "families"), s["llamacpp_src"], s["quick"], ("bf16",))
    n = max(s["concurrency"])
    ctx = n * (s["prompt_len"] + s["max_tokens"] + 16)
    port = _free_port()
    threads = str(torch.get_num_threads())
    cmd = [s["llama_server"], "-m", made["gguf"]["bf16"], "--host", "127.0.0.1", "--port", str(port), "-np", str(n),
           "-t", threads, "-tb", threads, "-c", str(ctx), "--no-webui"]
    load = dict(prompt_len=s["prompt_len"], max_tokens=s["max_tokens"], requests_per_level=s["requests"],
                time_limit=s["time_limit"], log=log)
    out = {"host": cpu_host(), "weights": {"family": "llama", "parameters": made["parameters"], "dtype": "bfloat16"},
           "servers": {}}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        out["servers"]["llama-server"] = {"command": " ".join(cmd[1:]),
                                          "levels": load_external(f"http://127.0.0.1:{port}", s["concurrency"], **load)}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    server = ServerProcess(made["checkpoint"], ["--max-slots", str(n), "--dtype", "bfloat16"])   # convert --from-hf of it
    try:
        out["servers"]["hybridlm"] = {"levels": load_external(server.url, s["concurrency"], **load)}
    finally:
        server.stop()
    ours, theirs = out["servers"]["hybridlm"]["levels"][-1], out["servers"]["llama-server"]["levels"][-1]
    out["ratio_at_max_concurrency"] = round(ours["tokens_per_s"] / theirs["tokens_per_s"], 3)
    log(f"at concurrency {n}: hybridlm serve {ours['tokens_per_s']:.1f} tok/s, llama-server "
        f"{theirs['tokens_per_s']:.1f} tok/s ({out['ratio_at_max_concurrency']:.2f}x)")
    out["markdown"] = servers_table(out)
    return out


def servers_table(res: dict) -> str:
    """compare_llama_server's result as markdown: the host (CPU, flags, the kernel path `hybridlm serve` took), then
    tokens/s of each server at each concurrency."""
    from ..markdown import markdown_table
    from .registry import host_line
    ours, theirs = (res["servers"][k]["levels"] for k in ("hybridlm", "llama-server"))
    rows = [[str(a["concurrency"]), f"{b['tokens_per_s']:.1f}", f"{a['tokens_per_s']:.1f}",
             f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x"] for a, b in zip(ours, theirs)]
    return host_line(res["host"]) + "\n" + "\n".join(markdown_table(
        ["concurrency", "llama-server tok/s", "hybridlm serve tok/s", "ratio"], rows)) + "\n"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, proc, startup_s: float = 300):
    """Until the server at `url` answers /health and then a two-token completion (llama-server answers /health
    before its slots take requests): the one wait for every server here. RuntimeError when `proc` ends first or
    `startup_s` passes."""
    import httpx
    deadline = time.time() + startup_s
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200 and httpx.post(
                    url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=60).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"the server at {url} did not start")


if __name__ == "__main__":
    from .registry import main
    sys.exit(main("serve"))
