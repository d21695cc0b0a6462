"""Timing utilities: interleaved repeats with medians, forward+backward and decode throughput, decode
latency against context length, and the machine's matmul peak (any device and dtype) measured in the same run.

Everything here works for any causal LM whose call returns an object with `.logits` and `.loss` (ours and
transformers'); the `kind` argument only picks how a decode step is driven.
"""
import contextlib
import gc
import statistics
import time
from typing import Callable

import torch
from torch import Tensor


def now() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def timed(fn: Callable[[], object]) -> float:
    """Wall seconds of one call."""
    t0 = now()
    fn()
    return now() - t0


def interleaved(fns: dict[str, Callable[[], object]], repeats: int = 5, warmup: int = 1) -> dict[str, list[float]]:
    """Time every function `repeats` times, alternating between them in each round (and reversing the order
    every other round) so that all of them see the same machine load. Returns name -> list of seconds."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            gc.collect()
            out[n].append(timed(fns[n]))
    return out


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def summary(times: list[float], work: float) -> dict:
    """{"median_s", "min_s", "max_s", "per_s": work / median} for `work` units (tokens) per call."""
    m = median(times)
    return {"median_s": m, "min_s": min(times), "max_s": max(times), "per_s": work / m if m > 0 else float("inf"),
            "repeats": len(times)}


# ---------------------------------------------------------------------------------------------------
# matmul peak

def matmul_peak_gflops(n: int = 1024, repeats: int = 5, dtype=torch.float32, device="cpu", calls: int = 1) -> float:
    """Best observed GFLOP/s of `calls` back-to-back n×n×n matmuls (2n³ flops each): the device's practical peak
    right now. On a GPU use a large n and several calls, so that launch and synchronisation cost is hidden."""
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    c = torch.empty(n, n, dtype=dtype, device=device)

    def run():
        for _ in range(calls):
            torch.mm(a, b, out=c)
    run()
    best = min(timed(run) for _ in range(repeats))
    return 2 * n ** 3 * calls / best / 1e9


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


def precision(device_type: str, dtype=None):
    """Mixed precision as real training runs it: float32 weights, autocast to bf16/fp16 (None or float32: off)."""
    if dtype in (None, torch.float32):
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


# ---------------------------------------------------------------------------------------------------
# step closures

def train_step(model, ids: Tensor, dtype=None) -> Callable[[], None]:
    """forward with labels + backward (no optimizer; fp16 without a loss scaler) on ids' device, under autocast to
    `dtype` if given; gradients are dropped after each call."""
    def step():
        with precision(ids.device.type, dtype):
            out = model(ids, labels=ids)
        out.loss.backward()
        for p in model.parameters():
            p.grad = None
    return step


def forward_step(model, ids: Tensor, dtype=None) -> Callable[[], None]:
    def step():
        with torch.inference_mode(), precision(ids.device.type, dtype):
            model(ids)
    return step


def ours_generate(model, ids: Tensor, new_tokens: int) -> Callable[[], Tensor]:
    """Greedy decoding with our `stream` (prefill once, then one token per step)."""
    def run():
        return model.generate(ids, new_tokens, temperature=0)
    return run


def hf_generate(model, ids: Tensor, new_tokens: int) -> Callable[[], Tensor]:
    """Greedy transformers `generate()` with its cache, exactly `new_tokens` new tokens."""
    mask = torch.ones_like(ids)

    def run():
        with torch.inference_mode():
            return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=False, use_cache=True, pad_token_id=0)
    return run


def decode_latency(model, context: int, steps: int = 16, *, vocab_size: int | None = None, batch: int = 1,
                   seed: int = 0, dtype=None) -> dict:
    """Our model: prefill `context` tokens into a cache, then time `steps` single-token decode steps
    (each timed separately), on the model's device, under autocast to `dtype` if given.
    Returns {"context", "median_ms", "min_ms", "steps", "state_bytes"}."""
    V = vocab_size or model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    device = model.embed.weight.device
    ids = torch.randint(0, V, (batch, context), generator=g).to(device)
    cache = model.make_cache(batch)
    times = []
    with torch.inference_mode(), precision(device.type, dtype):
        logits = model(ids, cache=cache, logits_to_keep=1).logits[:, -1]
        for _ in range(steps + 2):
            nxt = logits.argmax(-1, keepdim=True)
            t0 = now()
            logits = model(nxt, cache=cache).logits[:, -1]
            times.append(now() - t0)
    times = times[2:]                                              # first steps warm allocator paths
    return {"context": context, "median_ms": 1e3 * median(times), "min_ms": 1e3 * min(times), "steps": steps,
            "state_bytes": cache.nbytes}


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


def train_flops_per_token(model, seq_len: int) -> float:
    """≈ 6·(matmul parameters) + causal attention score/value flops (6·2·T/2·H·D per attention layer),
    for forward + backward. SSD's intra-chunk work is not counted (MFU is then a lower bound)."""
    f = 6.0 * matmul_params(model)
    cfg = getattr(model, "config", None)
    layout = getattr(cfg, "layout", "")
    if layout:
        from ..models.layout import flatten, parse_layout
        from ..models.registry import LETTERS
        n_attn = flatten(parse_layout(layout, LETTERS.keys())).count("A")
        f += 6.0 * 2 * (seq_len / 2) * cfg.n_heads * cfg.attn_head_dim * n_attn
    return f
