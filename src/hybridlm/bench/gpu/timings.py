"""The GPU check's timing parts: our kernels against FLA's, training tokens/s and MFU, decode ms/token, the peak
memory of a long training step, and the ms per optimizer step of the small models the results page prices. Each
part appends its rows to out["rows"] as they are measured (the run writes its results on every row)."""
import os
import time
from importlib.metadata import PackageNotFoundError, version

import torch

from .. import measure as ms
from .common import Budget, free, sized


def part_kernels(s: dict, device, budget: Budget, log, out: dict):
    """Forward / forward+backward ms of each letter's op in its three forms: FLA's kernel (through ops/fla.py), our
    Triton kernel where we have one, our PyTorch form; one row per op (and the CDMoE experts against a gated MLP).
    Without a GPU FLA's rows are skipped, with a note (its kernels do not run under Triton's interpreter)."""
    from .. import kernels as kn
    k, rows = s["kernels"], out["rows"]
    try:
        fla_version = version("fla-core")
    except PackageNotFoundError:
        fla_version = None
    out.update(fla=fla_version, batch=k["b"], seq_len=k["T"],
               mamba_ssm="not measured unless installed: a compiled CUDA extension that cannot travel as a pure wheel")
    kn.fla_rows(device, "kernel", out.setdefault("notes", []), log)
    ops = {"ssd": lambda: kn.bench_ssd(k["b"], k["T"], k["repeats"], log, heads=k["ssd"], device=device),
           "gla": lambda: kn.bench_gla(k["b"], k["T"], k["repeats"], log, heads=k["gla"], device=device),
           "delta": lambda: kn.bench_delta(k["b"], k["T"], k["repeats"], log, heads=k["delta"], device=device),
           "kda": lambda: kn.bench_delta(k["b"], k["T"], k["repeats"], log, heads=k["delta"], device=device,
                                         per_channel=True),
           "cdmoe": lambda: kn.bench_cdmoe(k["b"], k["T"], k["repeats"], log, sizes=k["cdmoe"], device=device)}
    for op in k["ops"]:
        if budget.fits(op, 5.0):
            try:
                rows.append(ops[op]())
            except Exception as e:                 # noqa: BLE001
                rows.append({"op": op, "error": f"{type(e).__name__}: {e}"[:300]})
                log(f"  {op}: {rows[-1]['error']}")


def _force_fla(device, out: dict, log):
    """Where FLA does not trust the Triton in use (Hopper, Triton < 3.7.1: its gated backward is miscompiled, FLA
    #640) the models would not run it: for the timing, lift FLA's guard and force its dispatch (HYBRIDLM_FLA=force,
    for the rest of this process), with a note. The times are what FLA costs once Triton is fixed; its gradients there
    are wrong (the correctness part shows it)."""
    from ...ops import fla
    from .. import kernels as kn
    if device.type != "cuda" or not fla.available() or fla.trusted(device.index or 0):
        return
    if kn.fla_hopper_guard_off():
        os.environ.setdefault("HYBRIDLM_FLA", "force")
        out.setdefault("notes", []).append("training: FLA forced where it refuses this Triton (" + kn.FLA_GUARD_NOTE
                                           + ")")
        log("  FLA forced for the timing (Hopper with Triton < 3.7.1, FLA #640)")


def part_training(s: dict, device, budget: Budget, log, out: dict):
    """Forward+backward tokens/s, its ratio to transformer++'s at the same length and mode, and MFU (FLOPs counted per
    letter: bench/measure.train_flops_per_token) of each preset at each sequence length: eager for every length
    first, then per-block torch.compile (tens of seconds of compilation each) as far as the budget allows."""
    from ...train.parallel import apply_block_wrappers
    t = s["training"]
    peak = ms.matmul_peak_gflops(s["matmul"], dtype=torch.bfloat16, device=device, calls=3) * 1e9
    log(f"  bf16 matmul {s['matmul']}³: {peak / 1e12:.1f} TFLOP/s")
    out.update(matmul_peak_tflops=peak / 1e12, batch=t["batch"], seq_lens=list(t["seq_lens"]),
               flops="6 x matmul parameters + causal attention scores + 3 x the linear mixers' chunked recurrence "
                     "(per letter, ops/flops.py)")
    rows, base = out["rows"], {}
    _force_fla(device, out, log)
    for mode in ("eager", "compiled") if t["compile"] else ("eager",):
        for T in t["seq_lens"]:
            gen = torch.Generator().manual_seed(0)
            ids = torch.randint(0, t["vocab_size"], (t["batch"], T), generator=gen).to(device)
            for name in t["presets"]:
                if not budget.fits(f"training {name} {mode} T {T}", 30.0 if mode == "compiled" else 5.0):
                    continue
                model = None
                try:
                    model = sized(name, t, device, max_seq_len=T).train()
                    extra = {}
                    if mode == "compiled":
                        apply_block_wrappers(model, checkpointing=False, compile=True)
                    # the first step compiles (torch.compile) and autotunes (FLA's Triton kernels: 2-16 s a kernel,
                    # over 100 s for a delta-rule preset's first step on an H200): reported, outside the timing
                    t0 = time.perf_counter()
                    ms.train_step(model, ids, torch.bfloat16)()
                    extra["first_step_s"] = round(time.perf_counter() - t0, 1)
                    ts = ms.clock({mode: ms.train_step(model, ids, torch.bfloat16)}, t["repeats"], warmup=1)[mode]
                    tok_s = t["batch"] * T / ms.median(ts)
                    flops = ms.train_flops_per_token(model, T)
                    if name == "transformer++":
                        base[mode, T] = tok_s
                    rows.append(dict(preset=name, mode=mode, seq_len=T, layout=model.config.layout,
                                     d_model=model.config.d_model, params=model.num_parameters(), tokens_per_s=tok_s,
                                     vs_transformer=tok_s / base[mode, T] if (mode, T) in base else None,
                                     mfu=tok_s * flops / peak, flops_per_token=flops, ms_per_step=1e3 * ms.median(ts),
                                     **extra))
                    r = rows[-1]
                    rel = "" if r["vs_transformer"] is None else f"{r['vs_transformer']:.2f}x transformer++"
                    log(f"  {name:18s} {mode:8s} T {T:5d} {r['params'] / 1e6:6.1f}M {tok_s:10.0f} tok/s {rel:20s} "
                        f"MFU {r['mfu']:.3f}")
                except Exception as e:             # noqa: BLE001
                    rows.append(dict(preset=name, mode=mode, seq_len=T, error=f"{type(e).__name__}: {e}"[:300]))
                    log(f"  {name} {mode} T {T}: {rows[-1]['error']}")
                finally:
                    model = None
                    free(device)


def part_decode(s: dict, device, budget: Budget, log, out: dict):
    """Per preset (bf16 weights): the static decode step at every (batch, context), replayed as a CUDA graph on
    CUDA (eager on CPU), interleaved by the clock; at batch 1 and the first context also the eager static step.
    A preset whose graph capture fails is measured eager, with the error noted."""
    d, rows = s["decode"], out["rows"]
    out.update(steps=d["steps"], dtype="bfloat16 weights")
    for name in d["presets"]:
        if not budget.fits(f"decode {name}", 10.0):
            continue
        graph_error = None
        for graph in ((True, False) if device.type == "cuda" else (False,)):
            model = fns = None
            try:
                model = sized(name, d, device, torch.bfloat16, max_seq_len=max(d["contexts"]) + d["steps"] + 16).eval()
                fns = {}
                for b in d["batches"]:
                    for ctx in d["contexts"]:
                        first = b == d["batches"][0] and ctx == d["contexts"][0]
                        for mode in (("graph", "eager") if graph and first else ("graph" if graph else "eager",)):
                            step_fn = model.static_decode_step(graph=mode == "graph")
                            fns[b, ctx, mode] = ms.prefilled(model, ctx, batch=b, chunk=d["prefill_chunk"],
                                                             max_tokens=ctx + d["steps"] + 8, step_fn=step_fn)[0]
                times = ms.clock(fns, d["steps"], warmup=2)
                for (b, ctx, mode), ts in times.items():
                    ms_tok = 1e3 * ms.median(ts)
                    rows.append(dict(preset=name, batch=b, context=ctx, mode=mode, ms_per_token=ms_tok,
                                     tokens_per_s=b / ms.median(ts), params=model.num_parameters(),
                                     **({"graph_error": graph_error} if graph_error else {})))
                    log(f"  {name:14s} batch {b:3d} context {ctx:6d} {mode:5s} {ms_tok:8.3f} ms/token "
                        f"{rows[-1]['tokens_per_s']:10.0f} tok/s")
                break
            except Exception as e:                 # noqa: BLE001
                err = f"{type(e).__name__}: {e}"[:300]
                log(f"  {name} ({'graph' if graph else 'eager'}): {err}")
                if not graph:
                    rows.append(dict(preset=name, error=err))
                graph_error = err
            finally:
                model = fns = None
                free(device)


def part_memory(s: dict, device, budget: Budget, log, out: dict):
    """Peak memory of one training step (batch 1, bf16 autocast, float32 weights) above the resident model."""
    mm = s["memory"]
    ids = torch.randint(0, mm["vocab_size"], (1, mm["seq_len"]), generator=torch.Generator().manual_seed(0)).to(device)
    rows = out["rows"]
    for name in mm["presets"]:
        if not budget.fits(f"memory {name}", 5.0):
            continue
        try:
            model = sized(name, mm, device, max_seq_len=mm["seq_len"]).train()
            peak = ms.peak_memory(ms.train_step(model, ids, torch.bfloat16), device=device,
                                  what="resident" if device.type == "cuda" else "tensors")
            rows.append(dict(preset=name, seq_len=mm["seq_len"], params=model.num_parameters(), **peak))
            log(f"  {name:14s} {mm['seq_len']} tokens: peak {peak['peak_bytes'] / 2 ** 30:.2f} GiB above the model")
        except Exception as e:                     # noqa: BLE001
            rows.append(dict(preset=name, error=f"{type(e).__name__}: {e}"[:300]))
            log(f"  {name}: {rows[-1]['error']}")
        finally:
            model = None
            free(device)


def _opt_step(model, ids, dtype):
    """One optimizer step: forward, backward, AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        with ms.precision(ids.device.type, dtype):
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def part_steps(s: dict, device, budget: Budget, log, out: dict):
    """ms per optimizer step (bf16 autocast) of each ablation recipe's configurations at each scale and of the MQAR
    sweep's default layouts: small models whose steps a GPU runs at its launch latency, not its FLOP peak."""
    from ...eval.mqar_sweep import DEFAULT_LAYOUTS, build_config, parse_layouts
    from ...models import CausalLM
    from ...train.recipes import list_recipes, load_recipe
    st, rows = s["steps"], out["rows"]
    out["dtype"] = "bfloat16 autocast, float32 weights, AdamW"
    dtype = torch.bfloat16

    def timed(cfg, batch: int, seq_len: int, **info):
        torch.manual_seed(0)
        model = CausalLM(cfg).to(device).train()
        ids = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0)).to(device)
        t = ms.clock({"step": _opt_step(model, ids, dtype)}, st["repeats"], warmup=min(2, st["repeats"]))["step"]
        rows.append(dict(info, params=model.num_parameters(), batch_size=batch, seq_len=seq_len,
                         ms_per_step=1e3 * ms.median(t)))
        log(f"  {' '.join(str(v) for v in info.values()):48s} {rows[-1]['params'] / 1e6:7.2f}M "
            f"{rows[-1]['ms_per_step']:8.2f} ms/step")
    recipes = {name: load_recipe(name) for name in st.get("recipes") or list_recipes()}
    for k in st["scales"]:                      # every recipe at scale 1 first: what a cut loses is the largest
        for name, recipe0 in recipes.items():
            recipe = recipe0.scaled(k)
            b = recipe.budget
            for c in recipe.configs:
                if not budget.fits(f"steps {name} x{k} {c.name}", 1.0):
                    continue
                try:
                    cfg, _ = recipe.model_config(c, vocab_size=256)
                    timed(cfg, st.get("batch", b["batch_size"]), st.get("seq_len", b["seq_len"]), kind="ablate",
                          recipe=name, scale=k, config=c.name)
                except Exception as e:             # noqa: BLE001
                    rows.append(dict(kind="ablate", recipe=name, scale=k, config=c.name,
                                     error=f"{type(e).__name__}: {e}"[:300]))
                free(device)
    for lname, value, over in parse_layouts(DEFAULT_LAYOUTS, 2):
        for d in st["mqar_d"]:
            if not budget.fits(f"steps mqar {lname} d{d}", 1.0):
                continue
            try:
                cfg = build_config(value, over, d_model=d, seq_len=st["mqar_T"], vocab_size=8192, layers=2)
                timed(cfg, st["mqar_batch"], st["mqar_T"], kind="mqar", layout=lname, d_model=d)
            except Exception as e:                 # noqa: BLE001
                rows.append(dict(kind="mqar", layout=lname, d_model=d, error=f"{type(e).__name__}: {e}"[:300]))
            free(device)
