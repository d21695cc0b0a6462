"""`hybridlm bench`: throughput, decode latency, state size, peak memory and MFU of any presets at one stated
depth and size (bench/instrument.py), or side by side with transformers (`--compare-hf`), or a named suite of
bench/registry.py (`--suite NAME`, its flags listed below). Results go to stdout as a table and to a JSON file, with
PNG plots (or a markdown page) next to it.

    hybridlm bench --compare-hf                 # ours vs transformers Llama / Mamba2, full sizes
    hybridlm bench --compare-hf --quick         # tiny smoke version (seconds)
    hybridlm bench --presets transformer++,mamba2,rodimus --params 10M --layers 4 --shapes 4x512,1x16384
    hybridlm bench --presets mamba2 --vocab-size 32768 --shapes 1x16384 --memory   # training-step peak memory
    hybridlm bench --presets mamba2,rodimus --params 125M --layers 24 --shapes 8x2048 --device cuda --dtype bfloat16
    hybridlm bench --suite kernels              # our Triton SSD / GLA kernels vs mamba_ssm / FLA (CUDA)
    hybridlm bench --suite gpu [--dry-run]      # every GPU claim in one run (bench/gpu; scripts/gpu-check.sh)
"""
import argparse
import os

import torch

from ..bench import registry
from ..bench.measure import write_results

DEFAULT_OUT = os.path.join("runs", "bench", "results.json")


def _count(text: str) -> int | str:
    """--params: a count such as 10M; '' drops a suite's default size (its --d-model decides)."""
    from ..errors import ConfigError
    from ..models.sizing import parse_count
    if not text.strip():
        return ""
    try:
        return parse_count(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("--compare-hf", action="store_true",
                   help="measure ours vs transformers LlamaForCausalLM / Mamba2ForCausalLM (same config and "
                        "weights), interleaved in one run, and report ratios")
    p.add_argument("--quick", action="store_true", help="tiny sizes and few repeats: a smoke test in seconds")
    p.add_argument("--out", default=None, help=f"JSON results file (default {DEFAULT_OUT}; a suite's: "
                   "runs/bench/NAME.json); plots or the markdown page are written next to it")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    p.add_argument("--archs", default="llama,mamba2", help="--compare-hf: which of llama,mamba2 to compare")
    p.add_argument("--presets", default=None,
                   help="without --compare-hf: comma-separated presets to measure (default transformer++,mamba2; "
                        "--suite twins: all twins)")
    p.add_argument("--d-model", type=int, default=None, help="model width (default 256; quick 64)")
    p.add_argument("--layers", "--n-layers", dest="n_layers", type=int, default=None,
                   help="token-mixer layers (attention, SSD, Rodimus, ...; MLP/MoE not counted) of every preset: "
                        "the smallest repeat count with at least this many (default 4; quick 2)")
    p.add_argument("--params", type=_count, default=None,
                   help="size every preset's width to this many parameters (e.g. 10M; within 10%%) instead of "
                        "--d-model")
    p.add_argument("--compile", action="store_true", default=None,
                   help="also time torch.compile'd forward and forward+backward")
    p.add_argument("--device", default=None, help="without --compare-hf: cpu (default), cuda or cuda:N")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default=None,
                   help="without --compare-hf: bfloat16/float16 run every step under autocast (float32 weights, "
                        "as mixed-precision training); MFU is against the matmul peak in this dtype. auto "
                        "(default): bfloat16 on CPUs with AMX-BF16 or AVX512-BF16 and GPUs with bf16, else float32; "
                        "--compare-hf always runs float32")
    p.add_argument("--memory", action=argparse.BooleanOptionalAction, default=None,
                   help="peak memory of each step in a fresh process (default on; off with --quick)")
    p.add_argument("--vocab-size", type=int, default=None, help="vocabulary size (default 8192; quick 512)")
    p.add_argument("--shapes", type=registry.shapes, default=None,
                   help="training batch shapes BATCHxLEN,... (default 4x512,1x2048,1x16384; --compare-hf "
                        "4x512,1x2048; quick 2x32,1x64)")
    p.add_argument("--context", type=int, default=None, help="decode benchmark prompt length (default 1024; quick 32)")
    p.add_argument("--new-tokens", type=int, default=None, help="decode benchmark new tokens (default 64; quick 6)")
    p.add_argument("--latency-contexts", type=registry.ints, default=None,
                   help="contexts for per-token decode latency and state bytes (default 128,1024,8192; "
                        "--compare-hf 128,8192; quick 16,256)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per measurement (default 5; quick 2)")
    p.add_argument("--no-compile", action="store_true",
                   help="skip the torch.compile'd decode rows (compilation needs a C++ compiler and ~10 s)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--quantize", choices=["int8", "int4"], default=None,
                   help="decode latency rows with int8 / int4 weights (training rows stay float); --suite quantize "
                        "puts float, int8 and int4 side by side")
    p.add_argument("--group-size", type=int, default=None, choices=[32, 64, 128],
                   help="int4 group size (default 64)")
    p.add_argument("--suite", choices=sorted(registry.SUITES), default=None, metavar="NAME",
                   help="run a named suite instead (--quick applies): "
                        + "; ".join(f"{n}: {s.what}" for n, s in registry.SUITES.items()))
    registry.add_flags(p.add_argument_group("suite flags (each applies to the suites it names)"))


def _settings(args) -> dict:
    """The instrument's (or --compare-hf's) settings from its defaults and the flags given."""
    if args.compare_hf:
        from ..bench.compare_hf import FULL, QUICK
    else:
        from ..bench.instrument import FULL, QUICK
    s = dict(QUICK if args.quick else FULL)
    for key, val in (("d_model", args.d_model), ("n_layers", args.n_layers), ("vocab_size", args.vocab_size),
                     ("shapes", args.shapes), ("context", args.context), ("new_tokens", args.new_tokens),
                     ("latency_contexts", args.latency_contexts), ("repeats", args.repeats)):
        if val is not None:
            s[key] = list(val) if key == "shapes" else val
    if args.repeats is not None:
        s["decode_repeats"] = max(1, args.repeats)
    if args.no_compile:
        s["decode_compile"] = False
    if not args.compare_hf:
        s["layers"] = s.pop("n_layers", None) or s["layers"]
        s.pop("context", None), s.pop("new_tokens", None)
        s.update(compile=bool(args.compile), params=args.params, device=args.device or "cpu",
                 dtype=args.dtype or "auto", quantize=args.quantize, group_size=args.group_size or 64)
        if s["dtype"] == "auto":
            from ..dtypes import resolve_dtype
            s["dtype"], label = resolve_dtype("auto", s["device"])
            print(f"dtype   {label}")
        if args.params:
            s["d_model"] = None
        if args.memory is not None:
            s["memory"] = args.memory
    return s


def main(args) -> int:
    from ..errors import ConfigError
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.suite:
        s = registry.settings(args.suite, quick=args.quick, out=args.out, **registry.given(args))
        return registry.run_suite(args.suite, s)
    own = {"presets", "d_model", "n_layers", "vocab_size", "shapes", "context", "repeats", "compile", "dtype",
           "group_size"}                                  # suite keys the instrument takes too
    stray = [registry.flag(k) for k in registry.given(args) if k not in own]
    if stray:
        raise ConfigError(f"{', '.join(stray)} apply to a --suite (see hybridlm bench --help)")
    if args.compare_hf and (args.params or args.compile or args.memory or args.device not in (None, "cpu")
                            or args.dtype not in (None, "auto", "float32")):
        raise ConfigError("--params, --compile, --memory, --device and --dtype apply to the preset instrument, "
                          "not to --compare-hf")
    out_path = args.out or DEFAULT_OUT
    settings = _settings(args)
    if args.compare_hf:
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise ConfigError("--compare-hf needs transformers: pip install 'hybridlm[hf]'") from None
        from ..bench.compare_hf import format_table, plot, run_compare
        archs = [a.strip() for a in args.archs.split(",") if a.strip()]
        bad = [a for a in archs if a not in ("llama", "mamba2")]
        if bad or not archs:
            raise ConfigError(f"--archs must name llama and/or mamba2, got {args.archs!r}")
        res = dict(run_compare(settings, archs=archs, log=print), mode="compare-hf")
        draw, table = (lambda stem: [plot(res, stem + ".png")]), format_table
    else:
        from ..bench import instrument
        names = [n.strip() for n in (args.presets or "transformer++,mamba2").split(",") if n.strip()]
        res = dict(instrument.run_instrument(settings, names, log=print), mode="ours", settings=settings)
        draw, table = (lambda stem: instrument.plot(res, stem)), instrument.format_table
    print()
    print(table(res))
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    res["plots"] = [] if args.no_plot else draw(os.path.splitext(out_path)[0])
    res["plot"] = res["plots"][0] if res["plots"] else None
    if args.no_plot:
        res["plot_note"] = "plot skipped (--no-plot)"
        print(res["plot_note"])
    write_results(out_path, res, registry.meta(args.quick))
    if res["plots"]:
        print(f"plots: {', '.join(res['plots'])}")
    return 0
