"""`hybridlm bench --presets ...`: the measuring instrument for any presets at one stated size.

Presets are compared at the same number of token-mixer layers (`--layers N`: attention, SSD, Rodimus, ... layers;
MLP/MoE letters are not counted) and either the same width (`--d-model`) or the same parameter count (`--params 10M`:
the width is sized to it, within 10%). For every training shape B×T, all presets are timed interleaved in one loop (so
ratios see the same machine load): forward+backward tokens/s and MFU against the best matmul peak of the same device
and dtype measured in the same run (at the start, before each shape and at the end; on a known GPU also against the
datasheet peak), forward tokens/s, eager and (with `--compile`) torch.compile'd; peak memory of one step in a fresh
process (`step_memory`, measure.peak_memory). Then per-token decode latency and inference-state bytes against context
length. `--device cuda --dtype bfloat16`: models are built in float32, moved to the GPU, and every step runs under
autocast (float32 master weights, as mixed-precision training).
"""
import torch

from ..errors import ConfigError
from ..models.config import ModelConfig
from . import measure as ms


def preset_config(name: str, *, layers: int, d_model: int | None, params: int | None, vocab_size: int,
                  max_seq_len: int, overrides: dict | None = None) -> ModelConfig:
    """Preset `name` with at least `layers` token-mixer layers, at width d_model or sized to `params`."""
    from ..models import presets
    from ..models.sizing import depth_for_mixers, fit_params
    base = dict(vocab_size=vocab_size, max_seq_len=max_seq_len, **(overrides or {}))

    def build(n: int, d: int) -> ModelConfig:
        return presets.get(name, n_layers=n, d_model=d, **base)
    n = depth_for_mixers(lambda k: build(k, d_model or 256), layers)
    if params:
        cfg, _ = fit_params(lambda d: build(n, d), params, range(16, 8193, 16), tolerance=0.1, what="d_model")
        return cfg
    return build(n, d_model or 256)


def device_dtype(s: dict) -> tuple[torch.device, torch.dtype]:
    """Settings' "device" (cpu | cuda | cuda:N) and "dtype" (float32 | bfloat16 | float16), checked."""
    if s.get("dtype", "float32") not in ms.DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(ms.DTYPES)}, got {s['dtype']!r}")
    try:
        device = torch.device(s.get("device", "cpu"))
    except RuntimeError:
        raise ConfigError(f"device must be cpu, cuda or cuda:N, got {s['device']!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be cpu, cuda or cuda:N, got {s['device']!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {s['device']}: CUDA is not available here (torch {torch.__version__}, "
                          f"{torch.cuda.device_count()} GPUs visible)")
    return device, ms.DTYPES[s.get("dtype", "float32")]


def _peak(device: torch.device, dtype: torch.dtype) -> float:
    """One matmul peak reading, GFLOP/s, in the dtype the steps compute in."""
    if device.type == "cuda":               # 1024³ matmuls leave an H100 partly idle and are launch-bound
        return ms.matmul_peak_gflops(4096, dtype=dtype, device=device, calls=10)
    return ms.matmul_peak_gflops(1024, dtype=dtype)


def _timed_rows(models: dict, ids: torch.Tensor, repeats: int, dtype: torch.dtype, peak: float,
                nominal: float | None, mode: str, log) -> list[dict]:
    """All models timed interleaved on ids [B, T] (on their device); `nominal`: the datasheet peak, TFLOP/s."""
    B, T = ids.shape
    rows = {}
    for variant, train in (("train", True), ("forward", False)):
        for m in models.values():
            m.train(train)
        step = ms.train_step if train else ms.forward_step
        cases = [ms.Case(n, lambda m=m: {variant: step(m, ids, dtype)}, work=B * T, unit="tokens")
                 for n, m in models.items()]
        rows.update({(r["case"], variant): r for r in ms.run_cases(cases, repeats)})
    out = []
    for n, m in models.items():
        tr, fw = rows[n, "train"], rows[n, "forward"]
        flops = ms.train_flops_per_token(getattr(m, "_orig_mod", m), T)
        out.append(dict(preset=n, mode=mode, batch=B, seq_len=T, train_tokens_per_s=tr["per_s"],
                        forward_tokens_per_s=fw["per_s"], train_mfu=tr["per_s"] * flops / (peak * 1e9),
                        forward_mfu=fw["per_s"] * flops / 3 / (peak * 1e9),
                        train_mfu_nominal=tr["per_s"] * flops / (nominal * 1e12) if nominal else None,
                        forward_mfu_nominal=fw["per_s"] * flops / 3 / (nominal * 1e12) if nominal else None,
                        flops_per_token=flops, train_times_s=tr["times_s"], forward_times_s=fw["times_s"]))
        nom = f", {out[-1]['train_mfu_nominal']:.2f} of nominal" if nominal else ""
        log(f"  {n:16s} {mode:8s} {B}x{T}: fwd+bwd {tr['per_s']:9.0f} tok/s (MFU {out[-1]['train_mfu']:.2f}{nom})"
            f"  fwd {fw['per_s']:9.0f} tok/s")
    return out


def step_memory(config: dict, batch: int, seq_len: int, step: str = "train", device: str = "cpu",
                dtype: str = "float32") -> dict:
    """Peak bytes of one step of the model `config` (measure.peak_memory; run it in a fresh process: `fresh`).
    step: "train", "train-full-logits" ([tokens, vocab] logits materialised: the unfused head + loss) or
    "forward". The warm-up is full size on CUDA (the caching allocator keeps it), 8 tokens on a CPU (one-time
    set-up with next to no memory: a full-size one would leave its freed memory resident and hide the peak)."""
    from ..models import CausalLM
    cfg = ModelConfig.from_dict(config)
    torch.manual_seed(0)
    model = CausalLM(cfg).to(device).train(step != "forward")
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=device)
    make = (lambda x: ms.forward_step(model, x, ms.DTYPES[dtype], logits_to_keep=1)) if step == "forward" else \
        (lambda x: ms.train_step(model, x, ms.DTYPES[dtype], full_logits=step == "train-full-logits"))
    make(ids if device.startswith("cuda") else ids[:1, :8])()
    r = ms.peak_memory(make(ids), device)
    return {"peak_bytes": r["peak_bytes"], "method": r["method"]}


def run_instrument(s: dict, preset_names: list[str], log=print) -> dict:
    """Settings `s`: layers, d_model, params, vocab_size, shapes, latency_contexts, latency_steps, repeats,
    compile, memory, overrides, device, dtype. -> {"configs", "train", "memory", "latency", "matmul_peak_gflops",
    "device"}."""
    from ..models.causal_lm import CausalLM
    from ..models.sizing import token_mixers
    device, dtype = device_dtype(s)
    if device.type == "cuda":           # the clock synchronises the current device
        torch.cuda.set_device(device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    nominal = ms.nominal_peak_tflops(device, dtype)
    peak = _peak(device, dtype)
    log(f"matmul peak ({s.get('dtype', 'float32')}, {where}): {peak:.1f} GFLOP/s"
        + (f"; datasheet dense peak {nominal:.0f} TFLOP/s" if nominal else ""))
    max_len = max(max(T for _, T in s["shapes"]), max(s["latency_contexts"]) + s["latency_steps"] + 8)
    out = {"configs": {}, "train": [], "memory": [], "latency": [],
           "device": {"name": where, "dtype": s.get("dtype", "float32"), "nominal_peak_tflops": nominal}}
    cfgs, models = {}, {}
    for name in preset_names:
        cfg = preset_config(name, layers=s["layers"], d_model=s.get("d_model"), params=s.get("params"),
                            vocab_size=s["vocab_size"], max_seq_len=max_len, overrides=s.get("overrides", {}).get(name))
        torch.manual_seed(0)
        cfgs[name], models[name] = cfg, CausalLM(cfg).to(device)           # float32 master weights
        out["configs"][name] = {"config": cfg.to_dict(), "parameters": models[name].num_parameters(),
                                "mixer_layers": token_mixers(cfg), "d_model": cfg.d_model}
        log(f"  {name:16s} {cfg.layout}: d_model {cfg.d_model}, {token_mixers(cfg)} mixer layers, "
            f"{models[name].num_parameters():,} parameters")
    peaks = [peak]
    for B, T in s["shapes"]:
        peaks.append(_peak(device, dtype))
        ids = torch.randint(0, s["vocab_size"], (B, T), generator=torch.Generator().manual_seed(T)).to(device)
        out["train"] += _timed_rows(models, ids, s["repeats"], dtype, peak, nominal, "eager", log)
        if s.get("compile"):
            compiled = {n: torch.compile(m, dynamic=False) for n, m in models.items()}
            out["train"] += _timed_rows(compiled, ids, s["repeats"], dtype, peak, nominal, "compiled", log)
        if s.get("memory"):
            # "train-full-logits": the same step with [tokens, vocab] logits materialised (the unfused LM head)
            for n, cfg in cfgs.items():
                for step in ("train", "train-full-logits", "forward"):
                    r = ms.fresh(step_memory, config=cfg.to_dict(), batch=B, seq_len=T, step=step,
                                 device=str(device), dtype=s.get("dtype", "float32"))
                    out["memory"].append(dict(preset=n, batch=B, seq_len=T, step=step, **r))
                    log(f"  {n:16s} {B}x{T} {step:17s} peak {r['peak_bytes'] / 2**20:9.1f} MiB")
    for n, m in models.items():
        if s.get("quantize"):             # decode only: a quantized linear has no backward
            from ..models.quantize import quantize_
            quantize_(m, s["quantize"], s.get("group_size", 64))
        for r in ms.decode_latency(m.eval(), s["latency_contexts"], s["latency_steps"], dtype=dtype):
            out["latency"].append(dict(preset=n, weights=s.get("quantize") or "float", **r))
            log(f"  {n:16s} decode after {r['context']:6d} tokens: {r['median_ms']:.2f} ms/token, "
                f"state {r['state_bytes']:,} B")
    peaks.append(_peak(device, dtype))
    for r in out["train"]:            # a loaded machine makes single peak readings low: MFU against the best one
        r["train_mfu"] *= peak / max(peaks)
        r["forward_mfu"] *= peak / max(peaks)
    out["matmul_peak_gflops"] = {"start": peak, "end": peaks[-1], "max": max(peaks), "all": peaks}
    return out


def format_table(res: dict) -> str:
    nominal = any(r.get("train_mfu_nominal") is not None for r in res["train"])   # a GPU with a datasheet peak
    lines = [f"{'preset':16s} {'mode':8s} {'shape':>8s} {'fwd+bwd tok/s':>14s} {'MFU':>5s} "
             + (f"{'nom.':>5s} " if nominal else "") + f"{'fwd tok/s':>10s} "
             f"{'peak MiB (fwd+bwd / with full logits / fwd)':>44s}"]
    mem = {(m["preset"], m["batch"], m["seq_len"], m["step"]): m["peak_bytes"] for m in res.get("memory", [])}
    for r in res["train"]:
        key = (r["preset"], r["batch"], r["seq_len"])
        pk = " / ".join(f"{mem[key + (k,)] / 2**20:.0f}" for k in ("train", "train-full-logits", "forward")) \
            if r["mode"] == "eager" and key + ("train",) in mem else "-"
        nom = f"{r['train_mfu_nominal']:5.2f} " if nominal else ""
        lines.append(f"{r['preset']:16s} {r['mode']:8s} {str(r['batch']) + 'x' + str(r['seq_len']):>8s} "
                     f"{r['train_tokens_per_s']:14.0f} {r['train_mfu']:5.2f} {nom}{r['forward_tokens_per_s']:10.0f} "
                     f"{pk:>44s}")
    lines.append("")
    lines.append(f"{'preset':16s} {'context':>8s} {'ms/token':>9s} {'state bytes':>14s}")
    for r in res["latency"]:
        lines.append(f"{r['preset']:16s} {r['context']:8d} {r['median_ms']:9.2f} {r['state_bytes']:14,d}")
    return "\n".join(lines)


def plot(res: dict, stem: str) -> list[str]:
    """Three PNGs next to the JSON: throughput vs length, decode latency vs context, state bytes vs context."""
    from ..plots import pyplot
    plt = pyplot()
    paths = []
    presets = list(res["configs"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, n in enumerate(presets):
        for mode, ls in (("eager", "-"), ("compiled", "--")):
            rows = sorted((r for r in res["train"] if r["preset"] == n and r["mode"] == mode), key=lambda r: r["seq_len"])
            if rows:
                lab = n + ("" if mode == "eager" else " (compiled)")
                axes[0].plot([r["seq_len"] for r in rows], [r["train_tokens_per_s"] for r in rows], "o" + ls,
                             color=f"C{i}", label=lab)
                axes[1].plot([r["seq_len"] for r in rows], [r["forward_tokens_per_s"] for r in rows], "o" + ls,
                             color=f"C{i}", label=lab)
    for ax, what in zip(axes, ("forward + backward", "forward")):
        _axes(ax, "sequence length (tokens)", "tokens/s", f"{what} throughput vs length")
    paths.append(_save(fig, f"{stem}_throughput.png"))
    for key, ylabel, suffix, logy in (("median_ms", "ms per decoded token", "latency", False),
                                      ("state_bytes", "inference state (bytes)", "state", True)):
        fig, ax = plt.subplots(figsize=(6, 4))
        for i, n in enumerate(presets):
            rows = [r for r in res["latency"] if r["preset"] == n]
            ax.plot([r["context"] for r in rows], [r[key] for r in rows], "o-", color=f"C{i}", label=n)
        _axes(ax, "context (tokens)", ylabel, f"{ylabel} vs context, batch 1", logy=logy)
        paths.append(_save(fig, f"{stem}_{suffix}.png"))
    return paths


def _axes(ax, xlabel: str, ylabel: str, title: str, logy: bool = False):
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def _save(fig, path: str) -> str:
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


FULL = dict(layers=4, d_model=256, params=None, vocab_size=8192, shapes=[(4, 512), (1, 2048), (1, 16384)],
            latency_contexts=[128, 1024, 8192], latency_steps=16, repeats=3, compile=False, memory=True)
QUICK = dict(layers=2, d_model=64, params=None, vocab_size=512, shapes=[(2, 32), (1, 64)], latency_contexts=[16, 256],
             latency_steps=4, repeats=2, compile=False, memory=False,
             overrides={"mamba2": dict(ssd_d_state=16, ssd_headdim=32)})
