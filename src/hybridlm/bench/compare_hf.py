"""`hybridlm bench --compare-hf`: ours against the transformers implementation of the same model, in one run.

For each architecture (`transformer++` vs `LlamaForCausalLM`, `mamba2` vs `Mamba2ForCausalLM`) the transformers
model is built from our preset's config by hf/native.py's mapping, given random weights and converted with
`from_transformers`, so both compute the same function. Timed by the one clock (interleaved, medians):
forward+backward tokens/s per batch shape; greedy decode tokens/s, our `stream` vs transformers `generate()`,
from the first to the last new token (prefill excluded; end-to-end time too); our Mamba-2 per-token decode
latency after a short and a long context.
"""
import torch

from ..hf.convert import from_transformers
from . import measure as ms
from .twins import native_twin

ARCHS = {"llama": "transformer++", "mamba2": "mamba2"}


def build_pair(arch: str, *, d_model: int, n_layers: int, vocab_size: int, max_seq_len: int, seed: int = 0,
               **overrides):
    """(our preset config, transformers model, our converted model), same weights, both in eval mode. The
    transformers config is hf.native's mapping, which checks that it converts back to exactly our config."""
    from transformers import AutoModelForCausalLM
    hf_cfg = native_twin(ARCHS[arch], d_model, n_layers, vocab_size, max_seq_len, **overrides)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(hf_cfg).eval()
    ours = from_transformers(hf, max_seq_len=max_seq_len)
    return ours.config, hf, ours


def train_rows(arch, hf, ours, shapes, repeats, peak_gflops, log=print) -> list[dict]:
    rows = []
    hf.train()
    ours.train()
    try:
        for B, T in shapes:
            timed = ms.run_cases(ms.train_cases({arch: {"ours": ours, "hf": hf}}, B, T, ours.config.vocab_size,
                                                 seed=B * 7919 + T), repeats)
            o, h = ms.pick(timed, arch, "ours"), ms.pick(timed, arch, "hf")
            flops = ms.train_flops_per_token(ours, T)
            row = dict(arch=arch, preset=ARCHS[arch], batch=B, seq_len=T,
                       ours_tokens_per_s=o["per_s"], hf_tokens_per_s=h["per_s"], ratio=o["per_s"] / h["per_s"],
                       ours_mfu=o["per_s"] * flops / (peak_gflops * 1e9),
                       hf_mfu=h["per_s"] * flops / (peak_gflops * 1e9),
                       flops_per_token=flops, ours_times_s=o["times_s"], hf_times_s=h["times_s"])
            log(f"  train {arch:7s} {B}x{T}: ours {o['per_s']:8.0f} tok/s  hf {h['per_s']:8.0f} tok/s  "
                f"ratio {row['ratio']:.2f}")
            rows.append(row)
    finally:
        hf.eval()
        ours.eval()
    return rows


class _Stamps(list):
    """A transformers streamer keeping the clock's stamp of every put (the prompt's first, then one per token)."""

    def put(self, value):
        self.append(ms.stamp())

    def end(self):
        pass


def decode_rows(arch, hf, ours, context, new_tokens, repeats, compile=True, log=print) -> list[dict]:
    """Greedy decode tokens/s of our `stream` (eager, and with the torch.compile'd decode step when `compile`)
    vs transformers `generate()` (eager, its default), interleaved by the clock; tokens/s from the first to the
    last new token (prefill excluded), end-to-end time from the clock."""
    ids = torch.randint(0, ours.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(context))
    runs = {}

    def ours_run(name, compiled=False):
        def run():
            runs.setdefault(name, []).append(_Stamps())
            for _ in ours.stream(ids, new_tokens, temperature=0, compile=compiled):
                runs[name][-1].put(None)
        return run

    def hf_run():
        runs.setdefault("hf", []).append(_Stamps())
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0,
                        streamer=runs["hf"][-1])
        runs["hf"][-1].pop(0)                   # the prompt's put
    fns = {"ours": ours_run("ours"), "hf": hf_run}
    if compile:
        fns["ours_compiled"] = ours_run("ours_compiled", compiled=True)
    totals = ms.clock(fns, repeats, warmup=1)   # warm-up (and compilation)
    dec = {name: [s[-1] - s[0] for s in v[-repeats:]] for name, v in runs.items()}
    assert all(len(s) == new_tokens for v in runs.values() for s in v), "one stamp per new token"
    steps = new_tokens - 1
    med = {name: ms.median(v) for name, v in dec.items()}
    row = dict(arch=arch, preset=ARCHS[arch], batch=1, context=context, new_tokens=new_tokens,
               ours_tokens_per_s=steps / med["ours"], hf_tokens_per_s=steps / med["hf"], ratio=med["hf"] / med["ours"],
               ours_ms_per_token=1e3 * med["ours"] / steps, hf_ms_per_token=1e3 * med["hf"] / steps,
               ours_end_to_end_s=ms.median(totals["ours"]), hf_end_to_end_s=ms.median(totals["hf"]),
               ours_decode_s=dec["ours"], hf_decode_s=dec["hf"])
    msg = (f"  decode {arch:7s} ctx {context}: ours {row['ours_tokens_per_s']:7.1f} tok/s  "
           f"hf {row['hf_tokens_per_s']:7.1f} tok/s  ratio {row['ratio']:.2f}")
    if compile:
        row.update(ours_compiled_tokens_per_s=steps / med["ours_compiled"],
                   ratio_compiled=med["hf"] / med["ours_compiled"],
                   ours_compiled_ms_per_token=1e3 * med["ours_compiled"] / steps,
                   ours_compiled_decode_s=dec["ours_compiled"])
        msg += f"  | compiled {row['ours_compiled_tokens_per_s']:7.1f} tok/s  ratio {row['ratio_compiled']:.2f}"
    log(msg)
    return [row]


def latency_rows(model, contexts, steps, log=print) -> list[dict]:
    """Per-token decode latency of `model` after each context length, the contexts' steps interleaved."""
    rows = ms.decode_latency(model, contexts, steps, seed=7)
    for r in rows:
        log(f"  latency ctx {r['context']:6d}: {r['median_ms']:.2f} ms/token (state {r['state_bytes']} bytes)")
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
    peak0 = ms.matmul_peak_gflops()
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
    peak1 = ms.matmul_peak_gflops()
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


def format_table(res: dict) -> str:
    """The --compare-hf table, plain text (the instrument's own is instrument.format_table)."""
    lines = ["training (forward+backward), tokens/s, medians of interleaved repeats"]
    lines.append(f"{'arch':8s} {'batch':>9s} {'ours':>9s} {'hf':>9s} {'ratio':>6s} {'MFU ours':>9s} {'MFU hf':>7s}")
    for r in res["train"]:
        lines.append(f"{r['arch']:8s} {str(r['batch']) + 'x' + str(r['seq_len']):>9s} "
                     f"{r['ours_tokens_per_s']:9.0f} {r['hf_tokens_per_s']:9.0f} {r['ratio']:6.2f} "
                     f"{r['ours_mfu']:9.3f} {r['hf_mfu']:7.3f}")
    lines.append("")
    lines.append("greedy decode, batch 1 (first to last new token; prefill excluded); transformers eager")
    lines.append(f"{'arch':8s} {'context':>8s} {'new':>4s} {'ours tok/s':>11s} {'hf tok/s':>9s} {'ratio':>6s} "
                 f"{'ours e2e s':>11s} {'hf e2e s':>9s} {'compiled tok/s':>15s} {'ratio':>6s}")
    for r in res["decode"]:
        comp = f"{r['ours_compiled_tokens_per_s']:15.1f} {r['ratio_compiled']:6.2f}" \
            if "ratio_compiled" in r else f"{'-':>15s} {'-':>6s}"
        lines.append(f"{r['arch']:8s} {r['context']:8d} {r['new_tokens']:4d} {r['ours_tokens_per_s']:11.1f} "
                     f"{r['hf_tokens_per_s']:9.1f} {r['ratio']:6.2f} {r['ours_end_to_end_s']:11.3f} "
                     f"{r['hf_end_to_end_s']:9.3f} {comp}")
    if res["latency"]:
        lines.append("")
        lines.append("mamba2 (ours) per-token decode latency")
        for r in res["latency"]:
            lines.append(f"  context {r['context']:6d}: {r['median_ms']:7.2f} ms/token (min {r['min_ms']:.2f}), "
                         f"state {r['state_bytes']} bytes")
    lines.append("")
    lines.append("targets")
    for k, t in res["targets"].items():
        lines.append(f"  {k:36s} {t['target']:>8s}  measured {t['measured']:6.2f}  "
                     f"{'met' if t['met'] else 'MISSED'}")
    pk = res["matmul_peak_gflops"]
    lines.append(f"matmul peak: {pk['start']:.1f} GFLOP/s at start, {pk['end']:.1f} at end")
    return "\n".join(lines)


def plot(res: dict, path: str) -> str:
    """The --compare-hf PNG: speed ratios vs transformers and our decode latency vs context. -> its path."""
    from ..plots import pyplot
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"train {r['arch']}\n{r['batch']}x{r['seq_len']}" for r in res["train"]] + \
             [f"decode {r['arch']}\nctx {r['context']}" for r in res["decode"]]
    ratios = [r["ratio"] for r in res["train"]] + [r["ratio"] for r in res["decode"]]
    axes[0].bar(range(len(ratios)), ratios, color="tab:blue")
    axes[0].axhline(1.0, color="gray", lw=1, ls="--")
    axes[0].set_xticks(range(len(ratios)), labels, fontsize=7)
    axes[0].set_ylabel("ours / transformers (higher is faster)")
    axes[0].set_title("speed ratio vs transformers")
    lat = res["latency"]
    for name in sorted({r.get("preset", "mamba2") for r in lat}):
        pts = [r for r in lat if r.get("preset", "mamba2") == name]
        axes[1].plot([r["context"] for r in pts], [r["median_ms"] for r in pts], "o-", label=name)
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("context (tokens)")
    axes[1].set_ylabel("ms per decoded token")
    axes[1].set_title("decode latency vs context")
    if lat:
        axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
