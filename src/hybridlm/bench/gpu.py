"""`hybridlm bench --suite gpu`: every GPU claim of hybridlm measured in one command, part by part, each part
with its own time budget (a part that would overrun is cut with a note; the run goes on), results written after
every part, so a run stopped from outside still leaves what it measured.

    correctness  each Triton kernel (SSD, GLA, CDMoE) and the chunked gated delta rule against its float32 reference,
                 forward and gradients, two shapes each; decode (static step, as a CUDA graph) = full forward for
                 four preset families; one bf16 training step per family, loss and gradients finite
    kernels      forward+backward ms at batch 8, T 4096 against our PyTorch chunked form and, when `fla` imports,
                 flash-linear-attention's chunk kernels on the same inputs (mamba_ssm: when installed)
    training     tokens/s and MFU (against a bf16 8192³ matmul timed in this process) at ~125M parameters,
                 sequence 2048, bf16 autocast, eager and per-block torch.compile
    decode       ms/token at batch 1 and tokens/s at batch 64, contexts 1k and 8k, static step as a CUDA graph
    memory       peak allocated by one 16k-token training step, mamba2 vs transformer++
    steps        ms per optimizer step of the ablation recipes (scales 1, 2, 4) and the MQAR sweep's models: what
                 the results page's GPU-time estimates are computed from

`--dry-run` runs all of it on the CPU at tiny sizes with Triton's interpreter, in about a minute: the check cannot
rot while no GPU is at hand (tests/test_gpu_check.py). scripts/gpu-check.sh runs it from the source tree.

    hybridlm bench --suite gpu --out runs/gpu/gpu.json          # on a GPU machine: ~7 minutes
    hybridlm bench --suite gpu --dry-run --out /tmp/gpu.json    # anywhere
    hybridlm bench --suite gpu --parts kernels,decode           # only some parts
"""
import dataclasses
import functools
import gc
import json
import os
import time
from typing import Callable

import torch
import torch.nn.functional as F

from . import measure as ms

PARTS = ("correctness", "kernels", "training", "decode", "memory", "steps")
FAMILIES = ("transformer++", "mamba2", "rodimus++", "cheems")          # decode = forward
TRAIN_FAMILIES = ("transformer++", "mamba2", "rodimus", "rodimus++", "mamba2-attention", "cheems", "doge",
                  "qwen3-next", "kimi-linear", "deepseek-mla")

FULL = dict(
    budget_s=dict(correctness=60, kernels=100, training=110, decode=70, memory=25, steps=35),
    check=dict(ssd=[dict(b=2, T=512, h=8, p=64, n=128, g=1), dict(b=1, T=1000, h=4, p=64, n=64, g=2)],
               gla=[dict(b=2, T=512, h=4, k=128, v=128), dict(b=1, T=1000, h=2, k=64, v=256)],
               delta=[dict(b=2, T=512, h=4, k=128, v=128), dict(b=1, T=1000, h=2, k=64, v=128)],
               cdmoe=[dict(N=4096, d=512, E=4096, k=16), dict(N=1000, d=256, E=1024, k=8)],
               model=dict(d_model=256, n_layers=4, vocab_size=1024), context=200, decode=16),
    kernels=dict(b=8, T=4096, ssd=dict(h=32, p=64, n=128, g=1), gla=dict(h=16, k=128, v=128),
                 delta=dict(h=16, k=128, v=128), cdmoe=dict(d_model=1024, experts=16384, k=64), repeats=10),
    training=dict(presets=("transformer++", "mamba2", "rodimus", "mamba2-attention"), params=125_000_000, layers=12,
                  vocab_size=32000, batch=8, seq_len=2048, repeats=5, compile=True),
    decode=dict(presets=("transformer++", "mamba2", "rodimus++"), params=125_000_000, layers=12, vocab_size=32000,
                contexts=(1024, 8192), batches=(1, 64), steps=20, prefill_chunk=1024),
    memory=dict(presets=("mamba2", "transformer++"), params=125_000_000, layers=12, vocab_size=32000,
                seq_len=16384),
    steps=dict(scales=(1, 2, 4), mqar_d=(64, 256), mqar_T=128, repeats=3, mqar_batch=64),
    matmul=8192,
)
DRY = dict(
    budget_s=dict(correctness=60, kernels=30, training=40, decode=20, memory=10, steps=15),
    check=dict(ssd=[dict(b=1, T=40, h=2, p=8, n=16, g=1), dict(b=1, T=33, h=2, p=8, n=8, g=2)],
               gla=[dict(b=1, T=40, h=2, k=16, v=8), dict(b=1, T=33, h=1, k=8, v=16)],
               delta=[dict(b=1, T=40, h=2, k=16, v=8), dict(b=1, T=33, h=1, k=8, v=16)],
               cdmoe=[dict(N=16, d=16, E=64, k=4), dict(N=9, d=8, E=32, k=2)],
               model=dict(d_model=64, n_layers=2, vocab_size=128), context=24, decode=4),
    kernels=dict(b=1, T=32, ssd=dict(h=1, p=8, n=16, g=1), gla=dict(h=1, k=16, v=16), delta=dict(h=1, k=16, v=16),
                 cdmoe=dict(d_model=16, experts=64, k=4), repeats=1),
    training=dict(presets=("transformer++", "mamba2"), params=None, d_model=64, layers=2, vocab_size=256, batch=2,
                  seq_len=64, repeats=2, compile=False),      # compiling on a CPU takes minutes: the GPU run's part
    decode=dict(presets=("transformer++", "mamba2"), params=None, d_model=64, layers=2, vocab_size=256,
                contexts=(16, 48), batches=(1, 4), steps=3, prefill_chunk=16),
    memory=dict(presets=("mamba2", "transformer++"), params=None, d_model=64, layers=2, vocab_size=256, seq_len=256),
    steps=dict(scales=(1,), mqar_d=(32,), mqar_T=32, repeats=1, recipes=("rodimus-gates",), batch=2, seq_len=32,
               mqar_batch=4),
    matmul=256,
)


class Budget:
    """A part's deadline: `left()` seconds remain; `fits(s)` says whether work expected to take `s` still fits,
    and notes each item skipped for time."""

    def __init__(self, seconds: float):
        self.end, self.cut = time.monotonic() + seconds, []

    def left(self) -> float:
        return self.end - time.monotonic()

    def fits(self, what: str, expected_s: float = 0.0) -> bool:
        if self.left() > expected_s:
            return True
        self.cut.append(what)
        return False


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a - b‖ / ‖b‖ (Frobenius; FLA's test metric): one number per output, readable across scales, and not
    dominated by one element of a gradient summed over every token (dA, d dt)."""
    a, b = a.detach().float(), b.detach().float()
    den = b.norm().item()
    return (a - b).norm().item() / den if den > 0 else (a - b).norm().item()


def _grads(fn: Callable, leaves: list, seed: int = 1) -> tuple[torch.Tensor, list]:
    """fn(*leaves) -> (out, ...); out and the gradients of a fixed random functional of out."""
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in leaves]
    out = fn(*xs)
    out = out[0] if isinstance(out, tuple) else out
    g = torch.randn(out.shape, generator=torch.Generator(device=out.device).manual_seed(seed), device=out.device)
    (out.float() * g).sum().backward()
    return out.detach(), [x.grad for x in xs if x.requires_grad]


def _compare(name: str, fast: Callable, ref: Callable, leaves: list, dtype: torch.dtype, tol: float, **shape) -> dict:
    """fast (inputs in `dtype`) against ref (float32, on the same values), forward and every gradient -> a row."""
    low = [x.to(dtype) if x.is_floating_point() and x.dim() > 1 else x for x in leaves]
    yf, gf = _grads(fast, low)
    yr, gr = _grads(ref, [x.float() if x.is_floating_point() else x for x in low])
    errs = {"out": _rel_err(yf, yr), **{f"grad{i}": _rel_err(a, b) for i, (a, b) in enumerate(zip(gf, gr))}}
    worst = max(errs.values())
    return dict(check=name, dtype=str(dtype).replace("torch.", ""), **shape, max_rel_err=worst, errs=errs, tol=tol,
                ok=bool(worst <= tol))


def _no_triton(fn: Callable) -> Callable:
    """fn with the Triton dispatch off (our PyTorch ops: the reference on CUDA)."""
    from ..ops.triton import disabled

    def run(*a, **kw):
        with disabled():
            return fn(*a, **kw)
    return run


def kernel_checks(s: dict, device, budget: Budget, log) -> list[dict]:
    """Each fast op against its float32 reference: the first shape in float32, the second in bf16."""
    from ..ops.delta_rule import delta_rule_chunked, delta_rule_recurrent
    from ..ops.gla import gla_chunked
    from ..ops.moe import expert_neurons_ref
    from ..ops.ssd import ssd_chunked
    from ..ops.triton import expert_neurons_triton, gla_chunked_triton, ssd_chunked_triton
    gen = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, device=device, generator=gen)
    rows, dtypes = [], (torch.float32, torch.bfloat16)
    cases = []
    for i, c in enumerate(s["ssd"]):
        b, T, h, p, n, g = (c[k] for k in "b T h p n g".split())
        ins = [rnd(b, T, h, p), F.softplus(rnd(b, T, h) - 2), -torch.rand(h, device=device, generator=gen) * 4 - 0.5,
               rnd(b, T, g, n), rnd(b, T, g, n)]
        cases.append(("ssd triton", lambda *x: ssd_chunked_triton(*x, chunk_size=64),
                      _no_triton(lambda *x: ssd_chunked(*x, chunk_size=64)), ins, dtypes[i], c))
    for i, c in enumerate(s["gla"]):
        b, T, h, k, v = (c[key] for key in "b T h k v".split())
        ins = [rnd(b, T, h, k), rnd(b, T, h, k) * k ** -0.5, rnd(b, T, h, v), F.logsigmoid(rnd(b, T, h, k)) / 16]
        cases.append(("gla triton", lambda *x: gla_chunked_triton(*x, chunk_size=64),
                      _no_triton(lambda *x: gla_chunked(*x, chunk_size=64)), ins, dtypes[i], c))
    for i, c in enumerate(s["delta"]):
        b, T, h, k, v = (c[key] for key in "b T h k v".split())
        ins = [rnd(b, T, h, k), F.normalize(rnd(b, T, h, k), dim=-1), rnd(b, T, h, v),
               torch.rand(b, T, h, device=device, generator=gen), F.logsigmoid(rnd(b, T, h)) / 16]
        cases.append(("delta chunked (PyTorch; no Triton kernel)", lambda *x: delta_rule_chunked(*x, chunk_size=64),
                      delta_rule_recurrent, ins, dtypes[i], c))
    for i, c in enumerate(s["cdmoe"]):
        N, d, E, k = c["N"], c["d"], c["E"], c["k"]
        ins = [rnd(N, d), rnd(E, d) * d ** -0.5, rnd(E, d), torch.randint(0, E, (N, k), device=device, generator=gen),
               torch.rand(N, k, device=device, generator=gen)]
        cases.append(("cdmoe triton", expert_neurons_triton, expert_neurons_ref, ins, dtypes[i], c))
    for name, fast, ref, ins, dtype, shape in cases:
        if not budget.fits(f"{name} {shape}", 1.0):
            continue
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        try:
            r = _compare(name, fast, ref, ins, dtype, tol, **shape)
        except Exception as e:                     # noqa: BLE001 - one failing kernel must not stop the check
            r = dict(check=name, dtype=str(dtype), **shape, ok=False, error=f"{type(e).__name__}: {e}"[:300])
        rows.append(r)
        log(f"  {name:44s} {r['dtype']:8s} {'ok' if r['ok'] else 'FAILED'}  "
            f"max rel err {r.get('max_rel_err', float('nan')):.2e} (tol {tol:g}) {r.get('error', '')}")
    return rows


@functools.cache
def _config(name: str, layers: int, d_model, params, vocab_size: int):
    """Sizing to a parameter count searches widths (seconds): once per preset and size for all parts."""
    from .instrument import preset_config
    return preset_config(name, layers=layers, d_model=d_model, params=params, vocab_size=vocab_size, max_seq_len=256)


def _build(name: str, device, dtype=None, *, params=None, d_model=None, layers=2, vocab_size=256, max_seq_len=256,
           seed: int = 0):
    """Preset `name` at `layers` mixers, sized to `params` or width d_model, on device (weights in dtype)."""
    from ..models import CausalLM
    cfg = dataclasses.replace(_config(name, layers, d_model, params, vocab_size), max_seq_len=max_seq_len)
    torch.manual_seed(seed)
    return CausalLM(cfg).to(device=device, dtype=dtype or torch.float32)


def decode_checks(s: dict, device, budget: Budget, log) -> list[dict]:
    """Per family: logits of prefill + one-token static decode steps (CUDA: replayed as a CUDA graph) against the
    full forward over the same tokens, float32."""
    m, P, n = s["model"], s["context"], s["decode"]
    rows = []
    for name in FAMILIES:
        if not budget.fits(f"decode = forward {name}", 2.0):
            continue
        try:
            model = _build(name, device, d_model=m["d_model"], layers=m["n_layers"], vocab_size=m["vocab_size"],
                           max_seq_len=P + n + 8).eval()
            ids = torch.randint(0, m["vocab_size"], (2, P + n), generator=torch.Generator().manual_seed(1)).to(device)
            with torch.inference_mode():
                full = model(ids).logits
                cache = model.make_cache(2, max_tokens=P + n + 1)
                model(ids[:, :P], cache=cache, logits_to_keep=1)
                step = model.static_decode_step(graph=device.type == "cuda")
                got = torch.stack([step(ids[:, P + i:P + i + 1], cache) for i in range(n)], 1)
            err = _rel_err(got, full[:, P:])
            r = dict(check="decode = forward", preset=name, graph=device.type == "cuda", max_rel_err=err, tol=1e-3,
                     ok=bool(err <= 1e-3))
        except Exception as e:                     # noqa: BLE001
            r = dict(check="decode = forward", preset=name, ok=False, error=f"{type(e).__name__}: {e}"[:300])
        rows.append(r)
        log(f"  decode = forward {name:24s} {'ok' if r['ok'] else 'FAILED'} max rel err "
            f"{r.get('max_rel_err', float('nan')):.2e} {r.get('error', '')}")
    return rows


def train_checks(s: dict, device, budget: Budget, log) -> list[dict]:
    """One bf16-autocast training step (forward, backward, AdamW) per family: loss and every gradient finite."""
    m, rows = s["model"], []
    for name in TRAIN_FAMILIES:
        if not budget.fits(f"bf16 train step {name}", 2.0):
            continue
        try:
            model = _build(name, device, d_model=m["d_model"], layers=m["n_layers"], vocab_size=m["vocab_size"])
            ids = torch.randint(0, m["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(2)).to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            with ms.precision(device.type, torch.bfloat16):
                loss = model(ids, labels=ids).loss
            loss.backward()
            bad = [n for n, p in model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()]
            opt.step()
            ok = bool(loss.isfinite()) and not bad
            r = dict(check="bf16 train step", preset=name, loss=loss.item(), ok=ok,
                     **({"nonfinite_grads": bad[:5]} if bad else {}))
        except Exception as e:                     # noqa: BLE001
            r = dict(check="bf16 train step", preset=name, ok=False, error=f"{type(e).__name__}: {e}"[:300])
        rows.append(r)
        log(f"  bf16 train step {name:25s} {'ok' if r['ok'] else 'FAILED'} loss {r.get('loss', float('nan')):.3f} "
            f"{r.get('error', '')}")
    return rows


def part_correctness(s: dict, device, budget: Budget, log) -> dict:
    c = s["check"]
    rows = kernel_checks(c, device, budget, log) + decode_checks(c, device, budget, log) + \
        train_checks(c, device, budget, log)
    return {"rows": rows, "passed": sum(r["ok"] for r in rows), "failed": sum(not r["ok"] for r in rows)}


def part_kernels(s: dict, device, budget: Budget, log) -> dict:
    from . import kernels as kn
    k, rows = s["kernels"], []
    jobs = [("ssd", lambda: kn.bench_ssd(k["b"], k["T"], k["repeats"], log, heads=k["ssd"], device=device)),
            ("gla", lambda: kn.bench_gla(k["b"], k["T"], k["repeats"], log, heads=k["gla"], device=device)),
            ("delta", lambda: kn.bench_delta(k["b"], k["T"], k["repeats"], log, heads=k["delta"], device=device)),
            ("cdmoe", lambda: kn.bench_cdmoe(k["b"], k["T"], k["repeats"], log, sizes=k["cdmoe"], device=device))]
    for op, job in jobs:
        if budget.fits(op, 5.0):
            try:
                rows.append(job())
            except Exception as e:                 # noqa: BLE001
                rows.append({"op": op, "error": f"{type(e).__name__}: {e}"[:300]})
                log(f"  {op}: {rows[-1]['error']}")
    try:
        import fla
        fla_version = getattr(fla, "__version__", "installed")
    except ImportError:
        fla_version = None
    return {"rows": rows, "fla": fla_version, "batch": k["b"], "seq_len": k["T"],
            "mamba_ssm": "not measured unless installed: a compiled CUDA extension that cannot travel as a pure wheel"}


def _sized(name: str, t: dict, device, dtype=None, max_seq_len: int = 2048, seed: int = 0):
    return _build(name, device, dtype, params=t.get("params"), d_model=t.get("d_model"), layers=t["layers"],
                  vocab_size=t["vocab_size"], max_seq_len=max_seq_len, seed=seed)


def part_training(s: dict, device, budget: Budget, log) -> dict:
    """Forward+backward tokens/s and MFU of each preset: eager for every preset first, then per-block
    torch.compile (tens of seconds of compilation each) for as many as the budget allows."""
    from ..train.parallel import _apply_block_wrappers
    t = s["training"]
    peak = ms.matmul_peak_gflops(s["matmul"], dtype=torch.bfloat16, device=device, calls=3) * 1e9
    log(f"  bf16 matmul {s['matmul']}³: {peak / 1e12:.1f} TFLOP/s")
    ids = torch.randint(0, t["vocab_size"], (t["batch"], t["seq_len"]),
                        generator=torch.Generator().manual_seed(0)).to(device)
    rows = []
    for mode in ("eager", "compiled") if t["compile"] else ("eager",):
        for name in t["presets"]:
            if not budget.fits(f"training {name} {mode}", 30.0 if mode == "compiled" else 5.0):
                continue
            model = None
            try:
                model = _sized(name, t, device, max_seq_len=t["seq_len"]).train()
                extra = {}
                if mode == "compiled":
                    _apply_block_wrappers(model, checkpointing=False, compile=True)
                    t0 = time.perf_counter()
                    ms.train_step(model, ids, torch.bfloat16)()
                    extra["compile_s"] = round(time.perf_counter() - t0, 1)
                ts = ms.clock({mode: ms.train_step(model, ids, torch.bfloat16)}, t["repeats"], warmup=1)[mode]
                tok_s = t["batch"] * t["seq_len"] / ms.median(ts)
                mfu = tok_s * ms.train_flops_per_token(model, t["seq_len"]) / peak
                rows.append(dict(preset=name, mode=mode, layout=model.config.layout, d_model=model.config.d_model,
                                 params=model.num_parameters(), tokens_per_s=tok_s, mfu=mfu,
                                 ms_per_step=1e3 * ms.median(ts), **extra))
                log(f"  {name:18s} {mode:8s} {rows[-1]['params'] / 1e6:6.1f}M  {tok_s:10.0f} tok/s  MFU {mfu:.3f}")
            except Exception as e:                 # noqa: BLE001
                rows.append(dict(preset=name, mode=mode, error=f"{type(e).__name__}: {e}"[:300]))
                log(f"  {name} {mode}: {rows[-1]['error']}")
            finally:
                model = None
                _free(device)
    return {"rows": rows, "matmul_peak_tflops": peak / 1e12, "batch": t["batch"], "seq_len": t["seq_len"],
            "flops": "6 x matmul parameters + causal attention scores (SSD intra-chunk work not counted: MFU is a "
                     "lower bound for the SSD presets)"}


def part_decode(s: dict, device, budget: Budget, log) -> dict:
    """Per preset (bf16 weights): the static decode step at every (batch, context), replayed as a CUDA graph on
    CUDA (eager on CPU), interleaved by the clock; at batch 1 and the first context also the eager static step.
    A preset whose graph capture fails is measured eager, with the error noted."""
    d = s["decode"]
    rows = []
    for name in d["presets"]:
        if not budget.fits(f"decode {name}", 10.0):
            continue
        graph_error = None
        for graph in ((True, False) if device.type == "cuda" else (False,)):
            model = fns = None
            try:
                model = _sized(name, d, device, torch.bfloat16, max_seq_len=max(d["contexts"]) + d["steps"] + 16).eval()
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
                _free(device)
    return {"rows": rows, "steps": d["steps"], "dtype": "bfloat16 weights"}


def part_memory(s: dict, device, budget: Budget, log) -> dict:
    """Peak memory of one training step (batch 1, bf16 autocast, float32 weights) above the resident model."""
    mm = s["memory"]
    ids = torch.randint(0, mm["vocab_size"], (1, mm["seq_len"]), generator=torch.Generator().manual_seed(0)).to(device)
    rows = []
    for name in mm["presets"]:
        if not budget.fits(f"memory {name}", 5.0):
            continue
        try:
            model = _sized(name, mm, device, max_seq_len=mm["seq_len"]).train()
            peak = ms.peak_memory(ms.train_step(model, ids, torch.bfloat16), device=device,
                                  what="resident" if device.type == "cuda" else "tensors")
            rows.append(dict(preset=name, seq_len=mm["seq_len"], params=model.num_parameters(), **peak))
            log(f"  {name:14s} {mm['seq_len']} tokens: peak {peak['peak_bytes'] / 2 ** 30:.2f} GiB above the model")
        except Exception as e:                     # noqa: BLE001
            rows.append(dict(preset=name, error=f"{type(e).__name__}: {e}"[:300]))
            log(f"  {name}: {rows[-1]['error']}")
        finally:
            model = None
            _free(device)
    return {"rows": rows}


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


def part_steps(s: dict, device, budget: Budget, log) -> dict:
    """ms per optimizer step (bf16 autocast) of each ablation recipe's configurations at each scale and of the MQAR
    sweep's default layouts: small models whose steps a GPU runs at its launch latency, not its FLOP peak."""
    from ..eval.mqar_sweep import DEFAULT_LAYOUTS, build_config, parse_layouts
    from ..models import CausalLM
    from ..train.recipes import list_recipes, load_recipe
    st, rows = s["steps"], []
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
                _free(device)
    for lname, value, over in parse_layouts(DEFAULT_LAYOUTS, 2):
        for d in st["mqar_d"]:
            if not budget.fits(f"steps mqar {lname} d{d}", 1.0):
                continue
            try:
                cfg = build_config(value, over, d_model=d, seq_len=st["mqar_T"], vocab_size=8192, layers=2)
                timed(cfg, st["mqar_batch"], st["mqar_T"], kind="mqar", layout=lname, d_model=d)
            except Exception as e:                 # noqa: BLE001
                rows.append(dict(kind="mqar", layout=lname, d_model=d, error=f"{type(e).__name__}: {e}"[:300]))
            _free(device)
    return {"rows": rows, "dtype": "bfloat16 autocast, float32 weights, AdamW"}


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


PART_FNS = {"correctness": part_correctness, "kernels": part_kernels, "training": part_training,
            "decode": part_decode, "memory": part_memory, "steps": part_steps}


# --- the run: environment, parts, targets, JSON + markdown ---------------------------------------------------------
def environment(device) -> dict:
    from ..runtime import machine_meta
    env = machine_meta()
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_memory_gib=round(p.total_memory / 2 ** 30, 1),
                   multiprocessors=p.multi_processor_count, cuda=torch.version.cuda)
    else:
        env.update(gpu=None, triton_interpret=os.environ.get("TRITON_INTERPRET"))
    return env


def targets(res: dict) -> list[dict]:
    """The issue's targets against what was measured: kernels <= 1.2x FLA's fwd+bwd time, bf16 MFU >= 0.40
    (transformer++) / 0.30 (linear-time presets) at ~125M, decode <= 2 ms/token at batch 1."""
    out = []
    for r in res.get("kernels", {}).get("rows", []):
        if "fla" in r:
            v = r["fla"].get("ours_over_this")
            out.append(dict(target=f"{r['op']} fwd+bwd <= 1.2x FLA", measured=v, met=None if v is None else v <= 1.2))
    for r in res.get("training", {}).get("rows", []):
        if "mfu" in r:
            need = 0.40 if r["preset"] == "transformer++" else 0.30
            out.append(dict(target=f"{r['preset']} {r['mode']} MFU >= {need:.2f}", measured=r["mfu"],
                            met=r["mfu"] >= need))
    for r in res.get("decode", {}).get("rows", []):
        if r.get("batch") == 1 and r.get("mode") == "graph":
            out.append(dict(target=f"{r['preset']} decode ctx {r['context']} <= 2 ms/token", measured=r["ms_per_token"],
                            met=r["ms_per_token"] <= 2.0))
    return out


def run_gpu_check(dry_run: bool = False, parts=None, log=print, write: Callable[[dict], None] | None = None,
                  time_limit: float | None = None) -> dict:
    """Every part of `parts` (default all) in order, each under its budget (scaled so that they add up to
    `time_limit` seconds when given); `write(res)` after each part."""
    parts = list(parts or PARTS)
    bad = [p for p in parts if p not in PART_FNS]
    if bad:
        from ..errors import ConfigError
        raise ConfigError(f"unknown GPU-check part(s) {', '.join(bad)}: choose from {', '.join(PARTS)}")
    s = dict(DRY if dry_run else FULL)
    if time_limit:
        total = sum(s["budget_s"][p] for p in parts)
        s["budget_s"] = {p: s["budget_s"][p] * time_limit / total for p in parts}
    cuda = torch.cuda.is_available() and not dry_run
    if not cuda and not dry_run:
        from ..errors import ConfigError
        raise ConfigError("the GPU check needs a CUDA GPU; --dry-run runs it on the CPU at tiny sizes")
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton is imported: kernels on CPU tensors
    device = torch.device("cuda" if cuda else "cpu")
    res = {"suite": "gpu", "dry_run": dry_run, "env": environment(device), "parts": {}}
    log(f"GPU check on {res['env'].get('gpu') or 'cpu (dry run, Triton interpreter)'}: {', '.join(parts)}")
    for part in parts:
        budget, t0 = Budget(s["budget_s"][part]), time.perf_counter()
        log(f"[{part}] budget {s['budget_s'][part]:.0f} s")
        try:
            out = PART_FNS[part](s, device, budget, log)
        except Exception as e:                     # noqa: BLE001 - a part that breaks is reported, the run goes on
            out = {"error": f"{type(e).__name__}: {e}"[:500]}
            log(f"  {part} failed: {out['error']}")
        out.update(wall_s=round(time.perf_counter() - t0, 1), budget_s=s["budget_s"][part],
                   cut=[f"cut for time: {c}" for c in budget.cut])
        for c in out["cut"]:
            log(f"  {c}")
        res[part] = out
        res["parts"][part] = out["wall_s"]
        res["targets"] = targets(res)
        if write:
            write(res)
        _free(device)
    return res


def _fmt(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def _table(title: str, header: list[str], rows: list[dict], cells: Callable[[dict], list]) -> list[str]:
    """A markdown section: title, header, one line per row (a row with an "error" shows it in the last column)."""
    out = ["", f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        label = r.get("check") or r.get("preset") or r.get("op") or r.get("recipe") or r.get("layout") or ""
        c = cells(r) if "error" not in r else [label] + [""] * (len(header) - 2) + [r["error"]]
        out.append("| " + " | ".join(str(x) for x in c) + " |")
    return out


def _case(r: dict) -> str:
    if r.get("preset"):
        return r["preset"]
    keys = ("b", "T", "N", "h", "p", "n", "g", "k", "v", "d", "E")
    return ", ".join(f"{k} {r[k]}" for k in keys if k in r) + f" ({r['dtype']})"


def _kernel_cells(r: dict) -> list:
    ms_ = lambda m: f"{_fmt(m.get('fwd_ms'))} / {_fmt(m.get('fwd_bwd_ms'))}" if "fwd_ms" in m else m.get("error", "-")
    heads = ", ".join(f"{x} {r[x]}" for x in ("h", "p", "n", "g", "k", "v", "d_model", "experts")
                      if x in r and not (r["op"] == "cdmoe" and x == "k"))
    if "fla" in r:
        return [r["op"], heads, ms_(r["ours"]), ms_(r["pytorch"]), ms_(r["fla"]), _fmt(r["fla"].get("ours_over_this"))]
    return [r["op"], heads, ms_(r["ours"]), ms_(r["pytorch"]), "gated MLP " + ms_(r.get("gated_mlp", {})),
            _fmt(r.get("tokens_per_s_ratio_vs_mlp")) + " (tokens/s vs gated MLP)"]


def to_markdown(res: dict) -> str:
    """The result as one markdown page: environment, then a table per part, then the targets."""
    e = res["env"]
    gpu = f" (capability {e['capability']}, {e['gpu_memory_gib']} GiB, CUDA {e['cuda']})" if e.get("gpu") else ""
    lines = [f"## GPU check{' (dry run: CPU, tiny sizes, Triton interpreter)' if res['dry_run'] else ''}", "",
             f"{e.get('gpu') or 'CPU'}{gpu}; torch {e['torch']}, triton {e.get('triton')}, Python {e['python']}; "
             f"{e['time']}.", "",
             "Part times: " + ", ".join(f"{p} {t:.0f} s" for p, t in res.get("parts", {}).items()) + "."]
    part = lambda name: (res.get(name) or {}).get("rows")
    if part("correctness"):
        lines += _table("Correctness (relative error: ‖fast − reference‖ / ‖reference‖)",
                        ["check", "case", "max rel. error", "tol", "result"], part("correctness"),
                        lambda r: [r["check"], _case(r), _fmt(r.get("max_rel_err"), ".1e"), r.get("tol", "-"),
                                   "ok" if r["ok"] else "FAILED"])
    if part("kernels"):
        k = res["kernels"]
        lines += _table(f"Kernels: forward / forward+backward ms, batch {k['batch']}, T {k['seq_len']}, bf16 "
                        f"(fla {k['fla'] or 'not installed'})",
                        ["op", "heads", "ours", "our PyTorch", "FLA", "ours / FLA (fwd+bwd)"], k["rows"], _kernel_cells)
    if part("training"):
        t = res["training"]
        lines += _table(f"Training: batch {t['batch']} x {t['seq_len']}, bf16 autocast, forward+backward (matmul "
                        f"peak {t['matmul_peak_tflops']:.0f} TFLOP/s measured)",
                        ["preset", "params", "mode", "tokens/s", "MFU"], t["rows"],
                        lambda r: [r["preset"], f"{r['params'] / 1e6:.0f}M", r["mode"], _fmt(r["tokens_per_s"], ".0f"),
                                   _fmt(r["mfu"], ".3f")])
    if part("decode"):
        lines += _table("Decode (bf16 weights, static cache)", ["preset", "batch", "context", "mode", "ms/token",
                                                                "tokens/s"], res["decode"]["rows"],
                        lambda r: [r["preset"], r["batch"], r["context"], r["mode"], _fmt(r["ms_per_token"], ".3f"),
                                   _fmt(r["tokens_per_s"], ".0f")])
    if part("memory"):
        lines += _table("Memory: one training step, batch 1, bf16 autocast", ["preset", "tokens", "peak above the model"],
                        res["memory"]["rows"],
                        lambda r: [r["preset"], r["seq_len"], f"{r['peak_bytes'] / 2 ** 30:.2f} GiB"])
    if part("steps"):
        lines += _table("Small models: ms per optimizer step", ["what", "params", "batch x T", "ms/step"],
                        res["steps"]["rows"],
                        lambda r: [f"ablate {r['recipe']} x{r['scale']} {r['config']}" if r["kind"] == "ablate" else
                                   f"mqar {r['layout']} d {r['d_model']}", f"{r['params'] / 1e6:.2f}M",
                                   f"{r['batch_size']} x {r['seq_len']}", _fmt(r["ms_per_step"])])
    if res.get("targets"):
        lines += _table("Targets", ["target", "measured", "met"], res["targets"],
                        lambda r: [r["target"], _fmt(r["measured"], ".3f"),
                                   "-" if r["met"] is None else "yes" if r["met"] else "no"])
    notes = [f"{p}: {res[p]['error']}" for p in PARTS if (res.get(p) or {}).get("error")]
    notes += [c for p in PARTS for c in (res.get(p) or {}).get("cut", [])]
    if notes:
        lines += ["", "Notes: " + "; ".join(notes) + "."]
    return "\n".join(lines) + "\n"


def write(res: dict, out: str) -> None:
    """`out` (JSON) and the markdown page beside it (.md), atomically."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    stem = os.path.splitext(out)[0]
    for path, text in ((out, json.dumps(res, indent=2, default=str)), (stem + ".md", to_markdown(res))):
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)

