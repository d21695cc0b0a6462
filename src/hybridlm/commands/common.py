"""Helpers shared by the command modules: output on rank 0, model config from --preset/--set, sizes."""
import os

from ..jsonio import parse_sets  # noqa: F401  (the commands take it from here)


def is_main_rank() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def out(*parts):
    if is_main_rank():
        print(*parts, flush=True)


def model_config(args, vocab_size: int, seq_len: int | None = None):
    """The preset with --n-layers/--d-model/--n-heads/--set applied. Unless max_seq_len is set, a learned
    position table is sized to `seq_len` (the context trained on; it cannot extrapolate) and other models'
    max_seq_len grows to cover it."""
    from ..models import presets
    over = parse_sets(args.set)
    for flag in ("n_layers", "d_model", "n_heads"):
        if getattr(args, flag, None) is not None:
            over[flag] = getattr(args, flag)
    over.setdefault("vocab_size", vocab_size)
    if getattr(args, "params", None):
        cfg = sized_config(args.preset, args.params, over)
    else:
        cfg = presets.get(args.preset, **over)
    if seq_len is not None and "max_seq_len" not in over:
        if cfg.pos_embedding == "learned":
            cfg = cfg.replace(max_seq_len=seq_len)
        elif cfg.max_seq_len < seq_len:
            cfg = cfg.replace(max_seq_len=seq_len)
    return cfg


def sized_config(preset: str, params: str, over: dict):
    """The preset at the d_model (a multiple of 64) whose parameter count is nearest `params` ("1B", "350M"),
    within 10%, at the depth it has (or --n-layers)."""
    from ..errors import InputError
    from ..models import presets
    from ..models.sizing import fit_params, parse_count
    if "d_model" in over:
        raise InputError("give --params or --d-model, not both (--params sizes d_model)")
    cfg, _ = fit_params(lambda d: presets.get(preset, **over, d_model=d), parse_count(params), range(64, 16385, 64),
                        what="d_model")
    return cfg


def config_diff(cfg, default) -> str:
    """'field=value, ...' for the fields of dataclass `cfg` that differ from `default`'s."""
    from dataclasses import fields
    items = [(f.name, getattr(cfg, f.name)) for f in fields(cfg) if getattr(cfg, f.name) != getattr(default, f.name)]
    return ", ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in items) or "(defaults)"


def param_split(model) -> str:
    """'1.12M parameters: embeddings 0.07M, position table 0.26M, blocks 0.79M, lm_head 0.07M (untied)'."""
    emb = model.embed.weight.numel()
    pos = model.pos_embed.weight.numel() if model.pos_embed is not None else 0
    head = 0 if model.lm_head.weight is model.embed.weight else model.lm_head.weight.numel()
    total = model.num_parameters()
    parts = [f"embeddings {count(emb)}"] + ([f"position table {count(pos)}"] if pos else [])
    parts += [f"blocks {count(total - emb - pos - head)}", f"lm_head {count(head)}" if head else "lm_head tied"]
    return f"{count(total)} parameters: " + ", ".join(parts)


def add_model_args(p, preset_default: str | None = "mamba2-attention"):
    p.add_argument("--preset", default=preset_default,
                   help=f"named model configuration (default: {preset_default}); see `hybridlm info --list`")
    p.add_argument("--n-layers", type=int, help="depth in units of the preset's repeating block")
    p.add_argument("--d-model", type=int, help="model width")
    p.add_argument("--params", metavar="N", help="size d_model (a multiple of 64) to about N parameters, e.g. 1B or "
                   "350M, at the preset's depth or --n-layers")
    p.add_argument("--n-heads", type=int, help="attention heads (query heads)")
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


def add_tokenizer_arg(p):
    p.add_argument("--tokenizer", default=None, metavar="DIR_OR_FILE",
                   help="use this tokenizer instead of the checkpoint's (a directory saved by hybridlm or transformers, "
                        "or a tokenizer.json)")


def other_tokenizer(spec: str, vocab_size: int):
    """The tokenizer at `spec`, checked to fit a model of `vocab_size` ids."""
    from ..data.tokenizer import check_fits, load_tokenizer
    if spec.startswith("bpe:"):
        from ..errors import InputError
        raise InputError("--tokenizer here takes a saved tokenizer (directory or tokenizer.json), not bpe:N")
    tok = load_tokenizer(spec)
    check_fits(tok, vocab_size, spec)
    return tok



def add_quantize_args(p):
    p.add_argument("--quantize", choices=["int8", "int4"], default=None,
                   help="weight-only quantization of the linear layers (int8: per output channel; int4: per group of "
                        "--group-size inputs); a checkpoint saved quantized loads as it is")
    p.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128], help="int4 group size (default 64)")


def quantized(model, args):
    """`model` with --quantize applied (models/quantize.py; a no-op on a checkpoint already quantized so)."""
    if getattr(args, "quantize", None):
        from ..models.quantize import quantize_
        quantize_(model, args.quantize, args.group_size)
    return model
