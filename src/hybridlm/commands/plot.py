"""`hybridlm plot RUN... --out FILE.png`: training and validation curves of several runs on one PNG.

Each RUN is a run directory holding the trainer's metrics.jsonl (or the metrics.jsonl file itself). Training loss
is drawn solid and validation loss as dots joined dashed, in the run's colour, against optimizer steps.
"""
import json
import os

from ..plots import pyplot
from .common import out


def add_arguments(p):
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories (with metrics.jsonl) or metrics files")
    p.add_argument("--out", default="curves.png", help="PNG to write (default: curves.png)")
    p.add_argument("--metric", choices=("loss", "val_loss"), default=None,
                   help="draw only this curve (default: both training and validation loss)")
    p.add_argument("--title", default=None)


def read_metrics(run: str) -> list[dict]:
    """The rows of a run's metrics.jsonl (one JSON object per logged step)."""
    from ..errors import InputError
    path = os.path.join(run, "metrics.jsonl") if os.path.isdir(run) else run
    if not os.path.isfile(path):
        raise InputError(f"no metrics.jsonl in {run!r} (is it a `hybridlm train --out` directory?)")
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    raise InputError(f"{path}:{n} is not a JSON line") from None
    if not any("step" in r for r in rows):
        raise InputError(f"{path} has no logged steps")
    return rows


def curve(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None and "step" in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def main(args) -> int:
    from ..errors import InputError
    metrics = ("loss", "val_loss") if args.metric is None else (args.metric,)
    runs = [(os.path.basename(os.path.normpath(r)) or r, read_metrics(r)) for r in args.runs]
    if not any(curve(rows, m)[0] for _, rows in runs for m in metrics):
        raise InputError(f"none of the runs logged {' or '.join(metrics)}")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (name, rows) in enumerate(runs):
        colour = f"C{i % 10}"
        for m in metrics:
            x, y = curve(rows, m)
            if not x:
                continue
            style = dict(ls="--", marker="o", ms=3) if m == "val_loss" else dict(lw=1.2)
            ax.plot(x, y, color=colour, label=f"{name} ({'val' if m == 'val_loss' else 'train'})", **style)
    ax.set_xlabel("step")
    ax.set_ylabel("loss" if len(metrics) > 1 else metrics[0])
    ax.set_title(args.title or "training curves")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=120)
    plt.close(fig)
    out(f"wrote {args.out} ({len(runs)} runs)")
    return 0
