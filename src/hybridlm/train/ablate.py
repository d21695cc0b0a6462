"""Run an ablation recipe: every configuration trained on the same data, budget and seeds; one table.

    res = run_recipe(load_recipe("rodimus-gates"), "runs/ablate/rodimus-gates")

Writes OUT/ablate.json ({"meta", "recipe", "title", "rows": [...]}), OUT/ablate.csv, OUT/curves.png and one
run directory per configuration (OUT/<name>/metrics.jsonl, as `hybridlm train` writes; OUT/<name>/seed<k>/ when
the recipe has several seeds). A row's val_loss is the mean over seeds, val_loss_std their sample standard deviation
(the measured noise the claims are judged against) and val_losses each seed's figure; a budget's `eval_seq_lens`
adds the final model's validation loss at those lengths (val_loss_at {length: mean}, val_loss_at_std).

Each finished (configuration, seed) run leaves OUT/.../result.json: a rerun into the same OUT with the same budget
reuses it, so an interrupted recipe resumes where it stopped.
"""
import csv
import json
import math
import os
import shutil
import statistics
import time

from ..runtime import machine_meta
from ..errors import ConfigError
from .recipes import Recipe, RunConfig

ROW_KEYS = ["name", "layout", "params", "active_params", "d_model", "mixer_layers", "val_loss", "val_loss_std",
            "val_ppl", "val_tokens", "tokens_per_s", "steps", "wall_s", "seeds", "val_losses", "indexer_kl",
            "captured_mass", "captured_mass_std", "captured_mass_init", "captured_oracle", "captured_random"]
RESULT = "result.json"
MEASURED = ("indexer_kl", "captured_mass", "captured_mass_init", "captured_oracle", "captured_random")
QUICK = dict(steps=3, batch_size=2, seq_len=32, max_bytes=200_000, eval_every=0, eval_tokens=256, log_every=1)
QUICK_EVAL_SEQ_LENS = [64]



def _train_one(recipe: Recipe, c: RunConfig, cfg, data, tok, seed: int, run_dir: str, device: str, progress: bool,
               keep_checkpoints: bool) -> dict:
    """Train one (configuration, seed), or reuse its result.json from an earlier run of the same budget."""
    from ..eval.perplexity import validate
    from . import TrainConfig, train
    from ..checkpoint import load_checkpoint
    b = recipe.budget
    path = os.path.join(run_dir, RESULT)
    key = {"budget": _run_budget(b), "train": c.train, "layout": cfg.layout, "d_model": cfg.d_model}
    if os.path.exists(path):
        with open(path) as f:
            done = json.load(f)
        if all(done.get(k) == v for k, v in key.items()):
            return done
    budget = dict(steps=b["steps"], batch_size=b["batch_size"], seq_len=b["seq_len"], lr=b["lr"],
                  min_lr=b.get("min_lr"), warmup=b["warmup"], schedule=b.get("schedule", "cosine"),
                  weight_decay=b.get("weight_decay", 0.1), eval_every=b["eval_every"],
                  eval_tokens=b["eval_tokens"] or None, save_every=0, log_every=b["log_every"])
    tcfg = TrainConfig(**{**budget, **c.train}, seed=seed, device=device)
    t0 = time.perf_counter()
    s = train(cfg, tcfg, data, run_dir, progress=progress)
    wall = time.perf_counter() - t0
    if s.get("stopped"):     # SIGTERM / SIGINT: that run saved a checkpoint and stopped; the recipe stops with it
        raise KeyboardInterrupt(f"{c.name} (seed {seed}) stopped by {s['stopped']} at step {s['steps']}")
    extra = _measure(recipe, cfg, data, seed, s["checkpoint"]) if s.get("checkpoint") else {}
    at = {}
    if b.get("eval_seq_lens"):           # the final model at other lengths (positions beyond training: WM table 1)
        model, _ = load_checkpoint(s["checkpoint"])
        for n in b["eval_seq_lens"]:
            at[str(n)] = validate(model.float().eval(), data.tokens("val"), tok, seq_len=n, batch_size=1,
                                  max_tokens=b["eval_tokens"] or None)["loss"]
    if not keep_checkpoints and s.get("checkpoint"):
        shutil.rmtree(s["checkpoint"], ignore_errors=True)
    res = {k: s.get(k) for k in ("val_loss", "val_tokens", "tokens_per_s", "indexer_kl")} | extra | key | {
        "wall_s": wall, "val_loss_at": at, "seed": seed}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, path)
    return res


def _run_budget(b: dict) -> dict:
    """What a single run's result depends on (the seed list does not: adding seeds reuses the runs done)."""
    return {k: v for k, v in b.items() if k != "seeds"}


def _stats(values: list[float]) -> tuple[float, float | None]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def _measure(recipe: Recipe, cfg, data, seed: int, ckpt: str) -> dict:
    """The recipe's `measure` figures of one trained model. captured_mass: the attention mass its indexed layers' top-k
    keep on the validation split, with the trained indexers and with the indexers put back to their initialisation
    (`train` seeds torch with the run's seed right before building the model: the same draw is made here)."""
    from ..models.registry import has_indexer
    if "captured_mass" not in recipe.measure or not has_indexer(cfg):
        return {}
    import torch

    from ..eval.attention_recall import captured_mass
    from ..models import CausalLM
    from ..checkpoint import load_checkpoint
    b = recipe.budget
    model, _ = load_checkpoint(ckpt)
    kw = dict(seq_len=b["seq_len"], batch_size=b["batch_size"], max_tokens=b["eval_tokens"] or 32_768, seed=seed)
    after = captured_mass(model, data.tokens("val"), data.tokenizer, **kw)
    torch.manual_seed(seed)
    init = {n: p for n, p in CausalLM(cfg).state_dict().items() if ".indexer." in n}
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in init:
                p.copy_(init[n])
    before = captured_mass(model, data.tokens("val"), data.tokenizer, **kw)
    return {"captured_mass": after["mass"], "captured_mass_init": before["mass"], "captured_oracle": after["oracle"],
            "captured_random": after["random"]}


def _quick(recipe: Recipe) -> Recipe:
    """The smoke run's recipe: QUICK's budget, width 32, no sizing; a configuration's own train fields may not
    undo it."""
    return Recipe(**{**recipe.__dict__, "budget": dict(recipe.budget, **QUICK, params=None, **(
        {"eval_seq_lens": QUICK_EVAL_SEQ_LENS} if recipe.budget.get("eval_seq_lens") else {})),
                     "model": dict(recipe.model, d_model=32),
                     "configs": [RunConfig(**{**c.__dict__, "params": None,
                                              "train": {k: v for k, v in c.train.items() if k not in QUICK},
                                              "fields": {k: v for k, v in c.fields.items() if k != "d_model"}})
                                 for c in recipe.configs]})


def _summarise(c, cfg, params: int, runs: list[dict], b: dict, seeds: list[int]) -> dict:
    """One table row from a configuration's runs (one per seed): means and seed standard deviations."""
    from ..models.sizing import count_parameters, token_mixers
    losses = [r["val_loss"] for r in runs]
    mean, std = _stats(losses)
    at = {n: _stats([r["val_loss_at"][n] for r in runs]) for n in runs[0]["val_loss_at"]}
    row = dict(name=c.name, layout=cfg.layout, params=params, active_params=count_parameters(cfg, active=True),
               d_model=cfg.d_model, mixer_layers=token_mixers(cfg), val_loss=mean, val_loss_std=std,
               val_losses=losses, val_ppl=math.exp(min(mean, 50.0)), val_tokens=runs[0]["val_tokens"],
               tokens_per_s=statistics.fmean(r["tokens_per_s"] for r in runs), steps=b["steps"],
               wall_s=statistics.fmean(r["wall_s"] for r in runs), seeds=seeds, note=c.note,
               **({"val_loss_at": {n: m for n, (m, _) in at.items()},
                   "val_loss_at_std": {n: sd for n, (_, sd) in at.items()}} if at else {}))
    for key in MEASURED:
        vals = [r[key] for r in runs if r.get(key) is not None]
        if vals:
            row[key], sd = _stats(vals)
            if key == "captured_mass" and sd is not None:
                row["captured_mass_std"] = sd
    return row


def _log_row(row: dict, log) -> None:
    std = row["val_loss_std"]
    log(f"        val loss {row['val_loss']:.4f}" + (f" ± {std:.4f}" if std is not None else "") +
        f" (ppl {row['val_ppl']:.3f}) on {row['val_tokens']:,} tokens, {row['tokens_per_s']:,.0f} tokens/s, "
        f"{row['wall_s']:.0f} s")
    if "captured_mass" in row:
        log(f"        captured attention mass {row['captured_mass']:.3f} (indexer at init "
            f"{row['captured_mass_init']:.3f}, best k keys {row['captured_oracle']:.3f}, random k keys "
            f"{row['captured_random']:.3f})")


def run_recipe(recipe: Recipe, out_dir: str, *, quick: bool = False, seeds: list[int] | None = None,
               device: str = "auto", progress: bool = True, keep_checkpoints: bool = True, log=print) -> dict:
    """Train every configuration of `recipe` and write the table, CSV and curves under `out_dir`."""
    from ..data.corpus import load_corpus
    from ..data.loader import TokenData
    from ..data.tokenizer import load_tokenizer
    recipe = _quick(recipe) if quick else recipe
    b = recipe.budget
    seeds = list(seeds or b["seeds"])
    corpus = load_corpus(None, max_bytes=b["max_bytes"])
    tok = load_tokenizer("byte")
    data = TokenData.from_corpus(corpus, tok)
    sized = [(c, *recipe.model_config(c, tok.vocab_size)) for c in recipe.configs]   # all sizing errors up front
    log(f"recipe  {recipe.name}: {recipe.title}")
    log(f"budget  {b['steps']} steps x {b['batch_size']}x{b['seq_len']} tokens, lr {b['lr']}, seeds {seeds}; "
        f"{len(data.tokens('train')):,} train / {len(data.tokens('val')):,} validation tokens (built-in corpus, bytes)"
        + (f"; every model sized to {b['params']:,} {'active ' if b['active'] else ''}parameters by "
           f"{b['size_by']} (±{b['tolerance']:.0%})" if b.get("params") else ""))
    os.makedirs(out_dir, exist_ok=True)
    run_dir = lambda name, seed: os.path.join(out_dir, name) if len(seeds) == 1 else \
        os.path.join(out_dir, name, f"seed{seed}")
    rows = []
    for c, cfg, params in sized:
        log(f"run     {c.name}: layout {cfg.layout}, d_model {cfg.d_model}, {params:,} parameters")
        runs = []
        for seed in seeds:
            runs.append(_train_one(recipe, c, cfg, data, tok, seed, run_dir(c.name, seed), device, progress,
                                   keep_checkpoints))
            log(f"        seed {seed}: val loss {runs[-1]['val_loss']:.4f}" + "".join(
                f", at {n}: {v:.4f}" for n, v in runs[-1]["val_loss_at"].items()))
        rows.append(_summarise(c, cfg, params, runs, b, seeds))
        _log_row(rows[-1], log)
    res = {"meta": dict(machine_meta(), quick=quick, recipe_path=recipe.path, budget=b,
                        minutes_per_model=recipe.minutes_per_model, source=recipe.source, model=recipe.model),
           "recipe": recipe.name, "title": recipe.title, "source": recipe.source, "claims": recipe.claims,
           "rows": rows}
    write_outputs(res, out_dir, [run_dir(r["name"], seeds[0]) for r in rows])
    return res


def format_table(res: dict) -> str:
    lines = [f"{res['title']}  ({res['source']})",
             f"{'configuration':22s} {'params':>9s} {'d':>4s} {'val loss':>9s} {'val ppl':>8s} {'tok/s':>7s} "
             f"{'wall s':>7s}  layout"]
    for r in res["rows"]:
        std = f"±{r['val_loss_std']:.3f}" if r.get("val_loss_std") is not None else ""
        lines.append(f"{r['name']:22s} {r['params']:9,d} {r['d_model']:4d} {r['val_loss']:9.4f}{std} "
                     f"{r['val_ppl']:8.3f} {r['tokens_per_s']:7.0f} {r['wall_s']:7.0f}  {r['layout']}")
    mass = [r for r in res["rows"] if r.get("captured_mass") is not None]
    if mass:
        lines.append("captured attention mass of the top-k (dense attention's mass on the selected keys):")
        for r in mass:
            std = f"±{r['captured_mass_std']:.3f}" if r.get("captured_mass_std") is not None else ""
            kl = f", final indexer KL {r['indexer_kl']:.4f}" if r.get("indexer_kl") is not None else ""
            lines.append(f"  {r['name']:22s} {r['captured_mass']:.3f}{std} (indexer at init "
                         f"{r['captured_mass_init']:.3f}, best k keys {r['captured_oracle']:.3f}, random "
                         f"{r['captured_random']:.3f}{kl})")
    lines.append(f"validation on {res['rows'][0]['val_tokens']:,} tokens" if res["rows"] else "no rows")
    return "\n".join(lines)


def write_outputs(res: dict, out_dir: str, run_dirs: list[str]):
    with open(os.path.join(out_dir, "ablate.json"), "w") as f:
        json.dump(res, f, indent=2)
    with open(os.path.join(out_dir, "ablate.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=ROW_KEYS, extrasaction="ignore")
        w.writeheader()
        for r in res["rows"]:
            w.writerow(dict(r, seeds=" ".join(map(str, r["seeds"])), val_losses=" ".join(f"{v:.4f}" for v in
                                                                                       r["val_losses"])))
    plot_curves([r["name"] for r in res["rows"]], run_dirs, os.path.join(out_dir, "curves.png"), res["title"])


def read_metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise ConfigError(f"no metrics.jsonl in {run_dir}")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_curves(names: list[str], run_dirs: list[str], path: str, title: str = ""):
    """Training loss (lines) and validation loss (markers) of each run against tokens seen."""
    from ..plots import pyplot
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, d) in enumerate(zip(names, run_dirs)):
        rows = read_metrics(d)
        color = f"C{i % 10}"
        ax.plot([r["tokens"] for r in rows], [r["loss"] for r in rows], color=color, lw=1, alpha=0.8, label=name)
        val = [r for r in rows if r.get("val_loss") is not None]
        ax.plot([r["tokens"] for r in val], [r["val_loss"] for r in val], "o", color=color, ms=5)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("loss (nats/token); dots: validation")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
