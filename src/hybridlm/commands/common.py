"""Helpers shared by the command modules: output on rank 0, model config from --preset/--set, sizes."""
import json
import os


def is_main_rank() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def out(*parts):
    if is_main_rank():
        print(*parts, flush=True)


def parse_sets(items: list[str]) -> dict:
    """["layout=(AM)*2", "n_heads=4"] -> {"layout": "(AM)*2", "n_heads": 4} (values JSON-parsed if possible)."""
    from ..errors import InputError
    out = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise InputError(f"--set expects field=value, got {item!r}")
        try:
            out[key.strip().replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip().replace("-", "_")] = value
    return out


def model_config(args, vocab_size: int, seq_len: int | None = None):
    """The preset with --n-layers/--d-model/--set applied; max_seq_len grows to cover seq_len."""
    from .. import presets
    over = parse_sets(args.set)
    if args.n_layers is not None:
        over["n_layers"] = args.n_layers
    if args.d_model is not None:
        over["d_model"] = args.d_model
    over.setdefault("vocab_size", vocab_size)
    cfg = presets.get(args.preset, **over)
    if seq_len is not None and cfg.max_seq_len < seq_len and "max_seq_len" not in over:
        cfg = cfg.replace(max_seq_len=seq_len)
    return cfg


def add_model_args(p, preset_default: str | None = "mamba2-attention"):
    p.add_argument("--preset", default=preset_default,
                   help=f"named model configuration (default: {preset_default}); see `hybridlm info --list`")
    p.add_argument("--n-layers", type=int, help="depth in units of the preset's repeating block")
    p.add_argument("--d-model", type=int, help="model width")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override any ModelConfig field; VALUE is JSON-parsed (repeatable), e.g. --set layout='(AM)*2'")


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def count(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K" if n >= 1e3 else str(n)


def layout_summary(cfg) -> str:
    from ..models.layout import flatten, parse_layout
    from ..models.registry import LETTERS
    letters = flatten(parse_layout(cfg.layout, LETTERS.keys()))
    counts = ", ".join(f"{letters.count(c)} {c}" for c in sorted(set(letters)))
    return f"{cfg.layout}  ({len(letters)} layers: {counts})"


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
