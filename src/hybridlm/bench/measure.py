"""The instrument's parts every benchmark uses: ONE clock, ONE memory probe, measurements as data (`Case`), ONE
row schema and ONE writer; plus the step closures, matmul peak and model flops the cases are built from.

    times = clock({"ours": f, "hf": g}, repeats=5)           # interleaved; name -> seconds per call
    rows = run_cases([Case("ssd 8x2048", build, work=8 * 2048, unit="tokens")], repeats=5)
    mem = fresh(peak_memory_of_step, cfg=..., ...)          # a module-level function run in a fresh interpreter
    write_results("runs/bench/x.json", {"rows": rows})

The clock times callables in rounds, one call of each per round (order reversed every other round, so all see
the same machine load), after `warmup` untimed rounds; on a GPU every reading synchronises first. The probe runs
a callable once and reports the peak memory above what was resident before it: CPU: VmHWM after resetting it
through /proc/self/clear_refs (Linux; else ru_maxrss), or with what="tensors" the peak of live torch tensor bytes
from the profiler's allocation events; CUDA: torch.cuda.max_memory_allocated. Run it in a fresh process (`fresh`)
so that memory freed but cached by an earlier case cannot hide the next one's peak.
"""
import contextlib
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from ..errors import HybridLMError


# ---------------------------------------------------------------------------------------------------
# the clock

def stamp() -> float:
    """Seconds, after the GPU (if this process uses one) has finished its queued work."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def clock(fns: dict, repeats: int = 5, warmup: int = 1) -> dict[object, list[float]]:
    """The one clock: every callable of `fns` timed `repeats` times, interleaved. -> key -> seconds per call.
    A value may be a pair (setup, run): setup() runs untimed before each call and run(setup's result) is timed."""
    keys = list(fns)

    def once(k) -> float:
        setup, fn = fns[k] if isinstance(fns[k], tuple) else (None, fns[k])
        arg = setup() if setup else None
        gc.collect()
        t0 = stamp()
        fn(arg) if setup else fn()
        return stamp() - t0
    gc.collect()
    gc.freeze()                 # objects alive now are never scanned again: the collect before each call stays cheap
    try:
        for _ in range(warmup):
            for k in keys:
                once(k)
        out = {k: [] for k in keys}
        for r in range(repeats):
            for k in (keys if r % 2 == 0 else keys[::-1]):
                out[k].append(once(k))
    finally:
        gc.unfreeze()
        gc.collect()            # the full collection the unfreeze makes due, here, not in the caller's next work
    return out


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


# ---------------------------------------------------------------------------------------------------
# measurements as data, one row schema, one writer

@dataclass
class Case:
    """One measurement: `build()` -> {variant: callable} timed side by side (ours / transformers, chunked /
    recurrent, ...), each call doing `work` units of `unit` (tokens, flops, bytes, calls); `info` goes in the rows."""
    name: str
    build: Callable[[], dict]
    work: float = 1.0
    unit: str = "calls"
    info: dict = field(default_factory=dict)


def row(case: str, variant: str, times: list[float], work: float = 1.0, unit: str = "calls", **info) -> dict:
    """The one row schema: {case, variant, unit, work, median_s, min_s, max_s, spread (max-min over median),
    per_s (work / median), repeats, times_s, ...info}."""
    m = median(times)
    return dict(case=case, variant=variant, unit=unit, work=work, median_s=m, min_s=min(times), max_s=max(times),
                spread=(max(times) - min(times)) / m if m > 0 else 0.0, per_s=work / m if m > 0 else float("inf"),
                repeats=len(times), times_s=times, **info)


def run_cases(cases: list[Case], repeats: int = 5, warmup: int = 1, log=None) -> list[dict]:
    """Build every case, time all their callables in one interleaved clock, one row per case and variant."""
    fns, meta = {}, {}
    for c in cases:
        for variant, fn in c.build().items():
            fns[c.name, variant], meta[c.name, variant] = fn, c
    times = clock(fns, repeats, warmup)
    rows = [row(name, variant, times[name, variant], c.work, c.unit, **c.info) for (name, variant), c in meta.items()]
    for r in rows:
        if log:
            log(f"  {r['case']:28s} {r['variant']:14s} {1e3 * r['median_s']:10.2f} ms  {r['per_s']:12.1f} "
                f"{r['unit']}/s  (spread {r['spread']:.2f})")
    return rows


def pick(rows: list[dict], case: str, variant: str) -> dict:
    return next(r for r in rows if r["case"] == case and r["variant"] == variant)


def write_results(path: str, res: dict, meta: dict | None = None) -> str:
    """The one writer: `res` (+ "meta") as indented JSON at `path`, directories made; prints and returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(res, **({"meta": meta} if meta is not None else {})), f, indent=2, default=str)
    print(f"results: {path}")
    return path


# ---------------------------------------------------------------------------------------------------
# the memory probe

def _status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith(field_name + ":")), None)
    except OSError:
        return None


def _tensor_peak(fn) -> int:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
        del result                      # freeing the output after the peak cannot lower the peak
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()              # negative for frees
        peak = max(peak, live)
    return peak


def _sample_anon(peak: list, stop):
    """RssAnon (memory the process owns, without file-backed mmap pages) every 20 ms into peak[0], KiB."""
    while not stop.wait(0.02):
        peak[0] = max(peak[0], _status_kib("RssAnon") or 0)


def peak_memory(fn: Callable[[], object], device="cpu", what: str = "resident") -> dict:
    """The one memory probe: run fn() once. -> {"peak_bytes": the peak during the call above what was in use
    before it, "before_bytes", "process_peak_bytes" (the process's whole-life peak), "method"}; CPU with
    what="resident+anon" also "anon_peak_bytes" (RssAnon sampled every 20 ms: without mapped file pages)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        return dict(peak_bytes=peak - before, before_bytes=before, process_peak_bytes=peak,
                    method="cuda.max_memory_allocated")
    if what == "tensors":
        return dict(peak_bytes=_tensor_peak(fn), before_bytes=0, process_peak_bytes=None,
                    method="profiler tensor allocations")
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                # peak RSS := current RSS
        method = "VmHWM after clear_refs"
    except OSError:
        method = "ru_maxrss (includes earlier peaks)"
    before = _status_kib("VmRSS")
    if before is None:                  # no /proc: resource only (KiB on Linux)
        before, method = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "ru_maxrss delta"
    anon, stop = [0], threading.Event()
    if what == "resident+anon":
        threading.Thread(target=_sample_anon, args=(anon, stop), daemon=True).start()
    try:
        fn()
    finally:
        stop.set()
    life = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = _status_kib("VmHWM") if method.startswith("VmHWM") else life
    return dict(peak_bytes=max(0, peak - before) * 1024, before_bytes=before * 1024,
                process_peak_bytes=max(life, peak) * 1024, method=method,
                **({"anon_peak_bytes": anon[0] * 1024} if what == "resident+anon" else {}))


def fresh(fn: Callable[..., dict], **kwargs) -> dict:
    """fn(**kwargs) (a module-level function returning a JSON-able dict) in a fresh Python process."""
    module = fn.__module__ if fn.__module__ != "__main__" else sys.modules["__main__"].__spec__.name   # python -m
    job = json.dumps({"module": module, "name": fn.__qualname__, "kwargs": kwargs,
                      "threads": torch.get_num_threads()})
    proc = subprocess.run([sys.executable, "-m", "hybridlm.bench.measure"], input=job, capture_output=True, text=True,
                          env=dict(os.environ))
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise HybridLMError(f"{fn.__name__} in a fresh process failed: {last}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------------
# devices, dtypes, the matmul peak

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# dense (no sparsity) bf16/fp16 tensor-core peaks from NVIDIA's datasheets, TFLOP/s; first name match wins
NOMINAL_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0))


def nominal_peak_tflops(device, dtype) -> float | None:
    """The datasheet's dense peak for a known GPU in bf16/fp16, else None (CPUs, fp32, unlisted GPUs)."""
    device = torch.device(device)
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    name = torch.cuda.get_device_name(device)
    return next((t for key, t in NOMINAL_TFLOPS if key in name), None)


def matmul_peak_gflops(n: int = 1024, repeats: int = 5, dtype=torch.float32, device="cpu", calls: int = 1) -> float:
    """Best observed GFLOP/s of `calls` back-to-back n×n×n matmuls (2n³ flops each): the device's practical peak
    right now. On a GPU use a large n and several calls, so that launch and synchronisation cost is hidden."""
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    c = torch.empty(n, n, dtype=dtype, device=device)

    def run():
        for _ in range(calls):
            torch.mm(a, b, out=c)
    best = min(clock({"mm": run}, repeats)["mm"])
    return 2 * n ** 3 * calls / best / 1e9


def precision(device_type: str, dtype=None):
    """Mixed precision as real training runs it: float32 weights, autocast to bf16/fp16 (None or float32: off)."""
    if dtype in (None, torch.float32):
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


# ---------------------------------------------------------------------------------------------------
# step closures (any causal LM whose call returns `.logits` / `.loss`: ours and transformers')

def train_step(model, ids: Tensor, dtype=None, full_logits: bool = False) -> Callable[[], None]:
    """forward with labels + backward (no optimizer; fp16 without a loss scaler) on ids' device, under autocast to
    `dtype` if given; gradients dropped after each call. `full_logits`: ours materialises [tokens, vocab] logits."""
    extra = {"return_logits": True} if full_logits else {}

    def step():
        with precision(ids.device.type, dtype):
            out = model(ids, labels=ids, **extra)
        out.loss.backward()
        for p in model.parameters():
            p.grad = None
    return step


def train_cases(groups: dict, batch: int, seq_len: int, vocab_size: int, dtype=None, seed: int = 0) -> list[Case]:
    """One case per entry {name: {variant: model}} (ours / transformers, or one model): a training step of each
    variant on the same random batch [batch, seq_len]."""
    ids = torch.randint(0, vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))
    return [Case(name, lambda v=variants: {k: train_step(m.train(), ids, dtype) for k, m in v.items()},
                 work=batch * seq_len, unit="tokens", info=dict(batch=batch, seq_len=seq_len))
            for name, variants in groups.items()]


def forward_step(model, ids: Tensor, dtype=None, **kw) -> Callable[[], None]:
    def step():
        with torch.inference_mode(), precision(ids.device.type, dtype):
            model(ids, **kw)
    return step


def op_step(fn, inputs: list[Tensor]) -> Callable[[], None]:
    """Forward + backward of a sequence op `fn(*inputs) -> (out, final state)` on leaves `inputs`."""
    def step():
        for x in inputs:
            x.grad = None
        o, state = fn(*inputs)
        (o.square().mean() + state.square().mean()).backward()
    return step


def prefilled(model, context: int, *, batch: int = 1, seed: int = 0, chunk: int | None = None, dtype=None,
              max_tokens: int | None = None, step_fn=None):
    """A cache holding `context` random tokens (prefilled in chunks of `chunk`) and a one-token greedy decode
    step on it for the clock (each call decodes the next token with `step_fn(ids [B, 1], cache) -> logits [B, V]`,
    default the model's checked forward). -> (step, cache)."""
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (batch, context),
                        generator=torch.Generator().manual_seed(seed)).to(device)
    cache = model.make_cache(batch, max_tokens=max_tokens)
    step_fn = step_fn or (lambda x, c: model(x, cache=c).logits[:, -1])
    with torch.inference_mode(), precision(device.type, dtype):
        for i in range(0, context, chunk or context):
            logits = model(ids[:, i:i + (chunk or context)], cache=cache, logits_to_keep=1).logits[:, -1]
    state = {"logits": logits}

    def step():
        with torch.inference_mode(), precision(device.type, dtype):
            state["logits"] = step_fn(state["logits"].argmax(-1, keepdim=True), cache)
    return step, cache


def decode_latency(model, contexts, steps: int = 16, *, warmup: int = 2, chunk: int | None = None, dtype=None,
                   seed: int = 0) -> list[dict]:
    """Per-token decode latency after each context, the contexts' steps interleaved by the clock.
    -> rows {"context", "median_ms", "min_ms", "steps", "state_bytes", "times_ms"}."""
    built = {ctx: prefilled(model, ctx, chunk=chunk, dtype=dtype, seed=seed + ctx) for ctx in contexts}
    times = clock({ctx: step for ctx, (step, _) in built.items()}, steps, warmup)
    return [dict(context=ctx, median_ms=1e3 * median(times[ctx]), min_ms=1e3 * min(times[ctx]), steps=steps,
                 state_bytes=built[ctx][1].nbytes, times_ms=[1e3 * t for t in times[ctx]]) for ctx in contexts]


# ---------------------------------------------------------------------------------------------------
# model flops (approximate, for MFU)

def matmul_params(model) -> int:
    """Parameters used in matmuls per token: every 2-D weight except the input embedding(s)
    (a tied lm_head still counts once, as the output matmul)."""
    seen, n = set(), 0
    emb_ids = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = getattr(model, "lm_head", None)
    head_id = id(head.weight) if head is not None else None
    for m in model.modules():
        for p in m.parameters(recurse=False):
            if id(p) in seen or p.dim() < 2:
                continue
            seen.add(id(p))
            if id(p) in emb_ids and id(p) != head_id:
                continue
            n += p.numel()
    return n


def attention_keys_per_query(seq_len: int, keys: int | None) -> float:
    """Mean keys a causal query scores over a sequence of `seq_len`: T/2 for full attention, w - w²/2T under a
    window (or top-k) of w < T keys."""
    if keys is None or keys >= seq_len:
        return seq_len / 2
    return keys - keys * keys / (2 * seq_len)


def train_flops_per_token(model, seq_len: int) -> float:
    """≈ 6·(matmul parameters) + the softmax-attention score and value flops, forward + backward: 6·2·keys·H·D
    per attention layer, every letter the registry calls attention (A, F, W, L, I, ...; keys per query bounded by its
    window or top-k); + 3x the forward FLOPs of the linear-time mixers' chunked recurrence, each layer's own count
    (`sequence_flops()`: S, R, G, K; ops/flops.py)."""
    f = 6.0 * matmul_params(model)
    f += 3.0 * sum(m.sequence_flops() for m in model.modules() if hasattr(m, "sequence_flops"))
    cfg = getattr(model, "config", None)
    if getattr(cfg, "layout", ""):
        from ..models.registry import attention_layers
        for _, c, keys in attention_layers(cfg):
            f += 6.0 * 2 * attention_keys_per_query(seq_len, keys) * c.n_heads * c.attn_head_dim
    return f


if __name__ == "__main__":                  # `fresh`: one function, one JSON line out
    from ..runtime import tune_allocator
    tune_allocator()                        # the allocator the `hybridlm` command runs with
    job = json.loads(sys.stdin.read())
    torch.set_num_threads(job["threads"])
    import importlib
    target = importlib.import_module(job["module"])
    for part in job["name"].split("."):
        target = getattr(target, part)
    print(json.dumps(target(**job["kwargs"])))
