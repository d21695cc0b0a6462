"""The results page: docs/results.md generated from the outputs of `hybridlm ablate`, `mqar` and `bench`.

    page = render(collect("docs/results"), "docs/results.md")

Layout read under the results directory: ablate/<recipe>/ablate.json (+ curves.png), mqar/mqar.json (+ mqar.png),
bench/results.json (+ results_*.png). Every claim of the papers the page checks gets a verdict computed from the
figures: "reproduced", "not reproduced", or "not comparable at this scale" with the reason.
"""
import glob
import json
import os

REPRODUCED, NOT_REPRODUCED, NOT_COMPARABLE = "reproduced", "not reproduced", "not comparable at this scale"
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
    bench = _load(os.path.join(results_dir, "bench", "results.json"))
    return {"dir": results_dir, "ablate": ablate, "mqar": mqar, "bench": bench}


# --- verdicts ------------------------------------------------------------------------------------------------
def ablation_verdict(claim: dict, rows: dict, margin: float) -> tuple[str, str]:
    """-> (verdict, our figures). `better` must have the lower validation loss by more than the noise margin
    (twice the larger seed spread when the rows have several seeds, else `margin`)."""
    b, w = rows[claim["better"]], rows[claim["worse"]]
    spread = max(b.get("val_loss_std") or 0.0, w.get("val_loss_std") or 0.0)
    noise = max(margin, 2 * spread)
    diff = w["val_loss"] - b["val_loss"]
    here = f"{b['val_loss']:.3f} vs {w['val_loss']:.3f} (Δ {diff:+.3f})"
    if diff > noise:
        return REPRODUCED, here
    if diff < -noise:
        return NOT_REPRODUCED, here
    return NOT_COMPARABLE, here + f": within the noise margin ±{noise:.3f} nats at this size and budget"


def _mixers(layout: str) -> set[str]:
    return set(layout) & set("ASRFWLI")


def mqar_claims(mqar: dict) -> list[dict]:
    """The four MQAR claims of issue 11 checked on mqar.json rows (grouped by layout's token mixer)."""
    rows = mqar["rows"]
    kind = {r["name"]: ("attention" if _mixers(r["layout"]) == {"A"} else "ssd" if _mixers(r["layout"]) == {"S"}
                        else "rodimus" if _mixers(r["layout"]) == {"R"} else "inner" if _mixers(r["layout"]) == {"F"}
                        else "other") for r in rows}
    out = []
    att = [r for r in rows if kind[r["name"]] == "attention"]
    if att:
        worst = min(att, key=lambda r: r["accuracy"])
        ok = worst["accuracy"] >= 0.9
        out.append(dict(claim="attention is near-perfect at the lengths tried", source="004_f196d22cc7fe6dbe.txt "
                        "figure 8; 000_4348bfb066d62081.txt figure 5", verdict=REPRODUCED if ok else NOT_REPRODUCED,
                        here=f"lowest attention accuracy {worst['accuracy']:.3f} (d {worst['d_model']}, "
                             f"T {worst['seq_len']})"))
    ssd = [r for r in rows if kind[r["name"]] == "ssd"]
    if ssd:
        drops = []
        for key in {(r["name"], r["seq_len"]) for r in ssd}:
            pts = sorted((r["d_model"], r["accuracy"]) for r in ssd if (r["name"], r["seq_len"]) == key)
            drops += [(key, a, b) for a, b in zip(pts, pts[1:]) if b[1] < a[1] - 0.02]
        span = ", ".join(f"{n} T {T}: " + " → ".join(f"{a:.2f}" for _, a in sorted(
            (r["d_model"], r["accuracy"]) for r in ssd if (r["name"], r["seq_len"]) == (n, T)))
            for n, T in sorted({(r["name"], r["seq_len"]) for r in ssd}))
        out.append(dict(claim="SSD accuracy rises with state size (d_model)", source="004_f196d22cc7fe6dbe.txt figure 8",
                        verdict=NOT_REPRODUCED if drops else REPRODUCED, here=span))
    pairs = []
    for r in (r for r in rows if kind[r["name"]] == "rodimus"):
        same = [s for s in ssd if (s["d_model"], s["seq_len"]) == (r["d_model"], r["seq_len"]) and r["state_bytes"]
                and s["state_bytes"] and abs(s["state_bytes"] / r["state_bytes"] - 1) <= 0.25]
        pairs += [(r, s) for s in same]
    if pairs:
        lose = [(r, s) for r, s in pairs if r["accuracy"] < s["accuracy"] - 0.02]
        out.append(dict(claim="Rodimus at least as good as Mamba-2 at equal state size", source="001_53f5bc9ef3e67888.txt "
                        "MQAR (appendix E)", verdict=NOT_REPRODUCED if lose else REPRODUCED,
                        here=f"{len(pairs) - len(lose)} of {len(pairs)} equal-state pairs; " + "; ".join(
                            f"{r['name']} {r['accuracy']:.2f} vs {s['name']} {s['accuracy']:.2f} (d {r['d_model']}, "
                            f"T {r['seq_len']})" for r, s in (lose or pairs)[:4])))
    inner = [r for r in rows if kind[r["name"]] == "inner"]
    if inner and att:
        d0 = min(r["d_model"] for r in inner + att)
        cmp = [(i, a) for i in inner for a in att if i["d_model"] == a["d_model"] == d0 and i["seq_len"] == a["seq_len"]]
        if cmp:
            lose = [(i, a) for i, a in cmp if i["accuracy"] < a["accuracy"] - 0.02]
            out.append(dict(claim="inner-function attention with dynamic mask at least as good as attention at the "
                            "smallest d_model", source="000_4348bfb066d62081.txt figure 5",
                            verdict=NOT_REPRODUCED if lose else REPRODUCED,
                            here="; ".join(f"T {i['seq_len']}: {i['accuracy']:.2f} vs {a['accuracy']:.2f}" for i, a in cmp)
                            + f" (d {d0})"))
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


def _meta_line(meta: dict) -> str:
    return (f"{meta.get('machine', '?')} ({meta.get('processor') or 'cpu'}), {meta.get('cpu_count', '?')} cores, "
            f"{meta.get('threads', '?')} torch threads; python {meta.get('python', '?')}, torch {meta.get('torch', '?')}"
            + (f", hybridlm {meta['hybridlm']}" if meta.get("hybridlm") else ""))


def render(res: dict, page: str, *, margin: float = 0.02, note: str = "") -> str:
    page_dir = os.path.dirname(os.path.abspath(page))
    L = ["# Results", "",
         f"Generated by `hybridlm report --results {res['dir']} --out {page}` from the outputs of `hybridlm ablate`, "
         "`hybridlm mqar` and `hybridlm bench`; do not edit by hand. Everything here is CPU-sized: small analogues of "
         "the papers' experiments, meant to show the instrument and the direction of each effect, not the papers' "
         "figures. The same commands take `--scale` (ablate) or larger sizes (bench, mqar) on a GPU.", ""]
    if note:
        L += [note, ""]
    claims = []
    for a in res["ablate"]:
        rows = {r["name"]: r for r in a["rows"]}
        for c in a.get("claims", []):
            verdict, here = ablation_verdict(c, rows, margin)
            claims.append(dict(claim=c["text"], source=a["source"], paper=c.get("paper", ""), here=here,
                               verdict=verdict))
    if res["mqar"]:
        claims += mqar_claims(res["mqar"])
    if res["bench"] and res["bench"].get("mode") == "ours":
        claims += bench_claims(res["bench"])
    L += ["## The papers' claims, checked", "",
          f"Ablation verdicts compare validation loss (nats/token): a claim is reproduced when the better "
          f"configuration is lower by more than the noise margin ({margin} nats, or twice the seed spread when a "
          "recipe ran several seeds), not reproduced when it is higher by more than that, and not comparable at "
          "this scale otherwise. With one seed the seed-to-seed spread is not measured; at a few hundred steps it "
          "is of the same order as most differences below, so single-seed verdicts are weak evidence either way.", ""]
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
        L += [f"Budget: {b['steps']} steps × {b['batch_size']}×{b['seq_len']} tokens, lr {b['lr']}, seeds "
              f"{b['seeds']}, built-in corpus (Python sources, byte tokenizer, {b['max_bytes']:,} bytes){sized}. "
              f"Validation on {a['rows'][0]['val_tokens']:,} tokens"
              f"{' (the whole validation split)' if not b.get('eval_tokens') else ''}. Stated time "
              f"{m.get('minutes_per_model', '?')} min per model on 2 cores; the slowest took {wall:.1f} min here.", "",
              f"Command: `{m.get('command', '')}`  ", f"Machine: {_meta_line(m)}, {m.get('time', '')}.", ""]
        L += _table(["configuration", "layout", "d_model", "params", "active params", "val loss", "val ppl",
                     "tokens/s", "wall s"],
                    [[r["name"], f"`{r['layout']}`", r["d_model"], f"{r['params']:,}", f"{r.get('active_params', 0):,}",
                      f"{r['val_loss']:.4f}" + (f" ± {r['val_loss_std']:.4f}" if r.get("val_loss_std") else ""),
                      f"{r['val_ppl']:.3f}", f"{r['tokens_per_s']:,.0f}", f"{r['wall_s']:.0f}"] for r in a["rows"]])
        png = os.path.join(a["_dir"], "curves.png")
        if os.path.exists(png):
            L += ["", f"![loss curves]({_rel(png, page_dir)})"]
        L.append("")
    L += ["## MQAR (`hybridlm mqar`)", ""]
    mq = res["mqar"]
    if not mq:
        L += ["No MQAR results yet: `hybridlm mqar --out docs/results/mqar`.", ""]
    else:
        L += [f"Command: `{mq['meta'].get('command', '')}`  ", f"Machine: {_meta_line(mq['meta'])}.", ""]
        L += _table(["name", "layout", "d_model", "seq_len", "pairs", "accuracy", "params", "state bytes", "lr"],
                    [[r["name"], f"`{r['layout']}`", r["d_model"], r["seq_len"], r["num_pairs"], f"{r['accuracy']:.3f}",
                      f"{r['params']:,}", f"{r['state_bytes']:,}" if r.get("state_bytes") else "-", r["lr"]]
                     for r in mq["rows"]])
        png = os.path.join(res["dir"], "mqar", "mqar.png")
        if os.path.exists(png):
            L += ["", f"![MQAR accuracy]({_rel(png, page_dir)})"]
        L.append("")
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
