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
import os

from ..eval.claims import (ablation_verdict, bench_claims, cpu_hours, gpu_step_times, mqar_claims, on_cpu,
                           pending_rows)
from ..markdown import markdown_table
from .common import out


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


# --- rendering -----------------------------------------------------------------------------------------------
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
          f"Machine: {_meta_line(meta, [t.get('load_avg') for t in trials if on_cpu(t)])}."]
    gpu = [t for t in trials if not on_cpu(t)]
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
              f"{sum(t.get('wall_s', 0) for t in trials if on_cpu(t)) / 3600:.1f} CPU-hours (one thread each)"
              + (f" and {sum(t.get('wall_s', 0) for t in gpu) / 3600:.1f} GPU-process-hours" if gpu else "") + ".",
              ""]
    pending = pending_rows(mq)
    for T in sorted({r["seq_len"] for r in mq["rows"]}):
        rows = [r for r in mq["rows"] if r["seq_len"] == T]
        L += [f"T = {T}, {rows[0]['num_pairs']} pairs:", ""]
        L += markdown_table(["name", "layout", "d_model", "accuracy", "seeds min..max", "params", "state bytes", "lr",
                             "steps"]
                            + ["devices"] * bool(gpu),
                            [[r["name"], f"`{r['layout']}`", r["d_model"], f"{r['accuracy']:.3f}",
                              f"{r.get('accuracy_min', r['accuracy']):.3f}..{r.get('accuracy_max', r['accuracy']):.3f}",
                              f"{r['params']:,}", f"{r['state_bytes']:,}" if r.get("state_bytes") else "-",
                              f"{r['lr']:g}",
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


def _intro(res: dict, page: str, note: str) -> list[str]:
    L = ["# Results", "",
         f"Generated by `hybridlm report --results {res['dir']} --out {page}` from the outputs of `hybridlm ablate`, "
         "`hybridlm mqar` and `hybridlm bench`; do not edit by hand. Everything here is CPU-sized: small analogues of "
         "the papers' experiments, meant to show the instrument and the direction of each effect, not the papers' "
         "figures. The same commands take `--scale` (ablate) or larger sizes (bench, mqar) on a GPU. Papers are "
         "cited by the short names of [references.md](references.md).", ""]
    note = note or res.get("note", "")
    if note:
        L += [note, ""]
    hours = cpu_hours(res)
    gpu_runs = [t for m in [res["mqar"]] * bool(res.get("mqar")) + list(res.get("mqar_extra", {}).values())
                for t in m["meta"].get("trials", []) if not on_cpu(t)]
    if any(hours.values()):
        L += ["**Cost of this evidence** (sum of the runs' wall times, one torch thread each; `bash "
              "scripts/evidence.sh` reruns it, part by part and resumably): " + ", ".join(
                  f"{k} {v:.1f} h" for k, v in hours.items() if v) + f"; {sum(hours.values()):.1f} CPU-hours in all"
              + (f", and {len(gpu_runs)} MQAR runs on a GPU ({sum(t.get('wall_s', 0) for t in gpu_runs) / 3600:.1f} "
                 "hours of wall time over processes sharing it)" if gpu_runs else "") + ".", ""]
    return L


def _claims_section(res: dict, margin: float) -> list[str]:
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
    L = ["## The papers' claims, checked", "",
         "Ablation verdicts compare validation loss (nats/token, mean over seeds): a claim is reproduced when the "
         "better configuration is lower by more than the noise margin, not reproduced when it is higher by more "
         "than that, and not resolvable at this scale otherwise. The margin is measured: twice the larger seed "
         f"standard deviation of the two configurations (a single-seed recipe falls back to an assumed {margin} "
         "nats and says so). An unresolved claim names the `--scale` run that would resolve it, assuming the seed "
         "spread falls as 1/√tokens, and its cost. A claim marked as the paper's pairing compares the paper's two "
         "designs, which differ in several things; the isolated pairing beside it changes only what the claim "
         "names (tests/test_ablate.py holds every recipe to the fields its claims list). MQAR verdicts treat 0.02 "
         "accuracy as noise.", ""]
    return L + markdown_table(["claim", "source", "paper", "here", "verdict"],
                              [[c["claim"], c["source"].split(",")[0], c.get("paper", ""), c["here"],
                                f"**{c['verdict']}**"]
                               for c in claims])


def _ablation(a: dict, page_dir: str) -> list[str]:
    m, b = a["meta"], a["meta"]["budget"]
    wall = max(r["wall_s"] for r in a["rows"]) / 60
    L = [f"### {a['title']}", "", f"Source: {a['source']}. Recipe `{a['recipe']}`"
         + (f" ({m.get('recipe_path')})" if m.get("recipe_path") else "") + ".", ""]
    if m.get("note"):
        L += [m["note"], ""]
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
    L += markdown_table(["configuration", "layout", "d_model", "params", "active params", "val loss (mean ± s.d.)",
                         "per seed", *[f"val loss at {n}" for n in lens], "tokens/s", "wall s per seed"],
                        [[r["name"], f"`{r['layout']}`", r["d_model"], f"{r['params']:,}",
                          f"{r.get('active_params', 0):,}",
                          _pm(r["val_loss"], r.get("val_loss_std")),
                          " / ".join(f"{v:.3f}" for v in r.get("val_losses", [])),
                          *[_pm(r["val_loss_at"][n], (r.get("val_loss_at_std") or {}).get(n)) for n in lens],
                          f"{r['tokens_per_s']:,.0f}", f"{r['wall_s']:.0f}"] for r in a["rows"]])
    png = os.path.join(a["_dir"], "curves.png")
    if os.path.exists(png):
        L += ["", f"![loss curves]({_rel(png, page_dir)})"]
    return L + [""]


def _ablations_section(res: dict, page_dir: str) -> list[str]:
    from ..train.recipes import list_recipes
    L = ["", "## Ablations (`hybridlm ablate`)", ""]
    missing = {n: t for n, t in list_recipes().items() if n not in {a["recipe"] for a in res["ablate"]}}
    if missing:
        L += ["Recipes without results here (run them with the command shown): "] + \
             [f"- {t}: `hybridlm ablate {n} --out {res['dir']}/ablate/{n}`" for n, t in missing.items()] + [""]
    for a in res["ablate"]:
        L += _ablation(a, page_dir)
    return L


def _bench_section(res: dict, page_dir: str) -> list[str]:
    L = ["## Efficiency (`hybridlm bench`)", ""]
    bn = res["bench"]
    if not bn or bn.get("mode") != "ours":
        return L + ["No instrument results yet: `hybridlm bench --presets transformer++,mamba2,rodimus --out "
                    "docs/results/bench/results.json`.", ""]
    L += [f"Command: `{bn['meta'].get('command', '')}`  ", f"Machine: {_meta_line(bn['meta'])}; fp32 matmul peak "
          f"{bn['matmul_peak_gflops']['start']:.1f} GFLOP/s at the start, {bn['matmul_peak_gflops']['end']:.1f} "
          "at the end of the run. Training rows are medians of repeats interleaved across presets.", ""]
    L += markdown_table(["preset", "layout", "d_model", "mixer layers", "params"],
                        [[n, f"`{c['config']['layout']}`", c["d_model"], c["mixer_layers"], f"{c['parameters']:,}"]
                         for n, c in bn["configs"].items()])
    mem = {(m["preset"], m["batch"], m["seq_len"], m["step"]): m["peak_bytes"] for m in bn.get("memory", [])}
    best = max(v for k, v in bn["matmul_peak_gflops"].items() if k != "all")
    L += ["", f"MFU below is against the best matmul peak of the run ({best:.1f} GFLOP/s)."]
    L += [""] + markdown_table(["preset", "mode", "shape", "fwd+bwd tokens/s", "MFU", "fwd tokens/s",
                                "peak MiB fwd+bwd",
                                "… with full logits", "peak MiB prefill"],
                               [[r["preset"], r["mode"], f"{r['batch']}×{r['seq_len']}",
                                 f"{r['train_tokens_per_s']:,.0f}",
                                 f"{r['train_tokens_per_s'] * r['flops_per_token'] / (best * 1e9):.2f}",
                                 f"{r['forward_tokens_per_s']:,.0f}",
                                 *[f"{mem[k] / 2**20:,.0f}" if k in mem and r["mode"] == "eager" else "-"
                                   for k in ((r["preset"], r["batch"], r["seq_len"], "train"),
                                             (r["preset"], r["batch"], r["seq_len"], "train-full-logits"),
                                             (r["preset"], r["batch"], r["seq_len"], "forward"))]]
                                for r in bn["train"]])
    L += [""] + markdown_table(["preset", "context", "ms/token", "state bytes"],
                               [[r["preset"], r["context"], f"{r['median_ms']:.2f}", f"{r['state_bytes']:,}"]
                                for r in bn["latency"]])
    L.append("")
    for p in bn.get("plots", []):
        if os.path.exists(p) or os.path.exists(os.path.join(res["dir"], "bench", os.path.basename(p))):
            L.append(f"![{os.path.basename(p)}]({_rel(os.path.join(res['dir'], 'bench', os.path.basename(p)), page_dir)})")
    return L + [""]


def render(res: dict, page: str, *, margin: float = 0.02, note: str = "") -> str:
    """The page: introduction and cost, the claims with their verdicts, then the ablations, MQAR and bench."""
    page_dir = os.path.dirname(os.path.abspath(page))
    L = _intro(res, page, note) + _claims_section(res, margin) + _ablations_section(res, page_dir)
    L += ["## MQAR (`hybridlm mqar`)", ""]
    mq = res["mqar"]
    if not mq:
        L += ["No MQAR results yet: `hybridlm mqar --out docs/results/mqar`.", ""]
    for name, m in [("mqar", mq)] * bool(mq) + sorted(res.get("mqar_extra", {}).items()):
        L += _mqar_section(m, os.path.join(res["dir"], name), page_dir, main=name == "mqar")
    return "\n".join(L + _bench_section(res, page_dir))


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
