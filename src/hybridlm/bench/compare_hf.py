"""Side-by-side measurements against the transformers implementation of the same model, in one run.

For each architecture (`transformer++` vs `LlamaForCausalLM`, `mamba2` vs `Mamba2ForCausalLM`) the
transformers model is built at the same config from our preset, given random weights, and converted with
`from_transformers`, so both compute the same function. Then, alternating ours / transformers in every
repeat and taking medians:
  - forward+backward tokens/s (training step without optimizer) per batch shape;
  - greedy decode tokens/s: our `stream` vs transformers `generate()` (use_cache), timed from the first
    to the last new token on both sides (prefill excluded; end-to-end time reported too);
  - our Mamba-2 per-token decode latency after a short and a long context (interleaved steps).
transformers is imported here only.
"""
import time

import torch

from .. import presets
from ..hf.convert import from_transformers
from ..models.config import ModelConfig
from ..models.layout import flatten, parse_layout
from ..models.registry import LETTERS
from . import throughput as tp

ARCHS = {"llama": "transformer++", "mamba2": "mamba2"}


# ---------------------------------------------------------------------------------------------------
# model pairs

def hf_config(cfg: ModelConfig, arch: str):
    """A transformers config computing the same function as our ModelConfig `cfg`."""
    import transformers
    special = dict(eos_token_id=None, bos_token_id=None, pad_token_id=None)
    letters = flatten(parse_layout(cfg.layout, LETTERS.keys()))
    if arch == "llama":
        n_layers = letters.count("A")
        return transformers.LlamaConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.mlp_hidden_size,
            num_hidden_layers=n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.attn_head_dim, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base},
            tie_word_embeddings=cfg.tie_embeddings, attention_bias=cfg.attn_bias, mlp_bias=cfg.mlp_bias,
            hidden_act=cfg.mlp_act, **special)
    if arch == "mamba2":
        n_layers = letters.count("S")
        d_inner = cfg.ssd_expand * cfg.d_model
        return transformers.Mamba2Config(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, expand=cfg.ssd_expand,
            num_heads=d_inner // cfg.ssd_headdim, head_dim=cfg.ssd_headdim, state_size=cfg.ssd_d_state,
            n_groups=cfg.ssd_ngroups, conv_kernel=cfg.ssd_d_conv, num_hidden_layers=n_layers,
            chunk_size=cfg.ssd_chunk_size, layer_norm_epsilon=cfg.norm_eps, use_bias=cfg.ssd_bias,
            use_conv_bias=cfg.ssd_conv_bias, tie_word_embeddings=cfg.tie_embeddings, **special)
    raise ValueError(f"unknown arch {arch!r}")


def build_pair(arch: str, *, d_model: int, n_layers: int, vocab_size: int, max_seq_len: int, seed: int = 0,
               **overrides):
    """(our preset config, transformers model, our converted model), same weights, both in eval mode."""
    import transformers
    cfg = presets.get(ARCHS[arch], n_layers=n_layers, d_model=d_model, vocab_size=vocab_size,
                      max_seq_len=max_seq_len, **overrides)
    torch.manual_seed(seed)
    cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.Mamba2ForCausalLM
    hf = cls(hf_config(cfg, arch)).eval()
    ours = from_transformers(hf, max_seq_len=max_seq_len)
    a, b = _effective(cfg, arch), _effective(ours.config, arch)
    mismatched = {k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)}
    if mismatched:
        raise RuntimeError(f"converted {arch} config differs from the preset: {mismatched}")
    return cfg, hf, ours


def _effective(cfg: ModelConfig, arch: str) -> dict:
    """The fields that decide the function computed (derived sizes resolved), for the given arch."""
    d = dict(layout=cfg.layout, vocab_size=cfg.vocab_size, d_model=cfg.d_model, tie=cfg.tie_embeddings,
             norm=cfg.norm, eps=cfg.norm_eps)
    if arch == "llama":
        d.update(heads=cfg.n_heads, kv=cfg.kv_heads, hd=cfg.attn_head_dim, rope=cfg.rope_base,
                 inter=cfg.rope_interleaved, mlp=cfg.mlp_hidden_size, act=cfg.mlp_act, gated=cfg.mlp_gated,
                 bias=(cfg.attn_bias, cfg.mlp_bias))
    else:
        d.update(n=cfg.ssd_d_state, k=cfg.ssd_d_conv, e=cfg.ssd_expand, p=cfg.ssd_headdim, g=cfg.ssd_ngroups,
                 chunk=cfg.ssd_chunk_size, bias=(cfg.ssd_bias, cfg.ssd_conv_bias))
    return d


# ---------------------------------------------------------------------------------------------------
# measurements

def _sample_ids(vocab: int, batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def train_rows(arch, hf, ours, shapes, repeats, peak_gflops, log=print) -> list[dict]:
    rows = []
    hf.train()
    ours.train()
    try:
        for B, T in shapes:
            ids = _sample_ids(ours.config.vocab_size, B, T, seed=B * 100003 + T)
            times = tp.interleaved({"ours": tp.train_step(ours, ids), "hf": tp.train_step(hf, ids)},
                                   repeats=repeats)
            o, h = tp.summary(times["ours"], B * T), tp.summary(times["hf"], B * T)
            flops = tp.train_flops_per_token(ours, T)
            row = dict(arch=arch, preset=ARCHS[arch], batch=B, seq_len=T,
                       ours_tokens_per_s=o["per_s"], hf_tokens_per_s=h["per_s"], ratio=o["per_s"] / h["per_s"],
                       ours_mfu=o["per_s"] * flops / (peak_gflops * 1e9),
                       hf_mfu=h["per_s"] * flops / (peak_gflops * 1e9),
                       flops_per_token=flops, ours_times_s=times["ours"], hf_times_s=times["hf"])
            log(f"  train {arch:7s} {B}x{T}: ours {o['per_s']:8.0f} tok/s  hf {h['per_s']:8.0f} tok/s  "
                f"ratio {row['ratio']:.2f}")
            rows.append(row)
    finally:
        hf.eval()
        ours.eval()
    return rows


class _Clock:
    """Timestamps of streamed tokens (a transformers streamer, also used for our `stream`)."""

    def __init__(self):
        self.stamps: list[float] = []

    def put(self, value):                       # transformers: first call = the prompt, then one per token
        self.stamps.append(time.perf_counter())

    def end(self):
        pass


def _ours_decode(model, ids, n, compile=False):
    clock, t0 = _Clock(), time.perf_counter()
    for _ in model.stream(ids, n, temperature=0, compile=compile):
        clock.put(None)
    total = time.perf_counter() - t0
    return clock.stamps, total


def _hf_decode(model, ids, n):
    clock = _Clock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, use_cache=True, pad_token_id=0, streamer=clock)
    total = time.perf_counter() - t0
    return clock.stamps[1:], total               # drop the prompt's put


def decode_rows(arch, hf, ours, context, new_tokens, repeats, compile=True, log=print) -> list[dict]:
    """Greedy decode tokens/s of our `stream` (eager, and with the torch.compile'd decode step when `compile`)
    vs transformers `generate()` (eager, its default), interleaved in rotating order."""
    ids = _sample_ids(ours.config.vocab_size, 1, context, seed=context)
    fns = {"ours": lambda: _ours_decode(ours, ids, new_tokens), "hf": lambda: _hf_decode(hf, ids, new_tokens)}
    if compile:
        fns["ours_compiled"] = lambda: _ours_decode(ours, ids, new_tokens, compile=True)
    for fn in fns.values():                      # warm-up (and compilation)
        fn()
    res = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            stamps, total = fns[name]()
            assert len(stamps) == new_tokens, (name, len(stamps))
            res[name].append((stamps[-1] - stamps[0], total))
    steps = new_tokens - 1
    med = {name: tp.median([d for d, _ in v]) for name, v in res.items()}
    row = dict(arch=arch, preset=ARCHS[arch], batch=1, context=context, new_tokens=new_tokens,
               ours_tokens_per_s=steps / med["ours"], hf_tokens_per_s=steps / med["hf"], ratio=med["hf"] / med["ours"],
               ours_ms_per_token=1e3 * med["ours"] / steps, hf_ms_per_token=1e3 * med["hf"] / steps,
               ours_end_to_end_s=tp.median([t for _, t in res["ours"]]),
               hf_end_to_end_s=tp.median([t for _, t in res["hf"]]),
               ours_decode_s=[d for d, _ in res["ours"]], hf_decode_s=[d for d, _ in res["hf"]])
    msg = (f"  decode {arch:7s} ctx {context}: ours {row['ours_tokens_per_s']:7.1f} tok/s  "
           f"hf {row['hf_tokens_per_s']:7.1f} tok/s  ratio {row['ratio']:.2f}")
    if compile:
        row.update(ours_compiled_tokens_per_s=steps / med["ours_compiled"], ratio_compiled=med["hf"] / med["ours_compiled"],
                   ours_compiled_ms_per_token=1e3 * med["ours_compiled"] / steps,
                   ours_compiled_decode_s=[d for d, _ in res["ours_compiled"]])
        msg += f"  | compiled {row['ours_compiled_tokens_per_s']:7.1f} tok/s  ratio {row['ratio_compiled']:.2f}"
    log(msg)
    return [row]


def latency_rows(model, contexts, steps, log=print) -> list[dict]:
    """Per-token decode latency of `model` after each context length; the steps of all contexts are
    interleaved (one step of each in turn) so they see the same machine load."""
    caches, logits = {}, {}
    with torch.inference_mode():
        for ctx in contexts:
            ids = _sample_ids(model.config.vocab_size, 1, ctx, seed=ctx + 7)
            cache = model.make_cache(1)
            logits[ctx] = model(ids, cache=cache, logits_to_keep=1).logits[:, -1]
            caches[ctx] = cache
        times = {ctx: [] for ctx in contexts}
        for i in range(steps + 2):
            for ctx in (contexts if i % 2 == 0 else contexts[::-1]):
                nxt = logits[ctx].argmax(-1, keepdim=True)
                t0 = tp.now()
                logits[ctx] = model(nxt, cache=caches[ctx]).logits[:, -1]
                if i >= 2:
                    times[ctx].append(tp.now() - t0)
    rows = []
    for ctx in contexts:
        rows.append(dict(context=ctx, median_ms=1e3 * tp.median(times[ctx]), min_ms=1e3 * min(times[ctx]),
                         steps=steps, state_bytes=caches[ctx].nbytes, times_ms=[1e3 * t for t in times[ctx]]))
        log(f"  latency ctx {ctx:6d}: {rows[-1]['median_ms']:.2f} ms/token (state {caches[ctx].nbytes} bytes)")
    return rows


# ---------------------------------------------------------------------------------------------------

FULL = dict(d_model=256, n_layers=4, vocab_size=8192, shapes=[(4, 512), (1, 2048)], context=1024, new_tokens=64,
            latency_contexts=[128, 8192], latency_steps=32, repeats=5, decode_repeats=3, decode_compile=True)
QUICK = dict(d_model=64, n_layers=2, vocab_size=512, shapes=[(2, 32), (1, 64)], context=32, new_tokens=6,
             latency_contexts=[16, 256], latency_steps=6, repeats=2, decode_repeats=2, decode_compile=False,
             overrides={"mamba2": dict(ssd_d_state=16, ssd_headdim=32)})

TARGETS = {"train_llama": 1.0, "train_mamba2": 1.1, "decode": 2.0, "latency_ratio_max": 1.2}


def run_compare(settings: dict, archs=("llama", "mamba2"), log=print) -> dict:
    s = dict(settings)
    overrides = s.pop("overrides", {})
    peak0 = tp.matmul_peak_gflops()
    log(f"matmul peak (fp32, 1024^3): {peak0:.1f} GFLOP/s, {torch.get_num_threads()} threads")
    max_len = max(max(T for _, T in s["shapes"]), s["context"] + s["new_tokens"], max(s["latency_contexts"]) + 64)
    out = {"train": [], "decode": [], "latency": [], "configs": {}}
    models = {}
    for arch in archs:
        cfg, hf, ours = build_pair(arch, d_model=s["d_model"], n_layers=s["n_layers"], vocab_size=s["vocab_size"],
                                   max_seq_len=max_len, **overrides.get(arch, {}))
        out["configs"][arch] = {"preset": ARCHS[arch], "hf_class": type(hf).__name__, "config": cfg.to_dict(),
                                "parameters": ours.num_parameters()}
        models[arch] = (hf, ours)
    for arch in archs:
        out["train"] += train_rows(arch, *models[arch], s["shapes"], s["repeats"], peak0, log)
    for arch in archs:
        out["decode"] += decode_rows(arch, *models[arch], s["context"], s["new_tokens"], s["decode_repeats"],
                                     s.get("decode_compile", False), log)
    if "mamba2" in archs:
        out["latency"] = latency_rows(models["mamba2"][1], s["latency_contexts"], s["latency_steps"], log)
    peak1 = tp.matmul_peak_gflops()
    out["matmul_peak_gflops"] = {"start": peak0, "end": peak1}
    out["targets"] = check_targets(out)
    out["settings"] = {k: v for k, v in settings.items()}
    return out


def check_targets(res: dict) -> dict:
    t = {}
    for row in res["train"]:
        key = f"train_{row['arch']}"
        t[f"{key}_{row['batch']}x{row['seq_len']}"] = dict(target=f">= {TARGETS[key]}x", measured=row["ratio"],
                                                           met=row["ratio"] >= TARGETS[key])
    for row in res["decode"]:
        t[f"decode_{row['arch']}"] = dict(target=f">= {TARGETS['decode']}x", measured=row["ratio"],
                                          met=row["ratio"] >= TARGETS["decode"])
        if "ratio_compiled" in row:
            t[f"decode_{row['arch']}_compiled"] = dict(target=f">= {TARGETS['decode']}x", measured=row["ratio_compiled"],
                                                       met=row["ratio_compiled"] >= TARGETS["decode"])
    lat = res["latency"]
    if len(lat) >= 2:
        r = lat[-1]["median_ms"] / lat[0]["median_ms"]
        t["mamba2_latency_long_over_short"] = dict(target=f"<= {TARGETS['latency_ratio_max']}", measured=r,
                                                   met=r <= TARGETS["latency_ratio_max"])
    return t
