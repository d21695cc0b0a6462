"""`hybridlm report`: the results page, docs/results.md, generated from the outputs of `hybridlm ablate`, `mqar`
and `bench`.

    page = render(collect("docs/results"), "docs/results.md")

Layout read under the results directory: ablate/<recipe>/ablate.json (+ curves.png), mqar/mqar.json (+ mqar.png),
bench/results.json (+ results_*.png), note.md (a paragraph under the introduction, unless --note gives one) and
gpu/gpu.json, the measured GPU step times of `hybridlm bench --suite gpu` (its `steps` part: rows {"kind": "ablate",
"recipe", "scale", "config", "ms_per_step"}, the GPU's name in env.gpu; a dry run is ignored). Every claim of the
papers the page checks gets a verdict computed from the figures: "reproduced", "not reproduced", or "not comparable at
this scale" with the reason. An unresolved ablation's GPU time is the measured ms per step of its two configurations
at the scale it needs × steps × seeds, or "GPU time not measured": never a FLOP count, since these models' steps run
at a GPU's launch latency, not its peak.
"""
import glob
import json
import math
import os

from .common import out

REPRODUCED, NOT_REPRODUCED, NOT_COMPARABLE = "reproduced", "not reproduced", "not resolvable at this scale"
MFU_TARGET, SPEEDUP_TARGET, FLAT_MAX = 0.7, 2.0, 1.2


def _load(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def collect(results_dir: str) -> dict:
    ablate = [_load(p) | {"_dir": os.path.dirname(p)} for p in sorted(glob.glob(os.path.join(results_dir, "ablate",
                                                                                              "*", "ablate.json")))]
    mqar = _load(os.path.join(results_dir, "mqar", "mqar.json"))
    extra = {os.path.basename(os.path.dirname(p)): _load(p) | {"_dir": os.path.dirname(p)}
             for p in sorted(glob.glob(os.path.join(results_dir, "mqar-*", "mqar.json")))}
    bench = _load(os.path.join(results_dir, "bench", "results.json"))
    gpu = _load(os.path.join(results_dir, "gpu", "gpu.json"))
    note = os.path.join(results_dir, "note.md")
    note = open(note).read().strip() if os.path.exists(note) else ""
    return {"dir": results_dir, "ablate": ablate, "mqar": mqar, "mqar_extra": extra, "bench": bench,
            "gpu": gpu_step_times(gpu), "note": note}


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


_ATTN, _SSD, _ROD = "attention", ("mamba2-n16", "mamba2-n64"), ("rodimus-n16", "rodimus-n64")


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
        add("attention is near-perfect (>= 0.95 at every d_model >= 64)", "004_f196d22cc7fe6dbe.txt figure 8; "
            "000_4348bfb066d62081.txt figure 5", [r for r in big or att if r["accuracy"] < 0.95],
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
        add("SSD accuracy rises with state size (d_model, and N 16 → 64)", "004_f196d22cc7fe6dbe.txt figure 8",
            fails, "; ".join(parts))
    pairs = [(r, s) for n in _ROD for r in by.get(n, []) for s in ssd
             if (s["d_model"], s["seq_len"]) == (r["d_model"], r["seq_len"])
             and abs(s["state_bytes"] / r["state_bytes"] - 1) <= 0.25]
    if pairs:
        lose = [(r, s) for r, s in pairs if r["accuracy"] < s["accuracy"] - tol]
        add("Rodimus at least as good as Mamba-2 at equal state bytes", "001_53f5bc9ef3e67888.txt MQAR (appendix E), "
            "figure 1b", [r for r, _ in lose], f"{len(pairs) - len(lose)} of {len(pairs)} equal-state pairs; " + "; ".join(
                f"{r['name']} {r['accuracy']:.2f} vs {s['name']} {s['accuracy']:.2f} (d {r['d_model']}, T {r['seq_len']})"
                for r, s in (lose or pairs)[:4]))
    from .mqar import _family, state_size_points
    for (d, T), pts in state_size_points(rows).items():
        rod = sorted((r for r in pts if _family(r["name"])[0] == "rodimus"), key=lambda r: r["state_bytes"])
        m2 = [r for r in pts if _family(r["name"])[0] == "mamba2"]
        pairs = [(r, min(m2, key=lambda s: abs(math.log(s["state_bytes"] / r["state_bytes"])))) for r in rod]
        pairs = [(r, s) for r, s in pairs if abs(s["state_bytes"] / r["state_bytes"] - 1) <= 0.25]
        if pairs:
            add(f"Rodimus at least as accurate as Mamba-2 at equal state bytes (figure 1b: n "
                f"{'/'.join(str(_family(r['name'])[1]) for r in rod)} against N "
                f"{'/'.join(str(_family(s['name'])[1]) for s in sorted(m2, key=lambda s: s['state_bytes']))}, "
                f"d {d}, T {T})", "001_53f5bc9ef3e67888.txt figure 1b",
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
                "000_4348bfb066d62081.txt figure 5", [i for (i, _), a in cmp if i["accuracy"] < a["accuracy"] - tol],
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
                                source="004_f196d22cc7fe6dbe.txt section 9; 001_53f5bc9ef3e67888.txt",
                                verdict="met" if ratio >= SPEEDUP_TARGET else "not met",
                                here=f"{ratio:.2f}× ({r['train_tokens_per_s']:,.0f} vs {b['train_tokens_per_s']:,.0f} "
                                     f"tokens/s, {mode})"))
    for name in bench.get("configs", {}):
        lat = sorted((r for r in bench.get("latency", []) if r["preset"] == name), key=lambda r: r["context"])
        if len(lat) >= 2 and lat[0]["state_bytes"] == lat[-1]["state_bytes"]:      # constant state: linear time
            ratio = lat[-1]["median_ms"] / lat[0]["median_ms"]
            out.append(dict(claim=f"{name} decode latency flat in context (constant state)",
                            source="004_f196d22cc7fe6dbe.txt; 001_53f5bc9ef3e67888.txt",
                            verdict="met" if ratio <= FLAT_MAX else "not met",
                            here=f"{lat[-1]['median_ms']:.2f} / {lat[0]['median_ms']:.2f} ms = {ratio:.2f}× from "
                                 f"context {lat[0]['context']} to {lat[-1]['context']}"))
    return out


# --- rendering -----------------------------------------------------------------------------------------------
def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
           ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def _rel(path: str, page_dir: str) -> str:
    return os.path.relpath(path, page_dir).replace(os.sep, "/")


def _load_line(loads: list, cores) -> str:
    """'load average 1.9-2.1 on 2 cores (quiet: ...)' from load averages read as runs ended ('' if none)."""
    loads = [x for x in loads if x is not None]
    if not loads or not cores:
        return ""
    lo, hi = min(loads), max(loads)
    state = "quiet: every process had a core" if hi <= cores + 0.5 else "loaded: processes shared cores, so wall times are inflated"
    return f"; load average {lo:.1f}" + (f"-{hi:.1f}" if hi - lo >= 0.1 else "") + f" on {cores} cores ({state})"


def _meta_line(meta: dict, loads: list | None = None) -> str:
    return (f"{meta.get('machine', '?')} ({meta.get('processor') or 'cpu'}), {meta.get('cpu_count', '?')} cores, "
            f"{meta.get('threads', '?')} torch threads; python {meta.get('python', '?')}, torch {meta.get('torch', '?')}"
            + (f", hybridlm {meta['hybridlm']}" if meta.get("hybridlm") else "")
            + _load_line(loads if loads is not None else [meta.get("load_avg")], meta.get("cpu_count")))


def _pm(mean: float, sd: float | None) -> str:
    return f"{mean:.4f}" + (f" ± {sd:.4f}" if sd is not None else "")


def _mqar_section(mq: dict, out_dir: str, page_dir: str, main: bool) -> list[str]:
    """One sweep: its protocol, per-length tables (mean over seeds, min..max) and plots."""
    st, meta = mq["meta"].get("settings", {}), mq["meta"]
    trials = meta.get("trials", [])
    L = [] if main else [f"### {os.path.basename(out_dir)}", ""]
    cmds = meta.get("commands") or [meta.get("command", "")]
    shown = 6                                    # a merged sweep has one command per point: the rest are in the json
    L += [f"Command{'s' * (len(cmds) > 1)}: " + ", ".join(f"`{c}`" for c in cmds[:shown])
          + (f" and {len(cmds) - shown} more (meta.commands of mqar.json)" if len(cmds) > shown else "") + "  ",
          f"Machine: {_meta_line(meta, [t.get('load_avg') for t in trials if _on_cpu(t)])}."]
    gpu = [t for t in trials if not _on_cpu(t)]
    if gpu:
        names = sorted({t["device"].removeprefix("cuda (").removesuffix(")") for t in gpu})
        L += ["", f"{len(gpu)} of the {len(trials)} runs ran on a GPU ({', '.join(names)}; `--device cuda`, same "
              "protocol, float32; several sweeps shared the GPU at once, so their wall times are not step times); "
              "the `devices` column says where each row's runs ran."]
    L.append("")
    if not main and "target" in st:                     # a study: which settings reached the target, which did not
        done = [r for r in mq["rows"] if r["accuracy"] >= st["target"]]
        miss = [r for r in mq["rows"] if r["accuracy"] < st["target"]]
        L += ["Reached " + str(st["target"]) + ": " + (", ".join(f"{r['name']} (d {r['d_model']}, T {r['seq_len']}, "
                                                               f"{r['steps']:,} steps)" for r in done) or "none")
              + ". Did not: " + (", ".join(f"{r['name']} {r['accuracy']:.3f}" + "↑" * bool(r.get("rising"))
                                           for r in miss) or "none") + ".", ""]
    if "target" in st:
        L += [f"Protocol (zoology's): vocab {st['vocab_size']}, {st['pairs']} key-value pairs, {st['layers']} layers of "
              f"mixer + gated MLP, a fixed set of {st['train_examples']:,} training examples, batch {st['batch_size']}, "
              f"{st['optimizer']}, weight decay {st['weight_decay']}, {st['schedule']} (budget {st['steps']:,} steps, "
              f"held-out accuracy on {st['test_examples']:,} examples every {st['eval_every']} steps, stop at "
              f"{st['target']}), lrs {st['lr']} tried in order (the rest skipped once one reaches the target, and smaller "
              f"ones after a run still rising when its budget ends, since they learn slower), seeds "
              f"{sorted({t['seed'] for t in trials if 'seed' in t}) or st['seeds']}. Accuracy is the mean over seeds "
              f"of each seed's best lr; `steps` is the first seed's steps to stop. {len(trials)} runs, "
              f"{sum(t.get('wall_s', 0) for t in trials if _on_cpu(t)) / 3600:.1f} CPU-hours (one thread each)"
              + (f" and {sum(t.get('wall_s', 0) for t in gpu) / 3600:.1f} GPU-process-hours" if gpu else "") + ".",
              ""]
    pending = pending_rows(mq)
    for T in sorted({r["seq_len"] for r in mq["rows"]}):
        rows = [r for r in mq["rows"] if r["seq_len"] == T]
        L += [f"T = {T}, {rows[0]['num_pairs']} pairs:", ""]
        L += _table(["name", "layout", "d_model", "accuracy", "seeds min..max", "params", "state bytes", "lr", "steps"]
                    + ["devices"] * bool(gpu),
                    [[r["name"], f"`{r['layout']}`", r["d_model"], f"{r['accuracy']:.3f}",
                      f"{r.get('accuracy_min', r['accuracy']):.3f}..{r.get('accuracy_max', r['accuracy']):.3f}",
                      f"{r['params']:,}", f"{r['state_bytes']:,}" if r.get("state_bytes") else "-", f"{r['lr']:g}",
                      f"{r['steps']:,}" + (" ↑" if r.get("rising") else "") + (" *" if pending(r) else "")]
                     + [", ".join(d.split(" (")[0] for d in r.get("devices") or ["cpu"])] * bool(gpu)
                     for r in rows])
        L.append("")
    if any(r.get("rising") for r in mq["rows"]):
        L += ["↑: still gaining at the end of the budget (more than 0.02 over its last quarter): the budget, not the "
              "model, set that figure.", ""]
    if any(pending(r) for r in mq["rows"]):
        L += ["*: below the target and not rising, but the protocol's next lr has not run yet (the sweep was "
              "interrupted; rerunning its command runs it): the figure may still rise.", ""]
    for png, what in (("mqar.png", "accuracy against d_model"), ("mqar-state.png", "accuracy against state bytes"),
                      ("mqar-families.png", "accuracy against state bytes, Rodimus against Mamba-2 (Rodimus figure 1b)"),
                      ("mqar-curves.png", "held-out accuracy against steps")):
        if os.path.exists(os.path.join(out_dir, png)):
            L += [f"![MQAR {what}]({_rel(os.path.join(out_dir, png), page_dir)})", ""]
    return L


def _on_cpu(trial: dict) -> bool:
    return trial.get("device", "cpu") == "cpu"


def cpu_hours(res: dict) -> dict:
    """CPU-hours behind each part of the page: MQAR runs and ablation runs (every seed) from their wall times (MQAR
    runs made on a GPU are not CPU-hours: `gpu_runs` counts them)."""
    mq = [res["mqar"]] * bool(res.get("mqar")) + list(res.get("mqar_extra", {}).values())
    return {"MQAR": sum(t.get("wall_s", 0) for m in mq for t in m["meta"].get("trials", []) if _on_cpu(t)) / 3600,
            "ablations": sum(r["wall_s"] * len(r.get("seeds") or [0]) for a in res["ablate"] for r in a["rows"]) / 3600}


def render(res: dict, page: str, *, margin: float = 0.02, note: str = "") -> str:
    page_dir = os.path.dirname(os.path.abspath(page))
    L = ["# Results", "",
         f"Generated by `hybridlm report --results {res['dir']} --out {page}` from the outputs of `hybridlm ablate`, "
         "`hybridlm mqar` and `hybridlm bench`; do not edit by hand. Everything here is CPU-sized: small analogues of "
         "the papers' experiments, meant to show the instrument and the direction of each effect, not the papers' "
         "figures. The same commands take `--scale` (ablate) or larger sizes (bench, mqar) on a GPU.", ""]
    note = note or res.get("note", "")
    if note:
        L += [note, ""]
    hours = cpu_hours(res)
    gpu_runs = [t for m in [res["mqar"]] * bool(res.get("mqar")) + list(res.get("mqar_extra", {}).values())
                for t in m["meta"].get("trials", []) if not _on_cpu(t)]
    if any(hours.values()):
        L += ["**Cost of this evidence** (sum of the runs' wall times, one torch thread each; `bash "
              "scripts/evidence.sh` reruns it, part by part and resumably): " + ", ".join(
                  f"{k} {v:.1f} h" for k, v in hours.items() if v) + f"; {sum(hours.values()):.1f} CPU-hours in all"
              + (f", and {len(gpu_runs)} MQAR runs on a GPU ({sum(t.get('wall_s', 0) for t in gpu_runs) / 3600:.1f} "
                 "hours of wall time over processes sharing it)" if gpu_runs else "") + ".", ""]
    claims = []
    for a in res["ablate"]:
        rows = {r["name"]: r for r in a["rows"]}
        for c in a.get("claims", []):
            label = c["text"] + (" *(the paper's pairing: several things differ)*" if c.get("pairing") == "paper" else "")
            for at in ([None, c["at"]] if c.get("at") else [None]):
                verdict, here = ablation_verdict(dict(c, at=at), rows, margin, a, res.get("gpu"))
                claims.append(dict(claim=label + (f" — at {at} tokens" if at else ""), source=a["source"],
                                   paper=c.get("paper", ""), here=here, verdict=verdict))
    if res["mqar"]:
        claims += mqar_claims(res["mqar"], extra=list(res.get("mqar_extra", {}).values()))
    if res["bench"] and res["bench"].get("mode") == "ours":
        claims += bench_claims(res["bench"])
    L += ["## The papers' claims, checked", "",
          "Ablation verdicts compare validation loss (nats/token, mean over seeds): a claim is reproduced when the "
          "better configuration is lower by more than the noise margin, not reproduced when it is higher by more "
          "than that, and not resolvable at this scale otherwise. The margin is measured: twice the larger seed "
          f"standard deviation of the two configurations (a single-seed recipe falls back to an assumed {margin} "
          "nats and says so). An unresolved claim names the `--scale` run that would resolve it, assuming the seed "
          "spread falls as 1/√tokens, and its cost. A claim marked as the paper's pairing compares the paper's two "
          "designs, which differ in several things; the isolated pairing beside it changes only what the claim "
          "names (tests/test_ablate.py holds every recipe to the fields its claims list). MQAR verdicts treat 0.02 "
          "accuracy as noise.", ""]
    L += _table(["claim", "source", "paper", "here", "verdict"],
                [[c["claim"], c["source"].split(",")[0], c.get("paper", ""), c["here"], f"**{c['verdict']}**"]
                 for c in claims])
    L += ["", "## Ablations (`hybridlm ablate`)", ""]
    from ..train.recipes import list_recipes
    missing = {n: t for n, t in list_recipes().items() if n not in {a["recipe"] for a in res["ablate"]}}
    if missing:
        L += ["Recipes without results here (run them with the command shown): "] + \
             [f"- {t}: `hybridlm ablate {n} --out {res['dir']}/ablate/{n}`" for n, t in missing.items()] + [""]
    for a in res["ablate"]:
        m, b = a["meta"], a["meta"]["budget"]
        wall = max(r["wall_s"] for r in a["rows"]) / 60
        L += [f"### {a['title']}", "", f"Source: {a['source']}. Recipe `{a['recipe']}`"
              + (f" ({a['meta'].get('recipe_path')})" if a["meta"].get("recipe_path") else "") + ".", ""]
        if a["meta"].get("note"):
            L += [a["meta"]["note"], ""]
        sized = (f"; every model sized by {b['size_by']} to {b['params']:,} {'active ' if b.get('active') else ''}"
                 f"parameters (±{b['tolerance']:.0%})") if b.get("params") else "; same width for every model"
        L += [f"Budget: {b['steps']} steps × {b['batch_size']}×{b['seq_len']} tokens "
              f"({b['steps'] * b['batch_size'] * b['seq_len'] / 1e6:.2g}M per model), lr {b['lr']}, seeds "
              f"{b['seeds']}, built-in corpus (Python sources, byte tokenizer, {b['max_bytes']:,} bytes){sized}. "
              f"Validation on {a['rows'][0]['val_tokens']:,} tokens"
              f"{' (the whole validation split)' if not b.get('eval_tokens') else ''}. Stated time "
              f"{m.get('minutes_per_model', '?')} min per model on 2 cores; the slowest took {wall:.1f} min here.", "",
              f"Command: `{m.get('command', '')}`  ", f"Machine: {_meta_line(m)}, {m.get('time', '')}.", ""]
        lens = sorted({n for r in a["rows"] for n in r.get("val_loss_at", {})}, key=int)
        L += _table(["configuration", "layout", "d_model", "params", "active params", "val loss (mean ± s.d.)",
                     "per seed", *[f"val loss at {n}" for n in lens], "tokens/s", "wall s per seed"],
                    [[r["name"], f"`{r['layout']}`", r["d_model"], f"{r['params']:,}", f"{r.get('active_params', 0):,}",
                      _pm(r["val_loss"], r.get("val_loss_std")),
                      " / ".join(f"{v:.3f}" for v in r.get("val_losses", [])),
                      *[_pm(r["val_loss_at"][n], (r.get("val_loss_at_std") or {}).get(n)) for n in lens],
                      f"{r['tokens_per_s']:,.0f}", f"{r['wall_s']:.0f}"] for r in a["rows"]])
        png = os.path.join(a["_dir"], "curves.png")
        if os.path.exists(png):
            L += ["", f"![loss curves]({_rel(png, page_dir)})"]
        L.append("")
    L += ["## MQAR (`hybridlm mqar`)", ""]
    mq = res["mqar"]
    if not mq:
        L += ["No MQAR results yet: `hybridlm mqar --out docs/results/mqar`.", ""]
    for name, m in [("mqar", mq)] * bool(mq) + sorted(res.get("mqar_extra", {}).items()):
        L += _mqar_section(m, os.path.join(res["dir"], name), page_dir, main=name == "mqar")
    L += ["## Efficiency (`hybridlm bench`)", ""]
    bn = res["bench"]
    if not bn or bn.get("mode") != "ours":
        L += ["No instrument results yet: `hybridlm bench --presets transformer++,mamba2,rodimus --out "
              "docs/results/bench/results.json`.", ""]
    else:
        L += [f"Command: `{bn['meta'].get('command', '')}`  ", f"Machine: {_meta_line(bn['meta'])}; fp32 matmul peak "
              f"{bn['matmul_peak_gflops']['start']:.1f} GFLOP/s at the start, {bn['matmul_peak_gflops']['end']:.1f} "
              "at the end of the run. Training rows are medians of repeats interleaved across presets.", ""]
        L += _table(["preset", "layout", "d_model", "mixer layers", "params"],
                    [[n, f"`{c['config']['layout']}`", c["d_model"], c["mixer_layers"], f"{c['parameters']:,}"]
                     for n, c in bn["configs"].items()])
        mem = {(m["preset"], m["batch"], m["seq_len"], m["step"]): m["peak_bytes"] for m in bn.get("memory", [])}
        best = max(v for k, v in bn["matmul_peak_gflops"].items() if k != "all")
        L += ["", f"MFU below is against the best matmul peak of the run ({best:.1f} GFLOP/s)."]
        L += [""] + _table(["preset", "mode", "shape", "fwd+bwd tokens/s", "MFU", "fwd tokens/s", "peak MiB fwd+bwd",
                            "… with full logits", "peak MiB prefill"],
                           [[r["preset"], r["mode"], f"{r['batch']}×{r['seq_len']}", f"{r['train_tokens_per_s']:,.0f}",
                             f"{r['train_tokens_per_s'] * r['flops_per_token'] / (best * 1e9):.2f}",
                             f"{r['forward_tokens_per_s']:,.0f}",
                             *[f"{mem[k] / 2**20:,.0f}" if k in mem and r["mode"] == "eager" else "-"
                               for k in ((r["preset"], r["batch"], r["seq_len"], "train"),
                                         (r["preset"], r["batch"], r["seq_len"], "train-full-logits"),
                                         (r["preset"], r["batch"], r["seq_len"], "forward"))]]
                            for r in bn["train"]])
        L += [""] + _table(["preset", "context", "ms/token", "state bytes"],
                           [[r["preset"], r["context"], f"{r['median_ms']:.2f}", f"{r['state_bytes']:,}"]
                            for r in bn["latency"]])
        L.append("")
        for p in bn.get("plots", []):
            if os.path.exists(p) or os.path.exists(os.path.join(res["dir"], "bench", os.path.basename(p))):
                L.append(f"![{os.path.basename(p)}]({_rel(os.path.join(res['dir'], 'bench', os.path.basename(p)), page_dir)})")
        L.append("")
    return "\n".join(L)


# --- the command ----------------------------------------------------------------------------------------------
def main(args) -> int:
    from ..errors import InputError
    if not os.path.isdir(args.results):
        raise InputError(f"results directory {args.results} does not exist (run ablate/mqar/bench with --out under it)")
    text = render(collect(args.results), args.out, margin=args.margin, note=args.note)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, args.out)
    out(f"wrote {args.out}")
    return 0


def add_arguments(p):
    p.add_argument("--results", default="docs/results",
                   help="directory holding ablate/<recipe>/ablate.json, mqar/mqar.json, bench/results.json")
    p.add_argument("--out", default="docs/results.md", help="the page to write (default docs/results.md)")
    p.add_argument("--margin", type=float, default=0.02,
                   help="validation-loss difference (nats) below which an ablation claim is 'not comparable'")
    p.add_argument("--note", default="", help="a paragraph placed under the page's introduction (e.g. the machine's load)")
