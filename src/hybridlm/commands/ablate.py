"""`hybridlm ablate RECIPE`: a paper's ablation table at small scale, one command (recipes: `--list`)."""
from .common import out


def main(args) -> int:
    from ..errors import ConfigError
    from ..train.recipes import list_recipes, load_recipe
    if args.list:
        for name, title in list_recipes().items():
            r = load_recipe(name)
            out(f"{name:<24} {len(r.configs)} models, ~{r.minutes_per_model:g} min each on 2 CPU cores: {title}")
        return 0
    if not args.recipe:
        raise ConfigError("name a recipe (see `hybridlm ablate --list`) or a .toml path")
    import torch

    from ..train.ablate import format_table, run_recipe
    if args.threads:
        torch.set_num_threads(args.threads)
    recipe = load_recipe(args.recipe).scaled(args.scale)
    out_dir = args.out or f"runs/ablate/{recipe.name}"
    res = run_recipe(recipe, out_dir, quick=args.quick, seeds=args.seeds, device=args.device,
                     progress=not args.no_progress, keep_checkpoints=not args.no_checkpoints, log=out)
    out()
    out(format_table(res))
    stated = 60 * recipe.minutes_per_model
    slow = [r["name"] for r in res["rows"] if r["wall_s"] > stated]
    if slow and not args.quick:
        out(f"note    over the recipe's stated {recipe.minutes_per_model:g} min per model: {', '.join(slow)}")
    out(f"results {out_dir}/ablate.json, ablate.csv, curves.png")
    return 0


def _seeds(text: str) -> list[int]:
    import argparse
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds expects comma-separated integers, got {text!r}") from None


def add_arguments(p):
    p.add_argument("recipe", nargs="?", help="a shipped recipe name (see --list) or a path to a recipe .toml")
    p.add_argument("--list", action="store_true", help="list the shipped recipes and exit")
    p.add_argument("--out", default=None, help="output directory (default runs/ablate/RECIPE)")
    p.add_argument("--scale", type=int, default=1,
                   help="multiply batch, depth and width by K (a parameter budget by K^3): the GPU-sized run")
    p.add_argument("--seeds", type=_seeds, default=None, help="override the recipe's seeds, e.g. 0,1,2")
    p.add_argument("--quick", action="store_true", help="a smoke run: 3 steps at d_model 32 (no sizing)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--no-checkpoints", action="store_true", help="delete each run's checkpoint after it finishes")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
