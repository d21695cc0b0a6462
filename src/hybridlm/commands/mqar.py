"""`hybridlm mqar`: multi-query associative recall accuracy over a sweep of layouts, d_model and sequence length.

The protocol (zoology's: a lr sweep with early stopping over a large step budget) and the sweep engine are in
eval/mqar_sweep.py; `--help` shows the protocol.

Output under --out: mqar.json ({"meta", "rows"}; meta.trials holds every run with its accuracy-against-steps curve),
mqar.csv (the rows: per point the best lr of each seed, accuracy = mean over seeds), mqar.png (accuracy against
d_model), mqar-state.png (accuracy against recurrent-state bytes) and, where a sweep holds Rodimus and Mamba-2 at
several state sizes, mqar-families.png (Rodimus figure 1b: accuracy against state bytes, one line per family).
mqar.json is rewritten after every run, and a rerun with the same protocol into the same --out skips the runs it
already holds: an interrupted sweep resumes. `--merge DIR...` adds the runs of sweeps written elsewhere (another
machine, a GPU) to --out without training; every run records the device it ran on.
"""
import argparse

from ..runtime import machine_meta
from ..eval.mqar_plots import write_plots
from ..eval.mqar_sweep import (DEFAULT_LAYOUTS, build_config, merge, parse_layouts, read_done, run_point, trial_key,
                               write_results)
from .common import out


def add_arguments(p):
    from ..eval import mqar_sweep
    p.description = mqar_sweep.__doc__.split("\n\n")[1]
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


def _quick(args):
    """The smoke run: two layouts, one tiny size, a few steps."""
    args.layouts = "attention=A,mamba2=S:ssd_d_state=16" if args.layouts == DEFAULT_LAYOUTS else args.layouts
    args.d_models, args.seq_lens, args.vocab_size = [16], [32], 64
    args.steps, args.batch_size, args.train_examples, args.test_examples = 6, 8, 64, 32
    args.eval_every = 3


def _check(args):
    from ..errors import InputError
    for flag, v in (("--steps", args.steps), ("--batch-size", args.batch_size), ("--jobs", args.jobs),
                    ("--layers", args.layers), ("--train-examples", args.train_examples),
                    ("--test-examples", args.test_examples), ("--pairs-div", args.pairs_div or 1),
                    ("--eval-every", args.eval_every)):
        if v < 1:
            raise InputError(f"{flag} must be >= 1, got {v}")
    if min(args.d_models) < 1 or min(args.seq_lens) < 1 or min(args.lr) <= 0:
        raise InputError("--d-models and --seq-lens must be >= 1 and --lr > 0")


def _settings(args) -> dict:
    """The protocol as the sweep records it (a resumed sweep must match it)."""
    from ..data.mqar import pairs_divisor
    from ..eval.mqar import warmup_steps
    warmup = warmup_steps(args.steps, args.warmup)
    return {"layouts": args.layouts, "layers": args.layers, "d_models": args.d_models, "seq_lens": args.seq_lens,
            "pairs": f"T/{args.pairs_div or pairs_divisor(args.hard)}", "hard": args.hard,
            "vocab_size": args.vocab_size, "curriculum": args.hard if args.curriculum is None else args.curriculum,
            "steps": args.steps, "warmup": warmup, "batch_size": args.batch_size, "lr": args.lr,
            "train_examples": args.train_examples, "test_examples": args.test_examples,
            "eval_every": args.eval_every, "target": args.target, "weight_decay": args.weight_decay,
            "seeds": args.seeds, "power_a": 0.01, "optimizer": "AdamW (0.9, 0.95), decay on matrices only",
            "schedule": f"linear warmup over {warmup} steps, cosine to 0 over --steps; early stop at --target",
            "mlp": "each token mixer X is followed by the gated MLP M: (XM)*layers"}


def _jobs(args, specs, settings: dict, device: str, done: dict, report) -> list[dict]:
    """One job per (sequence length, width, seed, layout): its config, task and the lrs to try."""
    import torch
    from ..data.mqar import check_sizes, default_pairs
    from ..eval.mqar import MQARTask
    device_name = f"cuda ({torch.cuda.get_device_name()})" if device.startswith("cuda") else device
    div = int(settings["pairs"][2:])
    jobs = []
    for T in sorted(args.seq_lens):
        task = MQARTask(seq_len=T, num_pairs=default_pairs(T, args.hard, div), vocab_size=args.vocab_size,
                        hard=args.hard, train_examples=args.train_examples, test_examples=args.test_examples,
                        curriculum=settings["curriculum"])
        check_sizes(task.seq_len, task.num_pairs, task.vocab_size)
        for d in sorted(args.d_models):
            for seed in args.seeds:
                for name, value, over in specs:
                    cfg = build_config(value, over, d_model=d, seq_len=T, vocab_size=args.vocab_size,
                                       layers=args.layers)
                    jobs.append(dict(name=name, cfg=cfg, task=task, fields=over, steps=args.steps,
                                     warmup=settings["warmup"], device_name=device_name, batch_size=args.batch_size,
                                     lrs=args.lr, seed=seed, device=device, weight_decay=args.weight_decay,
                                     eval_every=args.eval_every, target=args.target, progress=args.jobs == 1,
                                     threads=1 if args.jobs > 1 else 0, done=done,
                                     report=report if args.jobs == 1 else None, desc=f"{name} d={d} T={T} s={seed}"))
    return jobs


def _run(jobs: list[dict], n: int, done: dict, report):
    """The jobs in this process, or in n single-thread processes whose runs are reported as they finish."""
    if n == 1:
        for job in jobs:
            run_point(job)
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed
    with ProcessPoolExecutor(n, mp_context=mp.get_context("spawn")) as pool:
        futs = [pool.submit(run_point, dict(j, report=_noop)) for j in jobs]
        for fut in as_completed(futs):
            for t in fut.result():
                if trial_key(t) not in done:
                    report(t)


def main(args) -> int:
    import torch
    if args.merge:
        rows, trials, settings, added = merge(args.merge, args.out)
        write_plots(args.out, rows, trials, settings, log=out)
        out(f"merged {added} runs into {args.out}")
        return 0
    if args.quick:
        _quick(args)
    _check(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    specs, settings = parse_layouts(args.layouts, args.layers), _settings(args)
    done = read_done(args.out, settings)
    meta = dict(machine_meta(threads=1 if args.jobs > 1 else None), device=device, jobs=args.jobs, settings=settings)
    trials = list(done.values())

    def report(t):
        trials.append(t)
        write_results(args.out, meta, trials)
        out(f"  {t['name']:<18} d={t['d_model']:<4} T={t['seq_len']:<5} seed={t['seed']} lr={t['lr']:<8g} "
            f"acc={t['accuracy']:.3f} steps={t['steps']:<6} loss={t['loss']:.3f} ({t['wall_s']:.0f}s)")
    jobs = _jobs(args, specs, settings, device, done, report)
    out(f"mqar: {len(jobs)} points ({len(specs)} layouts x {len(args.d_models)} d_model x {len(args.seq_lens)} "
        f"seq_len x {len(args.seeds)} seeds; lrs {' '.join(f'{x:g}' for x in args.lr)}), at most {args.steps} steps "
        f"each, early stop at {args.target}, on {device}" + (f"; resuming: {len(done)} runs done" if done else ""))
    _run(jobs, args.jobs, done, report)
    order = {name: i for i, (name, _, _) in enumerate(specs)}
    trials.sort(key=lambda t: (order.get(t["name"], len(order)), t["seed"], t["lr"]))
    rows = write_results(args.out, meta, trials)
    write_plots(args.out, rows, trials, settings, log=out)
    return 0


def _noop(_):
    pass
