"""`hybridlm mqar`: multi-query associative recall accuracy over a sweep of layouts, d_model and sequence length.

Every layout is trained from scratch on the same data for each (d_model, seq_len) and each learning rate of
`--lr` (the best is kept, as zoology does), then scored on held-out examples. Output under --out:
mqar.json ({"meta", "rows"}), mqar.csv (the rows) and mqar.png (accuracy against d_model, one line per layout,
one panel per sequence length). mqar.json is rewritten after every run, so an interrupted sweep keeps its rows.

A layout spec is NAME=VALUE[:FIELD=JSON...]: VALUE is a preset name, a layout string, or one token-mixer letter X,
which becomes zoology's mixer + MLP stack `(XM)*LAYERS`; FIELD=JSON sets any ModelConfig field.
"""
import csv
import json
import math
import os
import platform

from ..cli import command_line
from ..plots import pyplot
from .common import out, parse_sets

# the sweep's families: each a token mixer + gated MLP per layer, 2 layers (zoology's MQAR models)
DEFAULT_LAYOUTS = ("attention=A,"
                   "mamba2-n16=S:ssd_d_state=16,"
                   "mamba2-n64=S:ssd_d_state=64,"
                   "rodimus-n16=R:rodimus_d_state=16,"
                   "rodimus-n64=R:rodimus_d_state=64,"
                   "inner-fn-dynmask=F:wm_dyn_mask=\"position\":wm_inner_values=2")
ROW_KEYS = ("name", "layout", "d_model", "seq_len", "num_pairs", "accuracy", "params", "state_bytes", "lr", "steps")


def add_arguments(p):
    p.add_argument("--layouts", default=DEFAULT_LAYOUTS, metavar="NAME=SPEC,...",
                   help="comma-separated NAME=VALUE[:FIELD=JSON...]; VALUE a preset, a layout string, or one mixer "
                        "letter X meaning (XM)*LAYERS (default: attention, Mamba-2 at N=16/64, Rodimus at n=16/64, "
                        "inner-function attention with the position dynamic mask)")
    p.add_argument("--layers", type=int, default=2, help="depth: the repeat count of (XM) or of a preset's block")
    p.add_argument("--d-models", type=int, nargs="+", default=[16, 32, 64, 128], metavar="D")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[64, 128, 256], metavar="T")
    p.add_argument("--pairs-div", type=int, default=None, metavar="K",
                   help="key-value pairs = T/K (default 16 as zoology's figure 2; 4 with --hard, as the papers)")
    p.add_argument("--hard", action="store_true",
                   help="the papers' harder task: random filler tokens, pairs spread over the first half")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--no-curriculum", action="store_true",
                   help="train on the final pair count only (default: stages T/8K ... T/K pairs, Mamba-2 D.1)")
    p.add_argument("--steps", type=int, default=1200, help="optimizer steps per run")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, nargs="+", default=[3e-3], help="one or more peak learning rates; the best "
                   "held-out accuracy is kept")
    p.add_argument("--train-examples", type=int, default=8192, help="training set size per curriculum stage")
    p.add_argument("--test-examples", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel (CPU processes of one thread each)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 layouts, one tiny size, a few steps")
    p.add_argument("--out", default="runs/mqar", help="output directory (default: runs/mqar)")


def parse_layouts(text: str, layers: int) -> list[tuple[str, str, dict]]:
    """'attention=A,m2=S:ssd_d_state=16' -> [(name, layout or preset, field overrides)]."""
    from .. import presets
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
    from .. import presets
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


def _run(job: dict) -> dict:
    """One training run (also the worker of --jobs: one thread per process)."""
    import torch
    from ..eval.mqar import train_mqar
    from .info import cache_bytes
    if job["threads"]:
        torch.set_num_threads(job["threads"])
    res = train_mqar(job["cfg"], job["task"], steps=job["steps"], batch_size=job["batch_size"], lr=job["lr"],
                     seed=job["seed"], device=job["device"], progress=job["progress"], desc=job["desc"])
    state = cache_bytes(job["cfg"], [job["task"].seq_len])[0]
    return {"name": job["name"], "layout": job["cfg"].layout, "d_model": job["cfg"].d_model,
            "seq_len": job["task"].seq_len, "num_pairs": job["task"].num_pairs, "accuracy": res["accuracy"],
            "params": res["params"], "state_bytes": state, "lr": job["lr"], "steps": res["steps"],
            "loss": res["loss"], "wall_s": res["wall_s"]}


def best_rows(trials: list[dict]) -> list[dict]:
    """Per (name, d_model, seq_len), the learning rate with the best accuracy (ties: the lower loss)."""
    best = {}
    for t in trials:
        key = (t["name"], t["d_model"], t["seq_len"])
        if key not in best or (t["accuracy"], -t["loss"]) > (best[key]["accuracy"], -best[key]["loss"]):
            best[key] = t
    return [{k: r[k] for k in ROW_KEYS} for r in best.values()]


def write_results(out_dir: str, meta: dict, trials: list[dict]):
    rows = best_rows(trials)
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, "mqar.json.tmp")
    with open(tmp, "w") as f:
        json.dump({"meta": {**meta, "trials": trials}, "rows": rows}, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, "mqar.json"))
    with open(os.path.join(out_dir, "mqar.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=ROW_KEYS)
        w.writeheader()
        w.writerows(rows)
    return rows


def plot(rows: list[dict], path: str, title: str):
    """Accuracy against d_model (log2 axis), one line per layout, one panel per sequence length."""
    plt = pyplot()
    seq_lens = sorted({r["seq_len"] for r in rows})
    names = list(dict.fromkeys(r["name"] for r in rows))
    fig, axes = plt.subplots(1, len(seq_lens), figsize=(4 * len(seq_lens), 3.4), sharey=True, squeeze=False)
    for ax, T in zip(axes[0], seq_lens):
        for name in names:
            pts = sorted((r["d_model"], r["accuracy"]) for r in rows if r["name"] == name and r["seq_len"] == T)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        pairs = sorted({r["num_pairs"] for r in rows if r["seq_len"] == T})
        ax.set_title(f"T = {T}, {'/'.join(map(str, pairs))} pairs")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("d_model")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy")
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args) -> int:
    import torch
    from .. import __version__
    from ..data.mqar import check_sizes
    from ..errors import InputError
    from ..eval.mqar import MQARTask
    if args.quick:
        args.layouts = "attention=A,mamba2=S:ssd_d_state=16" if args.layouts == DEFAULT_LAYOUTS else args.layouts
        args.d_models, args.seq_lens, args.vocab_size = [16], [32], 64
        args.steps, args.batch_size, args.train_examples, args.test_examples = 6, 8, 64, 32
    for flag, v in (("--steps", args.steps), ("--batch-size", args.batch_size), ("--jobs", args.jobs),
                    ("--layers", args.layers), ("--train-examples", args.train_examples),
                    ("--test-examples", args.test_examples), ("--pairs-div", args.pairs_div or 1)):
        if v < 1:
            raise InputError(f"{flag} must be >= 1, got {v}")
    if min(args.d_models) < 1 or min(args.seq_lens) < 1 or min(args.lr) <= 0:
        raise InputError("--d-models and --seq-lens must be >= 1 and --lr > 0")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    div = args.pairs_div or (4 if args.hard else 16)
    specs = parse_layouts(args.layouts, args.layers)
    jobs = []
    for T in sorted(args.seq_lens):
        task = MQARTask(seq_len=T, num_pairs=max(1, T // div), vocab_size=args.vocab_size, hard=args.hard,
                        train_examples=args.train_examples, test_examples=args.test_examples,
                        curriculum=not args.no_curriculum)
        check_sizes(task.seq_len, task.num_pairs, task.vocab_size)
        for d in sorted(args.d_models):
            for name, value, over in specs:
                cfg = build_config(value, over, d_model=d, seq_len=T, vocab_size=args.vocab_size, layers=args.layers)
                for lr in args.lr:
                    jobs.append(dict(name=name, cfg=cfg, task=task, steps=args.steps, batch_size=args.batch_size,
                                     lr=lr, seed=args.seed, device=device, progress=args.jobs == 1,
                                     threads=1 if args.jobs > 1 else 0,
                                     desc=f"{name} d={d} T={T} lr={lr:g}"))
    meta = {"machine": " ".join(filter(None, (platform.machine(), platform.processor(), f"{os.cpu_count()} cpus"))),
            "device": device, "torch": torch.__version__, "hybridlm": __version__, "python": platform.python_version(),
            "command": command_line(),
            "settings": {"layouts": args.layouts, "layers": args.layers, "d_models": args.d_models,
                         "seq_lens": args.seq_lens, "pairs": f"T/{div}", "hard": args.hard,
                         "vocab_size": args.vocab_size, "curriculum": not args.no_curriculum, "steps": args.steps,
                         "batch_size": args.batch_size, "lr": args.lr, "train_examples": args.train_examples,
                         "test_examples": args.test_examples, "seed": args.seed, "power_a": 0.01,
                         "mlp": "each token mixer X is followed by the gated MLP M: (XM)*layers"}}
    out(f"mqar: {len(jobs)} runs ({len(specs)} layouts x {len(args.d_models)} d_model x {len(args.seq_lens)} "
        f"seq_len x {len(args.lr)} lr), {args.steps} steps each, on {device}")
    trials = []

    def done(row):
        trials.append(row)
        write_results(args.out, meta, trials)
        out(f"  {row['name']:<18} d={row['d_model']:<4} T={row['seq_len']:<5} pairs={row['num_pairs']:<4} "
            f"lr={row['lr']:<8g} acc={row['accuracy']:.3f} loss={row['loss']:.3f} ({row['wall_s']:.0f}s)")

    if args.jobs == 1:
        for job in jobs:
            done(_run(job))
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed
        with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
            for fut in as_completed([pool.submit(_run, j) for j in jobs]):
                done(fut.result())
    rows = write_results(args.out, meta, sorted(trials, key=lambda r: (r["seq_len"], r["d_model"], r["name"])))
    png = os.path.join(args.out, "mqar.png")
    plot(rows, png, f"MQAR ({'hard' if args.hard else 'zoology'}), vocab {args.vocab_size}, {args.layers} layers, "
                    f"{args.steps} steps")
    out(f"wrote {os.path.join(args.out, 'mqar.json')}, mqar.csv, mqar.png")
    return 0
