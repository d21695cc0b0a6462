"""`hybridlm mqar`: multi-query associative recall accuracy over a sweep of layouts, d_model and sequence length.

The protocol is zoology's (eval/mqar.py): per point, a fresh 2-layer model trained on a fixed set of 100k examples
(too many to memorise) with AdamW (weight decay on matrices only), warmup + cosine over a large step budget, early
stopping once held-out accuracy reaches 0.99, and a learning-rate sweep keeping the best (lrs run in the given
order; once one reaches the target the rest are skipped, as they cannot do better, and once a run is still rising
at the end of its budget the smaller lrs are skipped: they learn slower still, so only a run that plateaued or
collapsed below the target gets a smaller lr). Why: recall is a phase change after
thousands of steps, so a short budget reports 1/pairs for every architecture; early stopping makes the large budget
cheap where recall is easy. Attention rows say their position encoding: `attention` (and `inner-fn-dynmask`) use
zoology's learned absolute positions, the baseline every MQAR paper draws; `attention-rope` is the library's
default RoPE. The recurrent mixers get no position embedding (their recurrence orders tokens), as in zoology. The curriculum is for `--hard` (the
Mamba-2 / Wonderful Matrices variant), off by default.

Output under --out: mqar.json ({"meta", "rows"}; meta.trials holds every run with its accuracy-against-steps curve),
mqar.csv (the rows: per point the best lr of each seed, accuracy = mean over seeds), mqar.png (accuracy against
d_model), mqar-state.png (accuracy against recurrent-state bytes) and, where a sweep holds Rodimus and Mamba-2 at
several state sizes, mqar-families.png (Rodimus figure 1b: accuracy against state bytes, one line per family).
mqar.json is rewritten after every run, and a rerun with the same protocol into the same --out skips the runs it
already holds: an interrupted sweep resumes. `--merge DIR...` adds the runs of sweeps written elsewhere (another
machine, a GPU) to --out without training; every run records the device it ran on.

A layout spec is NAME=VALUE[:FIELD=JSON...]: VALUE is a preset name, a layout string, or one token-mixer letter X,
which becomes zoology's mixer + MLP stack `(XM)*LAYERS`; FIELD=JSON sets any ModelConfig field.
"""
import argparse
import csv
import json
import math
import os
import statistics
import textwrap

from ..runtime import load_average, machine_meta
from ..plots import pyplot
from .common import out, parse_sets

# the sweep's families: each a token mixer + gated MLP per layer, 2 layers (zoology's MQAR models)
DEFAULT_LAYOUTS = ("attention=A:pos_embedding=\"learned\","
                   "attention-rope=A,"
                   "mamba2-n16=S:ssd_d_state=16,"
                   "mamba2-n64=S:ssd_d_state=64,"
                   "rodimus-n16=R:rodimus_d_state=16,"
                   "rodimus-n64=R:rodimus_d_state=64,"
                   "inner-fn-dynmask=F:wm_dyn_mask=\"position\":wm_inner_values=2:pos_embedding=\"learned\","
                   "cheems-ssd-n16=S:ssd_d_state=16:wm_ssd_rope=true,"
                   "gated-deltanet=G,"
                   "kda=K")
ROW_KEYS = ("name", "layout", "d_model", "seq_len", "num_pairs", "accuracy", "accuracy_min", "accuracy_max", "seeds",
            "params", "state_bytes", "lr", "steps", "rising", "devices")
RISING = 0.02   # a run that gained more than this over the last quarter of its budget was cut by the budget
# settings that define the protocol: a resumed sweep must match them (the sweep's axes may grow)
PROTOCOL_KEYS = ("layers", "pairs", "hard", "vocab_size", "curriculum", "steps", "batch_size", "train_examples",
                 "test_examples", "eval_every", "target", "weight_decay", "warmup")


def add_arguments(p):
    p.description = __doc__.split("\n\n")[1]
    p.add_argument("--layouts", default=DEFAULT_LAYOUTS, metavar="NAME=SPEC,...",
                   help="comma-separated NAME=VALUE[:FIELD=JSON...]; VALUE a preset, a layout string, or one mixer "
                        "letter X meaning (XM)*LAYERS (default: attention with learned positions and with RoPE, "
                        "Mamba-2 at N=16/64, Rodimus at n=16/64, inner-function attention with the position dynamic "
                        "mask, Cheems' SSD (RoPE on C/B) at N=16, Gated DeltaNet, KDA)")
    p.add_argument("--layers", type=int, default=2, help="depth: the repeat count of (XM) or of a preset's block")
    p.add_argument("--d-models", type=int, nargs="+", default=[32, 64, 128], metavar="D")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[64, 128], metavar="T")
    p.add_argument("--pairs-div", type=int, default=None, metavar="K",
                   help="key-value pairs = T/K (default 16 as zoology's figure 2; 4 with --hard, as the papers)")
    p.add_argument("--hard", action="store_true",
                   help="the papers' harder task: random filler tokens, pairs spread over the first half, "
                        "a curriculum over the pair count")
    p.add_argument("--vocab-size", type=int, default=8192, help="zoology's 8192 (default)")
    p.add_argument("--curriculum", action=argparse.BooleanOptionalAction, default=None,
                   help="stages T/8K ... T/K pairs (Mamba-2 D.1); default: on with --hard, off otherwise")
    p.add_argument("--steps", type=int, default=8000,
                   help="step budget per run (the cosine schedule spans it); runs stop earlier at --target. 8000 is "
                        "3.5x what 2-layer attention needs at T 64 / d 64 / vocab 8192 (0.99 at 2,250 steps, lr "
                        "3e-3); a run still gaining at the end is marked `rising`")
    p.add_argument("--warmup", type=int, default=None, metavar="N",
                   help="linear lr warmup steps (default: 2%% of --steps, at most 200)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, nargs="+", default=[3e-3, 1e-3],
                   help="peak learning rates, tried in this order; the best held-out accuracy is kept, and the rest "
                        "are skipped once one reaches --target; smaller lrs than one still rising when its budget ends "
                        "are skipped (they learn slower)")
    p.add_argument("--train-examples", type=int, default=100_000, help="fixed training set size (per stage)")
    p.add_argument("--test-examples", type=int, default=1_000)
    p.add_argument("--eval-every", type=int, default=250, help="held-out accuracy check every N steps")
    p.add_argument("--target", type=float, default=0.99, help="early-stopping accuracy (> 1: never stop)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="one full run (lr sweep) per seed")
    p.add_argument("--jobs", type=int, default=1, help="points in parallel (CPU processes of one thread each)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 layouts, one tiny size, a few steps")
    p.add_argument("--out", default="runs/mqar", help="output directory (default: runs/mqar); resumes what it holds")
    p.add_argument("--merge", nargs="+", metavar="DIR", default=None,
                   help="train nothing: add the runs of these sweeps' mqar.json (same protocol) to --out, rewrite its "
                        "tables and plots")


def parse_layouts(text: str, layers: int) -> list[tuple[str, str, dict]]:
    """'attention=A,m2=S:ssd_d_state=16' -> [(name, layout or preset, field overrides)]."""
    from ..models import presets
    from ..errors import InputError
    from ..models.layout import parse_layout
    from ..models.registry import LETTERS
    specs, seen = [], set()
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, eq, rest = item.partition("=")
        value, *sets = rest.split(":")
        name, value = name.strip(), value.strip()
        if not eq or not name or not value:
            raise InputError(f"--layouts expects NAME=SPEC entries, got {item!r}")
        if name in seen:
            raise InputError(f"--layouts names {name!r} twice")
        seen.add(name)
        if value not in presets.PRESETS:
            if len(value) == 1 and value in LETTERS:
                value = f"({value}M)*{layers}"
            try:
                parse_layout(value, LETTERS.keys())
            except Exception as e:
                raise InputError(f"--layouts {name}: {value!r} is neither a preset nor a layout ({e})") from None
        specs.append((name, value, parse_sets(sets)))
    if not specs:
        raise InputError("--layouts is empty")
    return specs


def build_config(value: str, over: dict, *, d_model: int, seq_len: int, vocab_size: int, layers: int):
    """ModelConfig of one sweep point: the spec at this width; single attention heads (000_4348bfb066d62081.txt
    table 6) and SSD head dims that divide the SSD width, unless the spec sets them."""
    from ..models import presets
    from ..errors import ConfigError
    from ..models import ModelConfig
    if value in presets.PRESETS:
        fields = {**presets.PRESETS[value].fields(layers)}
    else:
        fields = {"layout": value, "n_heads": 1}
    fields.update(d_model=d_model, max_seq_len=seq_len, vocab_size=vocab_size)
    fields["ssd_headdim"] = math.gcd(64, fields.get("ssd_expand", 2) * d_model)
    fields.update(over)
    try:
        return ModelConfig(**fields)
    except TypeError as e:  # an unknown field
        raise ConfigError(f"--layouts: {e}") from None


def _trial_key(t: dict) -> tuple:
    return (t["name"], t["layout"], t["d_model"], t["seq_len"], t["num_pairs"], t["lr"], t["seed"])


def _run_point(job: dict) -> list[dict]:
    """One sweep point and seed: its learning rates in order, stopping once one reaches the target (also the
    worker of --jobs: one thread per process). Skips the trials of `job["done"]` (a resumed sweep)."""
    import torch
    from ..eval.mqar import train_mqar
    from .info import cache_bytes
    if job["threads"]:
        torch.set_num_threads(job["threads"])
    cfg, task = job["cfg"], job["task"]
    state = cache_bytes(cfg, [task.seq_len])[0]
    trials, rising_at = [], 0.0
    for lr in job["lrs"]:
        if lr < rising_at:                 # smaller than an lr still rising at its budget's end: slower still
            continue
        base = {"name": job["name"], "layout": cfg.layout, "d_model": cfg.d_model, "seq_len": task.seq_len,
                "num_pairs": task.num_pairs, "lr": lr, "seed": job["seed"]}
        prev = job["done"].get(_trial_key(base))
        if prev is None:
            res = train_mqar(cfg, task, steps=job["steps"], warmup=job["warmup"], batch_size=job["batch_size"], lr=lr,
                             seed=job["seed"], weight_decay=job["weight_decay"], eval_every=job["eval_every"], target=job["target"],
                             device=job["device"], progress=job["progress"], desc=f"{job['desc']} lr={lr:g}")
            prev = dict(base, accuracy=res["accuracy"], params=res["params"], state_bytes=state, steps=res["steps"],
                        stopped_early=res["stopped_early"], rising=still_rising(res["curve"], job["steps"]),
                        loss=res["loss"], wall_s=res["wall_s"], curve=res["curve"], fields=job["fields"],
                        device=job["device_name"], load_avg=load_average())   # load > cores: it shared its core
            job["report"](prev)
        trials.append(prev)
        if prev["accuracy"] >= job["target"]:
            break
        if prev.get("rising"):
            rising_at = max(rising_at, lr)
    return trials


def still_rising(curve: list, steps: int) -> bool:
    """Whether held-out accuracy gained more than RISING over the last quarter of the step budget: the run ended
    below the target because the budget ran out, not because the model cannot do better (report it as such)."""
    if not curve or curve[-1][0] < steps:                  # stopped early, or no evaluation yet
        return False
    before = [a for s, a in curve if s <= 0.75 * steps]
    return bool(before) and curve[-1][1] - before[-1] > RISING


def best_rows(trials: list[dict]) -> list[dict]:
    """Per (name, d_model, seq_len): each seed's best learning rate (ties: the lower loss), then the mean accuracy
    over seeds (min/max beside it); lr and steps are those of the first seed's best run."""
    best = {}
    for t in trials:
        key = (t["name"], t["d_model"], t["seq_len"], t["seed"])
        if key not in best or (t["accuracy"], -t["loss"]) > (best[key]["accuracy"], -best[key]["loss"]):
            best[key] = t
    points = {}
    for (name, d, T, _), t in sorted(best.items(), key=lambda kv: kv[0][3]):     # seeds in order; points as run
        points.setdefault((name, d, T), []).append(t)
    rows = []
    for runs in points.values():
        accs = [r["accuracy"] for r in runs]
        first = runs[0]
        rows.append({**{k: first[k] for k in ROW_KEYS if k in first}, "accuracy": statistics.fmean(accs),
                     "accuracy_min": min(accs), "accuracy_max": max(accs), "seeds": [r["seed"] for r in runs],
                     "devices": sorted({r.get("device", "cpu") for r in runs})})
    return rows


def write_results(out_dir: str, meta: dict, trials: list[dict]):
    """Write mqar.json / mqar.csv. Trials that another sweep of the same protocol wrote to out_dir meanwhile are
    merged into `trials` (in place) first, so two sweeps over different axes may share one --out; meta["commands"]
    lists every command behind the file."""
    disk = _read_json(out_dir)
    commands = [meta["command"]]
    if disk is not None and not _protocol_diff(disk["meta"].get("settings", {}), meta["settings"]):
        ours = {_trial_key(t) for t in trials}
        trials += [t for t in disk["meta"].get("trials", []) if "seed" in t and _trial_key(t) not in ours]
        commands = disk["meta"].get("commands") or [disk["meta"].get("command", "")]
        commands += [meta["command"]] * (meta["command"] not in commands)
    return _write(out_dir, dict(meta, commands=commands), trials)


def _write(out_dir: str, meta: dict, trials: list[dict]) -> list[dict]:
    """mqar.json ({"meta": meta + trials, "rows"}, atomically) and mqar.csv from these trials alone -> rows."""
    trials.sort(key=lambda t: (t["seq_len"], t["d_model"]))          # stable: a sweep's own order within a point
    rows = best_rows(trials)
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, f"mqar.json.{os.getpid()}.tmp")     # per process: sweeps may share out_dir
    with open(tmp, "w") as f:
        json.dump({"meta": {**meta, "trials": trials}, "rows": rows}, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, "mqar.json"))
    with open(os.path.join(out_dir, "mqar.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=ROW_KEYS)
        w.writeheader()
        w.writerows(dict(r, seeds=" ".join(map(str, r["seeds"])), devices=" ".join(r["devices"])) for r in rows)
    return rows


def _read_json(out_dir: str) -> dict | None:
    from ..errors import InputError
    path = os.path.join(out_dir, "mqar.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            res = json.load(f)
        res["meta"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"{path} is not a readable mqar.json ({e}); remove it or pick another --out") from None
    return res


def _protocol_diff(old: dict, new: dict) -> list[str]:
    from ..eval.mqar import warmup_steps
    # settings written before --warmup had the default warmup only
    old, new = ({"warmup": warmup_steps(s["steps"]), **s} if "steps" in s else s for s in (old, new))
    return [f"{k}: {old.get(k)!r} there, {new.get(k)!r} here" for k in PROTOCOL_KEYS if old.get(k) != new.get(k)]


def read_done(out_dir: str, settings: dict) -> dict:
    """Trials of an earlier sweep in out_dir with the same protocol, by key (empty when there is none)."""
    from ..errors import InputError
    disk = _read_json(out_dir)
    if disk is None:
        return {}
    meta = disk["meta"]
    diff = _protocol_diff(meta.get("settings", {}), settings)
    if diff:
        raise InputError(f"{os.path.join(out_dir, 'mqar.json')} was written with another protocol ({'; '.join(diff)}); "
                         f"pick another --out to start a new sweep")
    return {_trial_key(t): t for t in meta.get("trials", []) if "seed" in t}


def plot(rows: list[dict], path: str, title: str, x: str = "d_model"):
    """Accuracy against d_model or state_bytes (log2 axis), one line per layout, one panel per sequence length;
    the band spans the seeds' min..max."""
    plt = pyplot()
    seq_lens = sorted({r["seq_len"] for r in rows})
    names = list(dict.fromkeys(r["name"] for r in rows))
    fig, axes = plt.subplots(1, len(seq_lens), figsize=(4.4 * len(seq_lens), 3.6), sharey=True, squeeze=False)
    for ax, T in zip(axes[0], seq_lens):
        for i, name in enumerate(names):
            pts = sorted((r[x], r["accuracy"], r["accuracy_min"], r["accuracy_max"]) for r in rows
                         if r["name"] == name and r["seq_len"] == T)
            if pts:
                xs, ys, lo, hi = zip(*pts)
                ax.plot(xs, ys, marker="o", ms=4, color=f"C{i % 10}", label=name)
                ax.fill_between(xs, lo, hi, color=f"C{i % 10}", alpha=0.15, lw=0)
        pairs = sorted({r["num_pairs"] for r in rows if r["seq_len"] == T})
        ax.set_title(f"T = {T}, {'/'.join(map(str, pairs))} pairs")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("d_model" if x == "d_model" else "recurrent state / cache at T (bytes)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(textwrap.fill(title, int(13 * 4.4 * len(seq_lens))), fontsize=9)   # wrapped: never clipped
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_curves(trials: list[dict], path: str, title: str):
    """Held-out accuracy against steps of every run at one width (64 when swept, else the middle one), one panel
    per sequence length: where recall is learned, and where a run ran out of budget."""
    plt = pyplot()
    seq_lens = sorted({t["seq_len"] for t in trials})
    names = list(dict.fromkeys(t["name"] for t in trials))
    widths = sorted({t["d_model"] for t in trials})
    d = 64 if 64 in widths else widths[len(widths) // 2]
    lrs = sorted({t["lr"] for t in trials})
    fig, axes = plt.subplots(1, len(seq_lens), figsize=(4.4 * len(seq_lens), 3.6), sharey=True, squeeze=False)
    for ax, T in zip(axes[0], seq_lens):
        for t in trials:
            if t["seq_len"] == T and t["d_model"] == d and t.get("curve"):
                i = names.index(t["name"])
                ax.plot(*zip(*t["curve"]), color=f"C{i % 10}", ls=("-", "--", ":", "-.")[lrs.index(t["lr"]) % 4],
                        lw=1.2, label=f"{t['name']} lr {t['lr']:g}" if t["seed"] == trials[0]["seed"] else None)
        ax.set_title(f"T = {T}, d_model = {d}")
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out accuracy")
    axes[0][-1].legend(fontsize=6, loc="lower right")
    fig.suptitle(textwrap.fill(title, int(13 * 4.4 * len(seq_lens))), fontsize=9)   # wrapped: never clipped
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args) -> int:
    import torch
    from ..data.mqar import check_sizes
    from ..errors import InputError
    from ..eval.mqar import MQARTask, warmup_steps
    if args.merge:
        return merge(args.merge, args.out)
    if args.quick:
        args.layouts = "attention=A,mamba2=S:ssd_d_state=16" if args.layouts == DEFAULT_LAYOUTS else args.layouts
        args.d_models, args.seq_lens, args.vocab_size = [16], [32], 64
        args.steps, args.batch_size, args.train_examples, args.test_examples = 6, 8, 64, 32
        args.eval_every = 3
    for flag, v in (("--steps", args.steps), ("--batch-size", args.batch_size), ("--jobs", args.jobs),
                    ("--layers", args.layers), ("--train-examples", args.train_examples),
                    ("--test-examples", args.test_examples), ("--pairs-div", args.pairs_div or 1),
                    ("--eval-every", args.eval_every)):
        if v < 1:
            raise InputError(f"{flag} must be >= 1, got {v}")
    if min(args.d_models) < 1 or min(args.seq_lens) < 1 or min(args.lr) <= 0:
        raise InputError("--d-models and --seq-lens must be >= 1 and --lr > 0")
    warmup = warmup_steps(args.steps, args.warmup)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device_name = f"cuda ({torch.cuda.get_device_name()})" if device.startswith("cuda") else device
    div = args.pairs_div or (4 if args.hard else 16)
    curriculum = args.hard if args.curriculum is None else args.curriculum
    specs = parse_layouts(args.layouts, args.layers)
    settings = {"layouts": args.layouts, "layers": args.layers, "d_models": args.d_models, "seq_lens": args.seq_lens,
                "pairs": f"T/{div}", "hard": args.hard, "vocab_size": args.vocab_size, "curriculum": curriculum,
                "steps": args.steps, "warmup": warmup, "batch_size": args.batch_size, "lr": args.lr,
                "train_examples": args.train_examples, "test_examples": args.test_examples,
                "eval_every": args.eval_every, "target": args.target, "weight_decay": args.weight_decay,
                "seeds": args.seeds, "power_a": 0.01, "optimizer": "AdamW (0.9, 0.95), decay on matrices only",
                "schedule": f"linear warmup over {warmup} steps, cosine to 0 over --steps; early stop at --target",
                "mlp": "each token mixer X is followed by the gated MLP M: (XM)*layers"}
    done = read_done(args.out, settings)
    meta = dict(machine_meta(threads=1 if args.jobs > 1 else None), device=device, jobs=args.jobs, settings=settings)
    trials = list(done.values())

    def report(t):
        trials.append(t)
        write_results(args.out, meta, trials)
        out(f"  {t['name']:<18} d={t['d_model']:<4} T={t['seq_len']:<5} seed={t['seed']} lr={t['lr']:<8g} "
            f"acc={t['accuracy']:.3f} steps={t['steps']:<6} loss={t['loss']:.3f} ({t['wall_s']:.0f}s)")

    jobs = []
    for T in sorted(args.seq_lens):
        task = MQARTask(seq_len=T, num_pairs=max(1, T // div), vocab_size=args.vocab_size, hard=args.hard,
                        train_examples=args.train_examples, test_examples=args.test_examples, curriculum=curriculum)
        check_sizes(task.seq_len, task.num_pairs, task.vocab_size)
        for d in sorted(args.d_models):
            for seed in args.seeds:
                for name, value, over in specs:
                    cfg = build_config(value, over, d_model=d, seq_len=T, vocab_size=args.vocab_size,
                                       layers=args.layers)
                    jobs.append(dict(name=name, cfg=cfg, task=task, fields=over, steps=args.steps, warmup=warmup,
                                     device_name=device_name,
                                     batch_size=args.batch_size, lrs=args.lr, seed=seed, device=device,
                                     weight_decay=args.weight_decay, eval_every=args.eval_every, target=args.target,
                                     progress=args.jobs == 1, threads=1 if args.jobs > 1 else 0, done=done,
                                     report=report if args.jobs == 1 else None, desc=f"{name} d={d} T={T} s={seed}"))
    out(f"mqar: {len(jobs)} points ({len(specs)} layouts x {len(args.d_models)} d_model x {len(args.seq_lens)} "
        f"seq_len x {len(args.seeds)} seeds; lrs {' '.join(f'{x:g}' for x in args.lr)}), at most {args.steps} steps "
        f"each, early stop at {args.target}, on {device}" + (f"; resuming: {len(done)} runs done" if done else ""))
    if args.jobs == 1:
        for job in jobs:
            _run_point(job)
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed
        with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
            futs = [pool.submit(_run_point, dict(j, report=_noop)) for j in jobs]
            for fut in as_completed(futs):
                for t in fut.result():
                    if _trial_key(t) not in done:
                        report(t)
    order = {name: i for i, (name, _, _) in enumerate(specs)}
    trials.sort(key=lambda t: (order.get(t["name"], len(order)), t["seed"], t["lr"]))
    rows = write_results(args.out, meta, trials)
    write_plots(args.out, rows, trials, settings)
    return 0


def write_plots(out_dir: str, rows: list[dict], trials: list[dict], settings: dict):
    """mqar.png, mqar-state.png, mqar-curves.png and (when the sweep holds both families at several state sizes)
    mqar-families.png under out_dir."""
    title = (f"MQAR ({'hard' if settings.get('hard') else 'zoology'}), vocab {settings['vocab_size']}, "
             f"{settings['layers']} layers, <= {settings['steps']} steps, early stop {settings['target']}")
    plot(rows, os.path.join(out_dir, "mqar.png"), title)
    plot(rows, os.path.join(out_dir, "mqar-state.png"), title, x="state_bytes")
    plot_curves(trials, os.path.join(out_dir, "mqar-curves.png"), title)
    wrote = ["mqar.png", "mqar-state.png", "mqar-curves.png"]
    if state_size_points(rows):
        plot_families(rows, os.path.join(out_dir, "mqar-families.png"), title)
        wrote.append("mqar-families.png")
    out(f"wrote {os.path.join(out_dir, 'mqar.json')}, mqar.csv, {', '.join(wrote)}")


FAMILIES = {"rodimus": "Rodimus (n)", "mamba2": "Mamba-2 (N)"}     # sweep names FAMILY-nSIZE: the state-size figure


def _family(name: str) -> tuple[str, int] | None:
    fam, _, n = name.rpartition("-n")
    return (fam, int(n)) if fam in FAMILIES and n.isdigit() else None


def state_size_points(rows: list[dict]) -> dict:
    """(d_model, seq_len) -> rows of the points where both families ran at 3 or more state sizes: the sweeps of
    Rodimus' figure 1b (accuracy against the expansion factor n, Rodimus against Mamba-2's N)."""
    by = {}
    for r in rows:
        if _family(r["name"]):
            by.setdefault((r["d_model"], r["seq_len"]), []).append(r)
    return {k: v for k, v in sorted(by.items())
            if all(len({_family(r["name"])[1] for r in v if _family(r["name"])[0] == f}) >= 3 for f in FAMILIES)}


def plot_families(rows: list[dict], path: str, title: str):
    """Rodimus figure 1b at sweep size: accuracy against recurrent-state bytes (log2 axis), one line per family
    labelled with its n / N, one panel per (d_model, T); the band spans the seeds' min..max."""
    plt = pyplot()
    groups = state_size_points(rows)
    fig, axes = plt.subplots(1, len(groups), figsize=(4.8 * len(groups), 3.8), sharey=True, squeeze=False)
    for ax, ((d, T), rs) in zip(axes[0], groups.items()):
        for i, (fam, label) in enumerate(FAMILIES.items()):
            pts = sorted((r["state_bytes"], r["accuracy"], r["accuracy_min"], r["accuracy_max"], _family(r["name"])[1])
                         for r in rs if _family(r["name"])[0] == fam)
            xs, ys, lo, hi, ns = zip(*pts)
            ax.plot(xs, ys, marker="o", ms=4, color=f"C{i}", label=label)
            ax.fill_between(xs, lo, hi, color=f"C{i}", alpha=0.15, lw=0)
            for x, y, n in zip(xs, ys, ns):
                ax.annotate(str(n), (x, y), textcoords="offset points", xytext=(0, -11 if i else 5), ha="center",
                            fontsize=7, color=f"C{i}")
        ax.set_title(f"d_model = {d}, T = {T}, {rs[0]['num_pairs']} pairs")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("recurrent state (bytes)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy (mean over seeds)")
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.suptitle(textwrap.fill(title, int(13 * 4.8 * len(groups))), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def merge(sources: list[str], out_dir: str) -> int:
    """Add the runs of other sweeps (their mqar.json, same protocol) to out_dir's: a sweep run elsewhere joins the
    results. Runs out_dir already holds win; a source's commands are recorded with their --out set to out_dir, and
    its runs without a `device` get the device its meta names."""
    import re
    from ..errors import InputError
    base = _read_json(out_dir)
    srcs = []
    for d in sources:
        src = _read_json(d)
        if src is None:
            raise InputError(f"--merge: {os.path.join(d, 'mqar.json')} does not exist")
        srcs.append(src)
    meta = dict((base or srcs[0])["meta"])
    trials = list(meta.pop("trials", [])) if base else []
    commands = (meta.get("commands") or [meta.get("command", "")]) if base else []
    keys = {_trial_key(t) for t in trials}
    for d, src in zip(sources, srcs):
        diff = _protocol_diff(meta.get("settings", {}), src["meta"].get("settings", {}))
        if diff:
            raise InputError(f"--merge: {os.path.join(d, 'mqar.json')} was written with another protocol "
                             f"({'; '.join(diff)})")
        for c in src["meta"].get("commands") or [src["meta"].get("command", "")]:
            c = re.sub(r"--out \S+", f"--out {out_dir}", c)   # what reruns it here: no path of the other machine
            commands += [c] * (c not in commands)
        for t in src["meta"].get("trials", []):
            if "seed" in t and _trial_key(t) not in keys:
                keys.add(_trial_key(t))
                trials.append(dict(t, device=t.get("device") or src["meta"].get("device", "cpu")))
    rows = _write(out_dir, dict(meta, command=commands[-1], commands=commands), trials)
    write_plots(out_dir, rows, trials, meta["settings"])
    out(f"merged {len(trials) - (len(base['meta'].get('trials', [])) if base else 0)} runs into {out_dir}")
    return 0


def _noop(_):
    pass
