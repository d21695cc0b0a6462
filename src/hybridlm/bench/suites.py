"""The small bench suites, each a function (settings, log) -> JSON-able dict built from `measure.Case`s (op level,
preset level, ours vs transformers) timed by the one clock; registry.py declares them (and their settings).

    hybridlm bench --suite rodimus --quick --out runs/bench/rodimus.json
"""
import math

import torch
import torch.nn.functional as F

from . import measure as ms


def _model(name: str, **over):
    from ..models import CausalLM, presets
    torch.manual_seed(0)
    return CausalLM(presets.get(name, **over)).eval()


# --- op level: chunked forms against their token loops, CDMoE against a gated MLP, attention memory ----------------
def _op_inputs(T, H, K, V, kind: str, B: int = 1) -> list[torch.Tensor]:
    """Leaves for gla (q, k, v, log_decay) or delta (q, k, v, beta, log_decay; kind "delta-kda": per-channel gate)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, n, generator=g) for n in (K, K, V))
    if kind == "gla":
        decay = -F.softplus(torch.randn(B, T, H, K, generator=g) - 2)        # Rodimus-like, mostly mild
        return [x.requires_grad_() for x in (q, k * K ** -0.5, v, decay)]
    beta = torch.rand(B, T, H, generator=g)
    decay = -F.softplus(torch.randn(B, T, H, *([K] if kind == "delta-kda" else []), generator=g) - 2.0)
    return [x.requires_grad_() for x in (q, F.normalize(k, dim=-1), v, beta, decay)]


def op_case(kind: str, T: int = 2048, H: int = 4, K: int = 64, V: int = 128) -> ms.Case:
    """Forward + backward of the chunked form against the token-loop reference (gla, delta, delta-kda)."""
    if kind == "gla":
        from ..ops.gla import gla_chunked as chunked, gla_recurrent as recurrent
    else:
        from ..ops.delta_rule import delta_rule_chunked as chunked, delta_rule_recurrent as recurrent

    def build():
        x = _op_inputs(T, H, K, V, kind)
        return {"recurrent": ms.op_step(recurrent, x), "chunked": ms.op_step(chunked, x)}
    return ms.Case(f"{kind} T={T}", build, work=T, unit="tokens", info=dict(T=T, H=H, K=K, V=V))


def op_speedups(cases: list[ms.Case], repeats: int, log) -> dict:
    rows = ms.run_cases(cases, repeats)
    out = {}
    for c in cases:
        r, k = ms.pick(rows, c.name, "recurrent")["median_s"], ms.pick(rows, c.name, "chunked")["median_s"]
        out[c.name] = dict(c.info, recurrent_s=r, chunked_s=k, speedup=r / k)
        log(f"{c.name} {c.info}: recurrence {r:.3f} s, chunked {k:.3f} s -> {r / k:.1f}x")
    return {"threads": torch.get_num_threads(), "rows": rows, **out}


def gla_suite(s: dict, log=print) -> dict:
    quick = s["quick"]
    return op_speedups([op_case("gla", T=512 if quick else 2048)], 1 if quick else 3, log)


def delta_suite(s: dict, log=print) -> dict:
    quick = s["quick"]
    T = 512 if quick else 2048
    return op_speedups([op_case(k, T=T, V=64) for k in ("delta", "delta-kda")], 1 if quick else 3, log)


def cdmoe_case(d_model=256, num_experts=16384, top_k=64, shared_hidden=None, tokens=2048, breakdown=False) -> ms.Case:
    """CDMoE (Doge form) vs gated MLPs of its active parameters, forward + backward on x [tokens, d_model].
    Active: CDMoE 3·d·shared_hidden + 2·d·top_k (+ the router's 2·√N·d); "mlp" matches it without the router
    (the stricter figure), "mlp_r" with it. `breakdown`: also the layer's parts (shared MLP, routing, experts
    on fixed ids)."""
    from ..layers.cdmoe import CDMoE
    from ..layers.init import initialised
    from ..layers.mlp import MLP
    from ..ops.moe import expert_neurons
    shared_hidden = shared_hidden or 2 * d_model               # Doge's intermediate_size = 2 × hidden_size
    active = 3 * d_model * shared_hidden + 2 * d_model * top_k
    router = 2 * math.isqrt(num_experts) * d_model
    info = dict(d_model=d_model, num_experts=num_experts, top_k=top_k, tokens=tokens, shared_hidden=shared_hidden,
                active_params_cdmoe=active, router_params=router, mlp_hidden=round(active / (3 * d_model)),
                mlp_hidden_router_counted=round((active + router) / (3 * d_model)))

    def build():
        torch.manual_seed(0)
        moe = initialised(CDMoE(d_model, shared_hidden, num_experts=num_experts, top_k=top_k, form="doge"))
        for emb in (moe.down_embed, moe.up_embed):
            torch.nn.init.normal_(emb.weight, std=0.02)
        x, gy = torch.randn(1, tokens, d_model, requires_grad=True), torch.randn(1, tokens, d_model)
        xf, gyf = x.view(tokens, d_model), gy.view(tokens, d_model)
        with torch.no_grad():                                  # fixed routing for timing the experts alone
            scores, ids = moe.retrieve(xf)
            gates = torch.softmax(scores.float(), dim=-1).flatten(1).requires_grad_()
        g_gates = torch.randn_like(gates)

        def step(module, fn=None):
            def run():
                (fn or (lambda: module(x).backward(gy)))()
                for p in list(module.parameters()) + [x, gates]:
                    p.grad = None
            return run
        fns = {"cdmoe": step(moe), "mlp": step(MLP(d_model, info["mlp_hidden"])),
               "mlp_r": step(MLP(d_model, info["mlp_hidden_router_counted"]))}
        if breakdown:
            fns["shared"] = step(moe, lambda: moe.shared(xf).backward(gyf))
            fns["routing"] = step(moe, lambda: torch.softmax(moe.retrieve(xf)[0].float(), -1).flatten(1)
                                  .backward(g_gates))
            fns["experts"] = step(moe, lambda: expert_neurons(xf, moe.down_embed.weight, moe.up_embed.weight,
                                                              ids.flatten(1), gates, act=moe.act).backward(gyf))
        return fns
    return ms.Case("cdmoe", build, work=tokens, unit="tokens", info=info)


def cdmoe_vs_mlp(case: ms.Case, repeats: int) -> dict:
    rows = ms.run_cases([case], repeats)
    c, m, mr = (ms.pick(rows, case.name, v)["per_s"] for v in ("cdmoe", "mlp", "mlp_r"))
    return dict(case.info, cdmoe_tokens_per_s=c, mlp_tokens_per_s=m, mlp_router_counted_tokens_per_s=mr, ratio=c / m,
                ratio_router_counted=c / mr, target=0.5, met=c / m >= 0.5, threads=torch.get_num_threads(),
                **{f"{r['variant']}_ms": 1e3 * r["median_s"] for r in rows})


def moe_suite(s: dict, log=print) -> dict:
    """The CDMoE layer vs gated MLPs with its time broken into parts (on a shared machine, compare on a quiet one:
    the layer runs ~100 small ops to the MLP's ~15, so multi-threaded runs understate its ratio)."""
    quick = s["quick"]
    kw = dict(d_model=64, num_experts=1024, top_k=16, tokens=256) if quick else {}
    res = cdmoe_vs_mlp(cdmoe_case(breakdown=True, **kw), 2 if quick else 7)
    log("  ".join(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}" for k, v in res.items()))
    return res


def doge_vs_hf(d_model=256, n_layers=4, vocab_size=8192, batch=4, seq_len=512, num_experts=16384, top_k=64, n_heads=4,
               repeats=3) -> dict:
    """Training-step tokens/s of the doge preset's model vs transformers' DogeForCausalLM (is_moe), same weights."""
    import transformers

    from ..hf import from_transformers
    hcfg = transformers.DogeConfig(vocab_size=vocab_size, hidden_size=d_model, intermediate_size=2 * d_model,
                                   num_hidden_layers=n_layers, num_attention_heads=n_heads,
                                   max_position_embeddings=max(2048, seq_len), is_moe=True, num_experts=num_experts,
                                   num_experts_per_tok=top_k, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    hf = transformers.DogeForCausalLM(hcfg).train()
    ours = from_transformers(hf).train()
    rows = ms.run_cases(ms.train_cases({"doge": {"ours": ours, "hf": hf}}, batch, seq_len, vocab_size,
                                       seed=batch * 7919 + seq_len), repeats)
    o, h = ms.pick(rows, "doge", "ours")["per_s"], ms.pick(rows, "doge", "hf")["per_s"]
    return dict(d_model=d_model, n_layers=n_layers, vocab_size=vocab_size, batch=batch, seq_len=seq_len,
                num_experts=num_experts, top_k=top_k, n_heads=n_heads, parameters=ours.num_parameters(),
                ours_tokens_per_s=o, hf_tokens_per_s=h, ratio=o / h, attn_implementation=hf.config._attn_implementation,
                target=2.0, met=o / h >= 2.0, threads=torch.get_num_threads())


def wm_suite(s: dict, log=print) -> dict:
    """Wonderful Matrices (issue 3): CDMoE >= 0.5x a gated MLP's tokens/s; doge >= 2x transformers' Doge-MoE."""
    quick = s["quick"]
    if quick:
        cd = cdmoe_vs_mlp(cdmoe_case(d_model=64, num_experts=1024, top_k=16, tokens=256), 2)
        dg = doge_vs_hf(d_model=64, n_layers=2, vocab_size=512, batch=2, seq_len=64, num_experts=1024, top_k=16,
                        repeats=2)
    else:
        from ..models import presets
        cd, dg = cdmoe_vs_mlp(cdmoe_case(), 5), doge_vs_hf()
        width = presets.get("doge", d_model=256).mlp_hidden_size            # the doge preset's shared MLP
        cw = cdmoe_vs_mlp(cdmoe_case(shared_hidden=width), 5)
        log(f"CDMoE with the doge preset's shared width {width}: ratio {cw['ratio']:.2f} "
            f"(router counted: {cw['ratio_router_counted']:.2f})")
    log(f"CDMoE {cd['num_experts']} experts, {cd['top_k']}/token, d_model {cd['d_model']}, {cd['tokens']} tokens: "
        f"{cd['cdmoe_tokens_per_s']:.0f} tok/s vs gated MLP (hidden {cd['mlp_hidden']}, same active params) "
        f"{cd['mlp_tokens_per_s']:.0f} tok/s: ratio {cd['ratio']:.2f} "
        f"(target >= 0.5: {'met' if cd['met'] else 'MISSED'}); "
        f"router counted as active (MLP hidden {cd['mlp_hidden_router_counted']}): {cd['ratio_router_counted']:.2f}")
    log(f"doge vs transformers DogeForCausalLM (is_moe, {dg['attn_implementation']}), d_model {dg['d_model']}, "
        f"{dg['n_layers']} layers, {dg['batch']}x{dg['seq_len']}: ours {dg['ours_tokens_per_s']:.0f} tok/s, "
        f"hf {dg['hf_tokens_per_s']:.0f} tok/s: ratio {dg['ratio']:.2f} "
        f"(target >= 2: {'met' if dg['met'] else 'MISSED'})")
    return {"cdmoe_vs_mlp": cd, "doge_vs_hf": dg, **({} if quick else {"cdmoe_vs_mlp_doge_width": cw})}


def explicit_attention(q, k, v, mask):
    """nanoGPT-style causal attention materialising the [B, H, T, T] scores. q, k, v [B, T, H, D]; mask [T, T]."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    att = ((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5).masked_fill(~mask, float("-inf"))
    return (torch.softmax(att, dim=-1) @ v).transpose(1, 2)


def attention_suite(s: dict, log=print) -> dict:
    """Peak torch-tensor bytes (measure.peak_memory, what="tensors") and time of explicit softmax attention vs the
    tiled flash_attention, batch 1, fp32, causal, forward and forward+backward; flash alone at twice the length."""
    quick = s["quick"]
    from ..ops.flash import flash_attention
    T, H, D, bs = (512, 2, 32, 64) if quick else (4096, 4, 64, 128)
    torch.manual_seed(0)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    q, k, v = (torch.randn(1, T, H, D, requires_grad=True) for _ in range(3))
    ql, kl, vl = (torch.randn(1, 2 * T, H, D) for _ in range(3))

    def fn(f, backward, *x):
        def run():
            with torch.set_grad_enabled(backward):
                out = f(*x)
            if backward:
                out.backward(torch.ones_like(out))
            return out
        return run
    flash = lambda *x: flash_attention(*x, block_size=bs)
    fns = {"explicit_fwd": fn(lambda *x: explicit_attention(*x, mask), False, q, k, v),
           "flash_fwd": fn(flash, False, q, k, v), "explicit_fwdbwd": fn(lambda *x: explicit_attention(*x, mask), True,
                                                                        q, k, v),
           "flash_fwdbwd": fn(flash, True, q, k, v), "flash_long_fwd": fn(flash, False, ql, kl, vl)}
    res = dict(T=T, H=H, D=D, block_size=bs, long_T=2 * T, scores_bytes=H * T * T * 4,
               long_scores_bytes=4 * H * T * T * 4)
    for name, f in fns.items():
        res[name + "_peak"] = ms.peak_memory(f, what="tensors")["peak_bytes"]
    times = ms.clock(fns, repeats=1, warmup=0)
    res.update({name + "_s": t[0] for name, t in times.items()})
    with torch.no_grad():
        res["max_abs_diff"] = (explicit_attention(q, k, v, mask) - flash(q, k, v)).abs().max().item()
    for name in fns:
        log(f"  {name:16s} peak {res[name + '_peak'] / 2**20:9.1f} MiB  {res[name + '_s']:6.2f} s")
    log(f"one [H, T, T] score matrix at T={T}: {res['scores_bytes'] / 2**20:.1f} MiB; fwd peak ratio explicit/flash "
        f"{res['explicit_fwd_peak'] / max(1, res['flash_fwd_peak']):.1f}x; "
        f"max |explicit - flash| {res['max_abs_diff']:.2e}")
    return res


# --- preset level ----------------------------------------------------------------------------------------------------
def mla_suite(s: dict, log=print) -> dict:
    """MLA cache bytes per token (measured vs the formula) and one-token decode latency of the absorbed and expanded
    paths against a Transformer++ of the same width, after prefilling each context, all interleaved."""
    quick = s["quick"]
    from ..layers.mla import MLA
    from ..models.mixers_deepseek import mla_sizes
    d, heads, layers, contexts, steps, V = (128, 4, 2, (64, 256), 4, 257) if quick else \
        (256, 8, 4, (512, 4096), 16, 257)
    kw = dict(n_layers=layers, d_model=d, n_heads=heads, vocab_size=V, max_seq_len=max(contexts) + 2 * steps + 8)
    models = {"mla": _model("deepseek-mla", **kw), "transformer++": _model("transformer++", **kw)}
    s = mla_sizes(models["mla"].config)
    r = dict(d_model=d, n_heads=heads, n_layers=layers, **s, kv_bytes_per_token_layer=2 * d * 4,
             mla_bytes_per_token_layer=(s["kv_lora_rank"] + s["rope_dim"]) * 4)
    r["formula_ratio"] = r["kv_bytes_per_token_layer"] / r["mla_bytes_per_token_layer"]
    for name, m in models.items():                                  # measured from a real cache
        _, cache = ms.prefilled(m, 64)
        r[f"{name}_measured_bytes_per_token"] = cache.nbytes / 64

    def mode(m, value):
        for layer in m.modules():
            if isinstance(layer, MLA):
                layer.mode = value
    fns = {}
    for ctx in contexts:
        for label, name, value in (("mla absorbed", "mla", "auto"), ("mla expanded", "mla", "expanded"),
                                   ("transformer++", "transformer++", "auto")):
            mode(models[name], value)
            step, _ = ms.prefilled(models[name], ctx)
            fns[ctx, label] = lambda m=models[name], v=value, step=step: (mode(m, v), step())
    times = ms.clock(fns, steps, warmup=1)
    mode(models["mla"], "auto")
    r["decode_ms_per_token"] = [dict(context=ctx, **{lab: 1e3 * ms.median(t) for (c, lab), t in times.items()
                                                     if c == ctx}) for ctx in contexts]
    log(f"MLA cache: (kv_lora {r['kv_lora_rank']} + rope {r['rope_dim']}) x 4 B = {r['mla_bytes_per_token_layer']} "
        f"B/token/layer vs K/V 2 x {d} x 4 B = {r['kv_bytes_per_token_layer']}: {r['formula_ratio']:.2f}x smaller "
        f"(measured {r['transformer++_measured_bytes_per_token']:.0f} vs {r['mla_measured_bytes_per_token']:.0f} "
        f"B/token over {layers} layers)")
    for row in r["decode_ms_per_token"]:
        log(f"context {row['context']:>6}: decode ms/token  MLA absorbed {row['mla absorbed']:.2f}  "
            f"MLA expanded {row['mla expanded']:.2f}  transformer++ {row['transformer++']:.2f}")
    return r


def state_vs_mamba2(d_model: int = 256) -> dict:
    """Recurrent state bytes per layer (batch 1) of Rodimus at n = 64 vs Mamba-2 at d_state 128, same width
    (expand 2), and the whole slot including the short-conv tails."""
    from ..cache import InferenceCache
    from ..context import SeqContext
    from ..layers.init import initialised
    from ..layers.mamba2 import Mamba2
    from ..layers.rodimus import Rodimus
    x, ctx, out = torch.randn(1, 4, d_model), SeqContext(positions=torch.arange(4)[None]), {"d_model": d_model}
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


def rodimus_suite(s: dict, log=print) -> dict:
    """Rodimus* (issue 4): the chunked GLA op at Rodimus' shapes, state vs Mamba-2, constant cache and flat decode
    latency against context (prefill in chunks of 1024), training tokens/s vs Mamba-2 at equal parameters (6 R
    layers ~ 7 S layers at d 256)."""
    quick = s["quick"]
    T = 256 if quick else 2048
    res = {"gla_fwd_bwd": op_speedups([op_case("gla", T=T, H=1, K=64, V=512)], 2 if quick else 3, log)[f"gla T={T}"]}
    st = res["state_vs_mamba2"] = state_vs_mamba2(64 if quick else 256)
    log(f"state per layer at d {st['d_model']}: Rodimus n=64 {st['rodimus_n64']['state_bytes']} B vs Mamba-2 "
        f"d_state=128 {st['mamba2_dstate128']['state_bytes']} B -> {st['state_ratio']:.3f} (with conv tails "
        f"{st['slot_ratio']:.3f})")
    contexts, steps = ((32, 256, 1024), 8) if quick else ((128, 4096, 32768), 40)
    res["cache_latency"] = {}
    for name in ("rodimus", "rodimus++"):
        kw = dict(d_model=64, n_layers=2, swa_window=64) if quick else dict(d_model=256)
        m = _model(name, vocab_size=256, max_seq_len=max(contexts) + steps + 8, **kw)
        rows = [dict(r, cache_bytes=r.pop("state_bytes")) for r in ms.decode_latency(m, contexts, steps, warmup=4,
                                                                                     chunk=1024)]
        res["cache_latency"][name] = rows
        for r in rows:
            log(f"{name:10s} context {r['context']:>6}: cache {r['cache_bytes']:>9} B, decode {r['median_ms']:.2f} "
                f"ms/token (min {r['min_ms']:.2f})")
        log(f"{name:10s} latency ratio {contexts[-1]} / {contexts[0]}: "
            f"{rows[-1]['median_ms'] / rows[0]['median_ms']:.2f}")
    d, V, B, L, reps = (64, 512, 2, 64, 2) if quick else (256, 8192, 4, 512, 5)
    common = dict(d_model=d, vocab_size=V, max_seq_len=L)
    models = {"rodimus": _model("rodimus", n_layers=6, **common), "mamba2": _model("mamba2", n_layers=7, **common),
              "rodimus++": _model("rodimus++", n_layers=2, **common)}
    rows = ms.run_cases(ms.train_cases({n: {"train": m} for n, m in models.items()}, B, L, V), reps)
    tr = res["train_vs_mamba2"] = {"batch": B, "seq_len": L, "d_model": d, "vocab_size": V, "rows": {
        n: {"parameters": m.num_parameters(), "layout": m.config.layout,
            "tokens_per_s": ms.pick(rows, n, "train")["per_s"], "median_s": ms.pick(rows, n, "train")["median_s"]}
        for n, m in models.items()}}
    tr["mamba2_over_rodimus"] = tr["rows"]["mamba2"]["tokens_per_s"] / tr["rows"]["rodimus"]["tokens_per_s"]
    for name, r in tr["rows"].items():
        log(f"train {name:10s} {r['layout']:10s} {r['parameters'] / 1e6:6.2f}M params: {r['tokens_per_s']:8.0f} tok/s")
    log(f"mamba2 / rodimus tokens/s: {tr['mamba2_over_rodimus']:.2f}")
    return res


def decode_suite(s: dict, log=print) -> dict:
    """Decode ms/token at batch 1: the growing-cache step vs the static-shape step (`CausalLM.static_decode_step`),
    eager, and on CUDA also as a CUDA graph (torch.compile "reduce-overhead"); CUDA in bf16 when present, else CPU
    float32. Each timed call decodes `steps` tokens after an untimed prefill. Settings: presets, d_model,
    n_layers, vocab_size, context, steps, repeats."""
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    modes = ["growing", "static"] + (["static+graph"] if cuda else [])
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dtype), "settings": s,
           "threads": torch.get_num_threads(), "ms_per_token": {}}
    for name in s["presets"].split(","):
        model = _model(name, n_layers=s["n_layers"], d_model=s["d_model"], vocab_size=s["vocab_size"],
                       max_seq_len=max(2048, s["context"] + s["steps"] + 1)).to(device=device, dtype=dtype)
        steps = {m: model.decode_step if m == "growing" else model.static_decode_step(compile=m == "static+graph")
                 for m in modes}

        def setup(mode, n=s["steps"]):          # prefill (untimed) -> the timed run decodes n tokens
            def prefill():
                step, _ = ms.prefilled(model, s["context"], max_tokens=s["context"] + n + 1, step_fn=steps[mode])
                return step
            return prefill, lambda step: [step() for _ in range(n)]
        ms.clock({m: setup(m, min(8, s["steps"])) for m in modes}, repeats=0)   # warm-up (and graph capture)
        times = ms.clock({m: setup(m) for m in modes}, s["repeats"], warmup=0)
        row = out["ms_per_token"][name] = {m: 1e3 * ms.median(t) / s["steps"] for m, t in times.items()}
        log(f"{name:>14} ({model.num_parameters() / 1e6:.0f}M, context {s['context']}): "
            + "  ".join(f"{m} {v:.3f}" for m, v in row.items()) + f" ms/token on {out['device']}")
    return out


# --- ours vs transformers --------------------------------------------------------------------------------------------
def hf_suite(s: dict, log=print) -> dict:
    """Greedy decode tokens/s of transformers' generate() through HybridLMForCausalLM against our own `stream` on the
    same CausalLM, at the --compare-hf sizes; ratio = ours / wrapper (1.0: the wrapper costs nothing)."""
    from ..hf.modeling import HybridLMForCausalLM
    from .compare_hf import ARCHS, FULL, QUICK, decode_rows
    c, rows = QUICK if s["quick"] else FULL, []
    for arch, preset in ARCHS.items():
        ours = _model(preset, n_layers=c["n_layers"], d_model=c["d_model"], vocab_size=c["vocab_size"],
                      max_seq_len=c["context"] + c["new_tokens"] + 1, **(c.get("overrides") or {}).get(arch, {}))
        wrapper = HybridLMForCausalLM.from_model(ours).eval()
        for row in decode_rows(arch, wrapper, ours, c["context"], c["new_tokens"], c["decode_repeats"], compile=False,
                               log=log):
            rows.append({("wrapper" + k[2:] if k.startswith("hf_") else k): v for k, v in row.items()})
    log("ratio = ours tokens/s / wrapper tokens/s (1.0: the wrapper costs nothing)")
    return {"settings": {k: v for k, v in c.items() if k != "overrides"}, "decode": rows}


def twins_suite(s: dict, log=print) -> dict:
    """Every preset of hf.common.TWINS (or s["presets"]) against its transformers twin, training steps on the same
    weights; the result carries its markdown table (written beside the JSON)."""
    from .twins import run, to_markdown, twins
    known = twins()
    names = [n.strip() for n in s["presets"].split(",") if n.strip()] or sorted(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        from ..errors import ConfigError
        raise ConfigError(f"no transformers twin for {', '.join(unknown)} (have: {', '.join(sorted(known))})")
    res = run(names, d_model=s["d_model"], n_layers=s["n_layers"], vocab_size=s["vocab_size"], shapes=s["shapes"],
              repeats=s["repeats"], log=log)
    return dict(res, markdown=to_markdown(res))
