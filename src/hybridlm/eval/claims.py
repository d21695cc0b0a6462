"""The verdicts of the results page: each claim of the papers checked against the figures of `hybridlm ablate`,
`mqar` and `bench`: "reproduced", "not reproduced", or "not resolvable at this scale" with the reason. An unresolved
ablation's GPU time is the measured ms per step of its two configurations at the scale it needs × steps × seeds
(from the GPU check's `steps` part), or "GPU time not measured": never a FLOP count, since these models' steps run at
a GPU's launch latency, not its peak.
"""
import math

from .mqar_sweep import _family, state_size_points

_ATTN, _SSD, _ROD = "attention", ("mamba2-n16", "mamba2-n64"), ("rodimus-n16", "rodimus-n64")


REPRODUCED, NOT_REPRODUCED, NOT_COMPARABLE = "reproduced", "not reproduced", "not resolvable at this scale"


MFU_TARGET, SPEEDUP_TARGET, FLAT_MAX = 0.7, 2.0, 1.2


def gpu_step_times(gpu: dict | None) -> dict:
    """gpu.json of `hybridlm bench --suite gpu` -> {"device": name, (recipe, scale, config): seconds per step};
    empty for none or a dry run (CPU, tiny sizes: no GPU time)."""
    if not gpu or gpu.get("dry_run"):
        return {}
    times = {(r["recipe"], int(r["scale"]), r["config"]): r["ms_per_step"] / 1e3
             for r in (gpu.get("steps") or {}).get("rows", []) if r.get("kind") == "ablate" and r.get("ms_per_step")}
    env = gpu.get("env") or {}
    return dict(times, device=env.get("gpu") or "a GPU") if times else {}


# --- verdicts ------------------------------------------------------------------------------------------------
def _at(row: dict, at) -> tuple[float, float | None]:
    if at is None:
        return row["val_loss"], row.get("val_loss_std")
    return row["val_loss_at"][str(at)], (row.get("val_loss_at_std") or {}).get(str(at))


def scale_estimate(recipe: dict, claim: dict, diff: float, noise: float, gpu: dict | None = None) -> str:
    """The `--scale K` run that would resolve a claim, assuming the seed spread falls as 1/sqrt(tokens): tokens
    must grow by (noise / effect)^2, where the effect is the paper's (`paper_delta`, nats) or ours (without one, or
    when the paper's exceeds the noise already); --scale K gives K x the tokens and K^3 x the parameters, so K^4 x
    the FLOPs (and the CPU time) of this run. Its GPU time comes from `gpu` (gpu_step_times) for the two
    configurations at scale K: steps x seeds x the measured seconds per step; without both, "not measured"."""
    effect = claim.get("paper_delta")
    if not effect or effect >= noise:   # the paper's effect would already show here: ours is smaller, size for ours
        effect = abs(diff)
    if not effect:
        return ""
    k = 1
    while k * effect ** 2 < noise ** 2 and k < 64:
        k *= 2
    rows = [r for r in recipe["rows"] if r["name"] in (claim["better"], claim["worse"])]
    steps = recipe["meta"]["budget"]["steps"]
    size = f"`hybridlm ablate {recipe['recipe']} --scale {k}`" if k < 64 else "beyond `--scale 32`"
    here = sum(r["wall_s"] * len(r.get("seeds") or [0]) for r in rows if r.get("wall_s")) * k ** 4 / 3600
    cpu = f"≈{here:.2g} CPU-hours as measured here, " if here and k < 64 else ""
    per_step = [(gpu or {}).get((recipe["recipe"], k, r["name"])) for r in rows]
    if k < 64 and len(rows) == 2 and all(per_step):
        hours = sum(s * steps * len(r.get("seeds") or [0]) for s, r in zip(per_step, rows)) / 3600
        return f"; resolving it needs {size} ({cpu}≈{hours:.2g} GPU-hours from step times measured on {gpu['device']})"
    return f"; resolving it needs {size} ({cpu}GPU time not measured)"


def ablation_verdict(claim: dict, rows: dict, margin: float, recipe: dict | None = None,
                     gpu: dict | None = None) -> tuple[str, str]:
    """-> (verdict, our figures). `better` must have the lower validation loss (at the claim's `at` length, else
    the training length) by more than the noise margin: twice the larger seed standard deviation of the two
    configurations when they ran several seeds (measured), else `margin` (assumed, and said so)."""
    at = claim.get("at")
    (bl, bs), (wl, ws) = _at(rows[claim["better"]], at), _at(rows[claim["worse"]], at)
    spreads = [v for v in (bs, ws) if v is not None]
    measured = bool(spreads)
    noise = 2 * max(spreads) if measured else margin
    diff = wl - bl
    here = f"{bl:.3f} vs {wl:.3f} (Δ {diff:+.3f}; margin {noise:.3f}, {'2 × seed s.d.' if measured else 'assumed'})"
    if diff > noise:
        return REPRODUCED, here
    if diff < -noise:
        return NOT_REPRODUCED, here
    return NOT_COMPARABLE, here + (scale_estimate(recipe, claim, diff, noise, gpu) if recipe else "")


def pending_rows(mq: dict):
    """-> row -> bool: one of its seeds ended below the target, not rising, with an lr of the protocol not run yet
    (an interrupted sweep): the figure may still rise. A seed still rising at an lr skips the smaller ones."""
    st = mq.get("meta", {}).get("settings", {})
    runs = {}
    for t in mq.get("meta", {}).get("trials", []):
        runs.setdefault((t["name"], t["d_model"], t["seq_len"], t.get("seed", 0)), []).append(t)

    def seed_pending(ts: list[dict]) -> bool:
        if max(t["accuracy"] for t in ts) >= st.get("target", 0):
            return False
        rising = max((t["lr"] for t in ts if t.get("rising")), default=0.0)
        return any(lr >= rising for lr in set(st.get("lr", [])) - {t["lr"] for t in ts})

    return lambda r: any(seed_pending(runs[k]) for k in ((r["name"], r["d_model"], r["seq_len"], s)
                                                           for s in r.get("seeds") or [0]) if k in runs)


def mqar_claims(mqar: dict, tol: float = 0.02, extra: list[dict] | None = None) -> list[dict]:
    """The papers' recall claims checked on the default sweep's rows (by their names; `tol` accuracy is noise). A
    claim that fails only through runs still rising when their budget ended (`rising`) is not resolvable at this
    budget rather than not reproduced, and so is one that fails through runs whose next lr has not run yet. `extra`:
    the other sweeps (studies); a row cut by the budget is judged on one of them with a larger budget, where one ran
    that point."""
    rows, pending = mqar["rows"], pending_rows(mqar)
    steps = mqar.get("meta", {}).get("settings", {}).get("steps", 0)
    by_key = {(r["name"], r["d_model"], r["seq_len"]): r for r in rows}
    by = {}
    for r in rows:
        by.setdefault(r["name"], []).append(r)
    out = []

    def add(claim, source, losers, here):
        """losers: the rows that fail the claim (none: reproduced)."""
        cut = bool(losers) and all(r.get("rising") or pending(r) for r in losers)
        verdict = REPRODUCED if not losers else NOT_COMPARABLE if cut else NOT_REPRODUCED
        out.append(dict(claim=claim, source=source, verdict=verdict, here=here + (
            "; the failing runs were still rising when the step budget ended (↑) or have an lr of the protocol "
            "still to run (*)" if cut else "")))

    att = by.get(_ATTN, [])
    if att:
        big = [r for r in att if r["d_model"] >= 64]
        worst = min(big or att, key=lambda r: r["accuracy"])
        add("attention is near-perfect (>= 0.95 at every d_model >= 64)", "the Mamba-2 paper figure 8; "
            "the Wonderful Matrices paper figure 5", [r for r in big or att if r["accuracy"] < 0.95],
            f"lowest {worst['accuracy']:.3f} (d {worst['d_model']}, T {worst['seq_len']}); learned positions"
            + ("" if big else "; no d_model >= 64 point yet, so the smaller widths stand in"))
    ssd = [r for n in _SSD for r in by.get(n, [])]
    if ssd:
        fails, parts = [], []
        for n, T in sorted({(r["name"], r["seq_len"]) for r in ssd}):
            pts = sorted((r for r in ssd if (r["name"], r["seq_len"]) == (n, T)), key=lambda r: r["d_model"])
            fails += [b for a, b in zip(pts, pts[1:]) if b["accuracy"] < a["accuracy"] - tol]
            parts.append(f"{n} T {T}: " + " → ".join(f"{r['accuracy']:.2f}" + "↑" * bool(r.get("rising"))
                                                     for r in pts) + " over d_model " + "/".join(str(r["d_model"]) for r in pts))
        small = {(r["d_model"], r["seq_len"]): r["accuracy"] for r in by.get(_SSD[0], [])}
        fails += [r for r in by.get(_SSD[1], []) if r["accuracy"] < small.get((r["d_model"], r["seq_len"]), 0) - tol]
        add("SSD accuracy rises with state size (d_model, and N 16 → 64)", "the Mamba-2 paper figure 8",
            fails, "; ".join(parts))
    pairs = [(r, s) for n in _ROD for r in by.get(n, []) for s in ssd
             if (s["d_model"], s["seq_len"]) == (r["d_model"], r["seq_len"])
             and abs(s["state_bytes"] / r["state_bytes"] - 1) <= 0.25]
    if pairs:
        lose = [(r, s) for r, s in pairs if r["accuracy"] < s["accuracy"] - tol]
        add("Rodimus at least as good as Mamba-2 at equal state bytes", "the Rodimus* paper MQAR (appendix E), "
            "figure 1b", [r for r, _ in lose], f"{len(pairs) - len(lose)} of {len(pairs)} equal-state pairs; " + "; ".join(
                f"{r['name']} {r['accuracy']:.2f} vs {s['name']} {s['accuracy']:.2f} (d {r['d_model']}, T {r['seq_len']})"
                for r, s in (lose or pairs)[:4]))
    for (d, T), pts in state_size_points(rows).items():
        rod = sorted((r for r in pts if _family(r["name"])[0] == "rodimus"), key=lambda r: r["state_bytes"])
        m2 = [r for r in pts if _family(r["name"])[0] == "mamba2"]
        pairs = [(r, min(m2, key=lambda s: abs(math.log(s["state_bytes"] / r["state_bytes"])))) for r in rod]
        pairs = [(r, s) for r, s in pairs if abs(s["state_bytes"] / r["state_bytes"] - 1) <= 0.25]
        if pairs:
            add(f"Rodimus at least as accurate as Mamba-2 at equal state bytes (figure 1b: n "
                f"{'/'.join(str(_family(r['name'])[1]) for r in rod)} against N "
                f"{'/'.join(str(_family(s['name'])[1]) for s in sorted(m2, key=lambda s: s['state_bytes']))}, "
                f"d {d}, T {T})", "the Rodimus* paper figure 1b",
                [r for r, s in pairs if r["accuracy"] < s["accuracy"] - tol],
                f"{sum(r['accuracy'] >= s['accuracy'] - tol for r, s in pairs)} of {len(pairs)} equal-state pairs; "
                + "; ".join(f"n {_family(r['name'])[1]} {r['accuracy']:.3f} vs N {_family(s['name'])[1]} "
                            f"{s['accuracy']:.3f}{'↑' * bool(s.get('rising'))} ({r['state_bytes'] / 1024:.0f} vs "
                            f"{s['state_bytes'] / 1024:.0f} KiB)" for r, s in pairs)
                + " (mqar-families.png)")
    inner = by.get("inner-fn-dynmask", [])
    if inner and att:
        d0 = min(r["d_model"] for r in inner + att)
        cmp = [(i, a) for i in inner for a in att if i["d_model"] == a["d_model"] == d0 and i["seq_len"] == a["seq_len"]]
        # a row cut by the budget (↑) is judged on a sweep of the same point with a larger budget, where one ran
        longer = {(r["name"], r["d_model"], r["seq_len"]): (r, m["meta"]["settings"]["steps"])
                  for m in extra or [] for r in m.get("rows", [])
                  if m.get("meta", {}).get("settings", {}).get("steps", 0) > steps}
        cmp = [(longer.get((i["name"], i["d_model"], i["seq_len"]), (i, steps)) if i.get("rising") else (i, steps), a)
               for i, a in cmp]
        if cmp:
            add("inner-function attention with dynamic mask at least as good as attention at the smallest d_model",
                "the Wonderful Matrices paper figure 5", [i for (i, _), a in cmp if i["accuracy"] < a["accuracy"] - tol],
                "; ".join(f"T {i['seq_len']}: {i['accuracy']:.3f} vs {a['accuracy']:.3f}" + (
                    f" (inner-function within a {b:,}-step budget: {i['steps']:,} steps, seeds "
                    f"{'/'.join(map(str, i.get('seeds', [])))}; {steps:,} steps leave it at "
                    f"{by_key[(i['name'], i['d_model'], i['seq_len'])]['accuracy']:.3f}↑)" if b != steps else "")
                    for (i, b), a in cmp) + f" (d {d0})")
    for name, label in (("gated-deltanet", "Gated DeltaNet"), ("kda", "KDA")):
        cmp = []
        for r in by.get(name, []):
            near = [s for s in ssd if (s["d_model"], s["seq_len"]) == (r["d_model"], r["seq_len"])]
            if near:
                cmp.append((r, min(near, key=lambda s: abs(math.log(s["state_bytes"] / r["state_bytes"])))))
        if cmp:
            add(f"{label} at least as good as Mamba-2 of the nearest state size", "Gated DeltaNet / Kimi Linear "
                "(delta rule vs SSD recall)", [r for r, s in cmp if r["accuracy"] < s["accuracy"] - tol],
                "; ".join(f"{r['accuracy']:.2f} ({r['state_bytes'] / 1024:.0f} KiB) vs {s['name']} {s['accuracy']:.2f} "
                          f"({s['state_bytes'] / 1024:.0f} KiB) at d {r['d_model']}, T {r['seq_len']}" for r, s in cmp))
    return out


def bench_claims(bench: dict) -> list[dict]:
    """MFU at 4×2048, fwd+bwd at the longest length vs transformer++, decode latency flat in context."""
    out, train = [], bench.get("train", [])
    pk = bench.get("matmul_peak_gflops", {})
    best = max(pk.get("max", 0.0), pk.get("start", 0.0), pk.get("end", 0.0))
    train = [dict(r, train_mfu=r["train_tokens_per_s"] * r["flops_per_token"] / (best * 1e9)) if best and
             "flops_per_token" in r else r for r in train]                  # MFU against the run's best peak
    readings = [v for v in (pk.get("all") or [pk.get("start"), pk.get("end")]) if v]
    unsteady = len(readings) > 1 and max(readings) > 1.5 * min(readings)   # the machine's load changed in the run
    for name in ("transformer++", "mamba2"):
        rows = [r for r in train if r["preset"] == name and (r["batch"], r["seq_len"]) == (4, 2048)]
        if rows:
            top = max(rows, key=lambda r: r["train_mfu"])
            here = f"{top['train_mfu']:.2f} ({top['mode']})"
            verdict = "met" if top["train_mfu"] >= MFU_TARGET else "not met"
            if unsteady:
                verdict = "not measurable here"
                here += (f": the matmul peak read {min(readings):.0f} to {max(readings):.0f} GFLOP/s within the run, "
                         "so the step and the peak saw different loads")
            out.append(dict(claim=f"{name} MFU at 4×2048 >= {MFU_TARGET} (fwd+bwd, against the fp32 matmul peak "
                                  f"measured in the same run)", source="issue 11 target", verdict=verdict, here=here))
    T = max((r["seq_len"] for r in train), default=0)
    base = {r["mode"]: r for r in train if r["preset"] == "transformer++" and r["seq_len"] == T and r["batch"] == 1}
    for name in ("mamba2", "rodimus"):
        for mode, b in base.items():
            r = next((r for r in train if (r["preset"], r["seq_len"], r["batch"], r["mode"]) == (name, T, 1, mode)), None)
            if r:
                ratio = r["train_tokens_per_s"] / b["train_tokens_per_s"]
                out.append(dict(claim=f"{name} fwd+bwd at 1×{T} >= {SPEEDUP_TARGET}× transformer++ of the same size",
                                source="the Mamba-2 paper section 9; the Rodimus* paper",
                                verdict="met" if ratio >= SPEEDUP_TARGET else "not met",
                                here=f"{ratio:.2f}× ({r['train_tokens_per_s']:,.0f} vs {b['train_tokens_per_s']:,.0f} "
                                     f"tokens/s, {mode})"))
    for name in bench.get("configs", {}):
        lat = sorted((r for r in bench.get("latency", []) if r["preset"] == name), key=lambda r: r["context"])
        if len(lat) >= 2 and lat[0]["state_bytes"] == lat[-1]["state_bytes"]:      # constant state: linear time
            ratio = lat[-1]["median_ms"] / lat[0]["median_ms"]
            out.append(dict(claim=f"{name} decode latency flat in context (constant state)",
                            source="the Mamba-2 paper; the Rodimus* paper",
                            verdict="met" if ratio <= FLAT_MAX else "not met",
                            here=f"{lat[-1]['median_ms']:.2f} / {lat[0]['median_ms']:.2f} ms = {ratio:.2f}× from "
                                 f"context {lat[0]['context']} to {lat[-1]['context']}"))
    return out


def on_cpu(trial: dict) -> bool:
    return trial.get("device", "cpu") == "cpu"


def cpu_hours(res: dict) -> dict:
    """CPU-hours behind each part of the page: MQAR runs and ablation runs (every seed) from their wall times (MQAR
    runs made on a GPU are not CPU-hours: `gpu_runs` counts them)."""
    mq = [res["mqar"]] * bool(res.get("mqar")) + list(res.get("mqar_extra", {}).values())
    return {"MQAR": sum(t.get("wall_s", 0) for m in mq for t in m["meta"].get("trials", []) if on_cpu(t)) / 3600,
            "ablations": sum(r["wall_s"] * len(r.get("seeds") or [0]) for a in res["ablate"] for r in a["rows"]) / 3600}
