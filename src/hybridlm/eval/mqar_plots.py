"""The MQAR sweep's plots: accuracy against d_model and against state bytes, held-out accuracy against steps, and
Rodimus' figure 1b (accuracy against state bytes, one line per family)."""
import os
import textwrap

from ..plots import pyplot
from .mqar_sweep import FAMILIES, _family, state_size_points


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


def write_plots(out_dir: str, rows: list[dict], trials: list[dict], settings: dict, log=print):
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
    log(f"wrote {os.path.join(out_dir, 'mqar.json')}, mqar.csv, {', '.join(wrote)}")


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
