"""`hybridlm report`: docs/results.md from the outputs of `hybridlm ablate`, `mqar` and `bench`."""
from .common import out


def main(args) -> int:
    import os

    from ..bench.report import collect, render
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
