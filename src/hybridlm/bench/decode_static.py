"""Decode ms/token at batch 1: the growing-cache step against the static-shape step (`CausalLM.static_decode_step`),
eager, and on CUDA also as a CUDA graph (torch.compile mode "reduce-overhead"). Runs on CUDA in bf16 when a GPU is
present, otherwise on the CPU in float32; the modes are interleaved (alternating order each round) and each round
decodes `steps` tokens after an untimed prefill.

`hybridlm bench --suite decode [--quick]`, or `python -m hybridlm.bench.decode_static`.
Sizes: HYBRIDLM_DECODE_BENCH="presets=transformer++,mamba2;d_model=768;n_layers=12;context=512;steps=256".
"""
import os

import torch

from ..models import CausalLM, presets
from .throughput import median, now

FULL = dict(presets="transformer++,mamba2,rodimus++,cheems,deepseek-mla", d_model=768, n_layers=12,
            vocab_size=32000, context=512, steps=256, repeats=3)
QUICK = dict(presets="transformer++,mamba2", d_model=64, n_layers=2, vocab_size=512, context=16, steps=8,
             repeats=2)


def _settings(quick: bool) -> dict:
    s = dict(QUICK if quick else FULL)
    for item in filter(None, os.environ.get("HYBRIDLM_DECODE_BENCH", "").split(";")):
        key, _, val = item.partition("=")
        s[key.strip()] = val.strip() if key.strip() == "presets" else int(val)
    return s


def _decode_seconds(model, ids, steps: int, mode: str) -> float:
    """Seconds per token of `steps` greedy decode steps after prefilling ids [1, T] (prefill not timed)."""
    cache = model.make_cache(1, max_tokens=ids.shape[1] + steps + 1)
    with torch.inference_mode():
        logits = model(ids, cache=cache, logits_to_keep=1).logits[:, -1]
        if mode == "growing":
            step = model._decode_step
        else:
            step = model.static_decode_step(compile=mode == "static+graph")
        t0 = now()
        for _ in range(steps):
            logits = step(logits.argmax(-1, keepdim=True), cache)
        return (now() - t0) / steps


def run_suite(quick: bool = False, log=print) -> dict:
    s = _settings(quick)
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    modes = ["growing", "static"] + (["static+graph"] if cuda else [])
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dtype), "settings": s,
           "threads": torch.get_num_threads(), "ms_per_token": {}}
    g = torch.Generator().manual_seed(0)
    for name in s["presets"].split(","):
        cfg = presets.get(name, n_layers=s["n_layers"], d_model=s["d_model"], vocab_size=s["vocab_size"],
                          max_seq_len=max(2048, s["context"] + s["steps"] + 1))
        torch.manual_seed(0)
        model = CausalLM(cfg).to(device=device, dtype=dtype).eval()
        ids = torch.randint(0, s["vocab_size"], (1, s["context"]), generator=g).to(device)
        for mode in modes:                                    # warm-up (and, for the graph, capture)
            _decode_seconds(model, ids, min(8, s["steps"]), mode)
        times = {m: [] for m in modes}
        for r in range(s["repeats"]):
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                times[mode].append(_decode_seconds(model, ids, s["steps"], mode))
        row = {m: 1e3 * median(t) for m, t in times.items()}
        out["ms_per_token"][name] = row
        log(f"{name:>14} ({model.num_parameters() / 1e6:.0f}M, context {s['context']}): "
            + "  ".join(f"{m} {v:.3f}" for m, v in row.items()) + f" ms/token on {out['device']}")
    return out


if __name__ == "__main__":
    run_suite()
