"""Rodimus* measurements (issue 4): constant inference cache, decode latency against context, state size
against Mamba-2, the chunked GLA op against its recurrence, and training speed against Mamba-2.

    hybridlm bench --suite rodimus [--quick]
    python -m hybridlm.bench.rodimus [--quick]
"""
import sys

import torch

from . import throughput as tp
from .gla_speed import bench_gla


def _model(name: str, **over):
    from .. import presets
    from ..models.causal_lm import CausalLM
    torch.manual_seed(0)
    return CausalLM(presets.get(name, **over)).eval()


def bench_cache_and_latency(name: str, contexts=(128, 4096, 32768), *, steps: int = 40, prefill_chunk: int = 1024,
                            d_model: int = 256, n_layers: int | None = None, vocab_size: int = 256, **over) -> list:
    """Prefill every context into its own cache (chunks of `prefill_chunk`, so a long prompt never builds a
    full attention matrix), then time one-token decode steps, one per context in turn, round after round
    (interleaved, so all contexts see the same machine load). Returns rows
    {"context", "cache_bytes", "median_ms", "min_ms"} (the median is what the 1.2x criterion reads)."""
    m = _model(name, d_model=d_model, vocab_size=vocab_size, max_seq_len=max(contexts) + steps + 8,
               **({"n_layers": n_layers} if n_layers else {}), **over)
    g = torch.Generator().manual_seed(0)
    caches, logits, times = {}, {}, {c: [] for c in contexts}
    with torch.inference_mode():
        for ctx in contexts:
            ids = torch.randint(0, vocab_size, (1, ctx), generator=g)
            caches[ctx] = m.make_cache(1)
            for i in range(0, ctx, prefill_chunk):
                logits[ctx] = m(ids[:, i:i + prefill_chunk], cache=caches[ctx], logits_to_keep=1).logits[:, -1]
        for r in range(steps + 4):
            for ctx in (contexts if r % 2 == 0 else contexts[::-1]):
                nxt = logits[ctx].argmax(-1, keepdim=True)
                t0 = tp.now()
                logits[ctx] = m(nxt, cache=caches[ctx]).logits[:, -1]
                if r >= 4:                                         # the first rounds warm allocator paths
                    times[ctx].append(tp.now() - t0)
    return [{"context": c, "cache_bytes": caches[c].nbytes, "median_ms": 1e3 * tp.median(times[c]),
             "min_ms": 1e3 * min(times[c])} for c in contexts]


def bench_state_vs_mamba2(d_model: int = 256) -> dict:
    """Recurrent state bytes per layer (batch 1) of Rodimus at n = 64 vs Mamba-2 at d_state 128, same width
    (expand 2), and the whole slot including the short-conv tails."""
    from ..cache import InferenceCache
    from ..context import SeqContext
    from ..layers.mamba2 import Mamba2
    from ..layers.init import initialised
    from ..layers.rodimus import Rodimus
    x = torch.randn(1, 4, d_model)
    ctx = SeqContext(positions=torch.arange(4)[None])
    out = {"d_model": d_model}
    for key, layer in (("rodimus_n64", initialised(Rodimus(d_model, layer_idx=0, d_state=64))),
                       ("mamba2_dstate128", initialised(Mamba2(d_model, layer_idx=0, d_state=128)))):
        c = InferenceCache(1, 1)
        with torch.no_grad():
            layer(x, ctx=ctx, cache=c)
        out[key] = {"state_bytes": c.layers[0].state.nbytes, "slot_bytes": c.layers[0].nbytes,
                    "state_shape": list(c.layers[0].state.shape)}
    out["state_ratio"] = out["rodimus_n64"]["state_bytes"] / out["mamba2_dstate128"]["state_bytes"]
    out["slot_ratio"] = out["rodimus_n64"]["slot_bytes"] / out["mamba2_dstate128"]["slot_bytes"]
    return out


def bench_train_vs_mamba2(*, d_model: int = 256, vocab_size: int = 8192, batch: int = 4, seq_len: int = 512,
                          rodimus_layers: int = 6, mamba2_layers: int = 7, repeats: int = 5,
                          extra: tuple = ("rodimus++",)) -> dict:
    """Forward+backward tokens/s, interleaved in one run, of `rodimus` vs `mamba2` at (about) equal parameters:
    at d 256 a Rodimus layer (n 64) has ~543k parameters and a Mamba-2 layer (d_state 128) ~462k, so 6 R
    layers match 7 S layers within 1%. `extra` presets (at 2 blocks) are timed alongside for reference."""
    common = dict(d_model=d_model, vocab_size=vocab_size, max_seq_len=seq_len)
    models = {"rodimus": _model("rodimus", n_layers=rodimus_layers, **common),
              "mamba2": _model("mamba2", n_layers=mamba2_layers, **common)}
    for name in extra:
        models[name] = _model(name, n_layers=2, **common)
    ids = torch.randint(0, vocab_size, (batch, seq_len))
    steps = {}
    for name, m in models.items():
        m.train()
        steps[name] = tp.train_step(m, ids)
    times = tp.interleaved(steps, repeats=repeats)
    out = {"batch": batch, "seq_len": seq_len, "d_model": d_model, "vocab_size": vocab_size, "rows": {}}
    for name, m in models.items():
        s = tp.summary(times[name], batch * seq_len)
        out["rows"][name] = {"parameters": m.num_parameters(), "layout": m.config.layout, "tokens_per_s": s["per_s"],
                             "median_s": s["median_s"]}
    out["mamba2_over_rodimus"] = out["rows"]["mamba2"]["tokens_per_s"] / out["rows"]["rodimus"]["tokens_per_s"]
    return out


def run_suite(quick: bool = False, log=print) -> dict:
    """All measurements of issue 4; `quick` shrinks every size to a smoke test."""
    res = {}
    T = 256 if quick else 2048
    g = bench_gla(T=T, H=1, K=64, V=512, repeats=2 if quick else 3)   # Rodimus' shapes at d 256: n 64, m 512
    res["gla_fwd_bwd"] = {"T": T, "H": 1, "K": 64, "V": 512, **g}
    log(f"GLA forward+backward at T={T} (1 head, K 64, V 512): recurrence {g['recurrent_s']:.3f} s, "
        f"chunked {g['chunked_s']:.3f} s -> {g['speedup']:.1f}x")

    st = bench_state_vs_mamba2(64 if quick else 256)
    res["state_vs_mamba2"] = st
    log(f"state per layer at d {st['d_model']}: Rodimus n=64 {st['rodimus_n64']['state_bytes']} B vs Mamba-2 "
        f"d_state=128 {st['mamba2_dstate128']['state_bytes']} B -> {st['state_ratio']:.3f} "
        f"(with conv tails {st['slot_ratio']:.3f})")

    contexts = (32, 256, 1024) if quick else (128, 4096, 32768)
    res["cache_latency"] = {}
    for name in ("rodimus", "rodimus++"):
        kw = dict(d_model=64, n_layers=2, steps=8, swa_window=64) if quick else {}
        rows = bench_cache_and_latency(name, contexts, **kw)
        res["cache_latency"][name] = rows
        for r in rows:
            log(f"{name:10s} context {r['context']:>6}: cache {r['cache_bytes']:>9} B, decode {r['median_ms']:.2f} "
                f"ms/token (min {r['min_ms']:.2f})")
        log(f"{name:10s} latency ratio {contexts[-1]} / {contexts[0]}: "
            f"{rows[-1]['median_ms'] / rows[0]['median_ms']:.2f}")

    kw = dict(d_model=64, vocab_size=512, batch=2, seq_len=64, repeats=2) if quick else {}
    tr = bench_train_vs_mamba2(**kw)
    res["train_vs_mamba2"] = tr
    for name, r in tr["rows"].items():
        log(f"train {name:10s} {r['layout']:10s} {r['parameters'] / 1e6:6.2f}M params: {r['tokens_per_s']:8.0f} tok/s")
    log(f"mamba2 / rodimus tokens/s: {tr['mamba2_over_rodimus']:.2f}")
    return res


if __name__ == "__main__":
    run_suite(quick="--quick" in sys.argv)
