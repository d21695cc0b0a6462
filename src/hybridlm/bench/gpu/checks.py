"""The GPU check's correctness part: each Triton kernel and the chunked delta rule against its float32 reference
(forward and gradients), decode (static step, CUDA graph on a GPU) = full forward per family, one bf16 training step
per family with finite loss and gradients. Each check appends one row (ok, relative error, tolerance)."""
from typing import Callable

import torch
import torch.nn.functional as F

from .. import measure as ms
from .common import FAMILIES, TRAIN_FAMILIES, Budget, build


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
    from ...ops.triton import disabled

    def run(*a, **kw):
        with disabled():
            return fn(*a, **kw)
    return run


def kernel_checks(s: dict, device, budget: Budget, log, rows: list, notes: list):
    """Each fast op against its float32 reference: the first shape in float32, the second in bf16. FLA's kernels
    (through ops/fla.py's adapters) beside ours when FLA can run here; otherwise a note says why not."""
    from .. import kernels as kn
    from ...ops import fla
    from ...ops.delta_rule import delta_rule_chunked, delta_rule_recurrent
    from ...ops.gla import gla_chunked
    from ...ops.moe import expert_neurons_ref
    from ...ops.ssd import ssd_chunked
    from ...ops.triton import expert_neurons_triton, gla_chunked_triton, ssd_chunked_triton
    gen = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, device=device, generator=gen)
    dtypes = (torch.float32, torch.bfloat16)
    cases = []
    skip = kn.fla_rows(device, "correctness", notes, log)
    for i, c in enumerate(s["ssd"]):
        b, T, h, p, n, g = (c[k] for k in "b T h p n g".split())
        ins = [rnd(b, T, h, p), F.softplus(rnd(b, T, h) - 2), -torch.rand(h, device=device, generator=gen) * 4 - 0.5,
               rnd(b, T, g, n), rnd(b, T, g, n)]
        ref = _no_triton(lambda *x: ssd_chunked(*x, chunk_size=64))
        cases.append(("ssd triton", lambda *x: ssd_chunked_triton(*x, chunk_size=64), ref, ins, dtypes[i], c))
        if not skip:
            cases.append(("ssd fla (chunk_simple_gla)", fla.ssd_fla, ref, ins, dtypes[i], c))
    for i, c in enumerate(s["gla"]):
        b, T, h, k, v = (c[key] for key in "b T h k v".split())
        ins = [rnd(b, T, h, k), rnd(b, T, h, k) * k ** -0.5, rnd(b, T, h, v), F.logsigmoid(rnd(b, T, h, k)) / 16]
        ref = _no_triton(lambda *x: gla_chunked(*x, chunk_size=64))
        cases.append(("gla triton", lambda *x: gla_chunked_triton(*x, chunk_size=64), ref, ins, dtypes[i], c))
        if not skip:
            cases.append(("gla fla (chunk_gla)", fla.gla_fla, ref, ins, dtypes[i], c))
    for i, c in enumerate(s["delta"]):
        b, T, h, k, v = (c[key] for key in "b T h k v".split())
        for gate, name in (((), "chunk_gated_delta_rule"), ((k,), "chunk_kda")):
            ins = [rnd(b, T, h, k), F.normalize(rnd(b, T, h, k), dim=-1), rnd(b, T, h, v),
                   torch.rand(b, T, h, device=device, generator=gen), F.logsigmoid(rnd(b, T, h, *gate)) / 16]
            what = "kda" if gate else "delta"
            cases.append((f"{what} chunked (PyTorch; no Triton kernel)",
                          _no_triton(lambda *x: delta_rule_chunked(*x, chunk_size=64)), delta_rule_recurrent, ins,
                          dtypes[i], c))
            if not skip:
                cases.append((f"{what} fla ({name})", fla.delta_rule_fla, delta_rule_recurrent, ins, dtypes[i], c))
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


def decode_checks(s: dict, device, budget: Budget, log, rows: list):
    """Per family: logits of prefill + one-token static decode steps (CUDA: replayed as a CUDA graph) against the
    full forward over the same tokens, float32."""
    m, P, n = s["model"], s["context"], s["decode"]
    for name in FAMILIES:
        if not budget.fits(f"decode = forward {name}", 2.0):
            continue
        try:
            model = build(name, device, d_model=m["d_model"], layers=m["n_layers"], vocab_size=m["vocab_size"],
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


def train_checks(s: dict, device, budget: Budget, log, rows: list):
    """One bf16-autocast training step (forward, backward, AdamW) per family: loss and every gradient finite."""
    m = s["model"]
    for name in TRAIN_FAMILIES:
        if not budget.fits(f"bf16 train step {name}", 2.0):
            continue
        try:
            model = build(name, device, d_model=m["d_model"], layers=m["n_layers"], vocab_size=m["vocab_size"])
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


def part_correctness(s: dict, device, budget: Budget, log, out: dict):
    """Kernels, decode = forward and bf16 training steps; out["rows"] gets one row per check."""
    c, rows = s["check"], out["rows"]
    kernel_checks(c, device, budget, log, rows, out.setdefault("notes", []))
    for checks in (decode_checks, train_checks):
        checks(c, device, budget, log, rows)
    out.update(passed=sum(r["ok"] for r in rows), failed=sum(not r["ok"] for r in rows))
