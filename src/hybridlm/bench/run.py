"""`hybridlm bench`: throughput, decode latency, state size, peak memory and MFU of any presets at one stated
depth and size (bench/instrument.py), or side by side with transformers (`--compare-hf`), or a named suite.
Results go to stdout as a table and to a JSON file, with PNG plots next to it.

    hybridlm bench --compare-hf                 # ours vs transformers Llama / Mamba2, full sizes
    hybridlm bench --compare-hf --quick         # tiny smoke version (seconds)
    hybridlm bench --presets transformer++,mamba2,rodimus --params 10M --layers 4 --shapes 4x512,1x16384
    hybridlm bench --presets mamba2 --vocab-size 32768 --shapes 1x16384 --memory   # training-step peak memory
    hybridlm bench --presets mamba2,rodimus --params 125M --layers 24 --shapes 8x2048 --device cuda --dtype bfloat16
    hybridlm bench --kernels                    # our Triton SSD / GLA kernels vs mamba_ssm / FLA (CUDA)
    hybridlm bench --suite gpu [--dry-run]      # every GPU claim in one run (bench/gpu.py; scripts/gpu-check.sh)
"""
import argparse
import os

import torch

from .measure import write_results
from .suites import SUITES

DEFAULT_OUT = os.path.join("runs", "bench", "results.json")


def _shapes(text: str) -> list[tuple[int, int]]:
    try:
        out = []
        for item in text.split(","):
            b, t = item.lower().split("x")
            out.append((int(b), int(t)))
        return out
    except ValueError:
        raise argparse.ArgumentTypeError(f"shapes are BATCHxLEN[,BATCHxLEN...], got {text!r}") from None


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _count(text: str) -> int:
    from ..errors import ConfigError
    from ..models.sizing import parse_count
    try:
        return parse_count(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("--compare-hf", action="store_true",
                   help="measure ours vs transformers LlamaForCausalLM / Mamba2ForCausalLM (same config and "
                        "weights), interleaved in one run, and report ratios")
    p.add_argument("--quick", action="store_true", help="tiny sizes and few repeats: a smoke test in seconds")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"JSON results file (default {DEFAULT_OUT}); the plot is "
                   "written next to it with a .png suffix")
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
    p.add_argument("--compile", action="store_true", help="also time torch.compile'd forward and forward+backward")
    p.add_argument("--device", default="cpu", help="without --compare-hf: cpu (default), cuda or cuda:N")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="without --compare-hf: bfloat16/float16 run every step under autocast (float32 weights, "
                        "as mixed-precision training); MFU is against the matmul peak in this dtype. auto "
                        "(default): bfloat16 on CPUs with AMX-BF16 or AVX512-BF16 and GPUs with bf16, else float32; "
                        "--compare-hf always runs float32")
    p.add_argument("--memory", action=argparse.BooleanOptionalAction, default=None,
                   help="peak memory of each step in a fresh process (default on; off with --quick)")
    p.add_argument("--vocab-size", type=int, default=None, help="vocabulary size (default 8192; quick 512)")
    p.add_argument("--shapes", type=_shapes, default=None,
                   help="training batch shapes BATCHxLEN,... (default 4x512,1x2048,1x16384; --compare-hf "
                        "4x512,1x2048; quick 2x32,1x64)")
    p.add_argument("--context", type=int, default=None, help="decode benchmark prompt length (default 1024; quick 32)")
    p.add_argument("--new-tokens", type=int, default=None, help="decode benchmark new tokens (default 64; quick 6)")
    p.add_argument("--latency-contexts", type=_ints, default=None,
                   help="contexts for per-token decode latency and state bytes (default 128,1024,8192; "
                        "--compare-hf 128,8192; quick 16,256)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per measurement (default 5; quick 2)")
    p.add_argument("--no-compile", action="store_true",
                   help="skip the torch.compile'd decode rows (compilation needs a C++ compiler and ~10 s)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--quantize", choices=["int8", "int4"], default=None,
                   help="decode latency rows with int8 / int4 weights (training rows stay float); --suite quantize "
                        "puts float, int8 and int4 side by side")
    p.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128], help="int4 group size (default 64)")
    p.add_argument("--kernels", action="store_true",
                   help="time our Triton SSD and GLA chunk kernels, forward and forward+backward, against "
                        "mamba_ssm / flash-linear-attention when installed (needs CUDA and triton; --shapes, "
                        "--repeats and --quick apply)")
    p.add_argument("--suite", choices=sorted(SUITES), default=None, metavar="NAME",
                   help="run a named suite instead (--quick applies): "
                        + "; ".join(f"{n}: {what}" for n, (_, what) in SUITES.items()))
    p.add_argument("--dry-run", action="store_true",
                   help="--suite gpu: run every part on the CPU at tiny sizes under Triton's interpreter (~1 minute)")
    p.add_argument("--parts", default=None, metavar="PART,...",
                   help="--suite gpu: only these parts (correctness, kernels, training, decode, memory, steps)")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="--suite gpu: scale the parts' time budgets to add up to this (default ~400 s on a GPU)")


def _settings(args) -> dict:
    if args.compare_hf:
        from .compare_hf import FULL, QUICK
    else:
        from .instrument import FULL, QUICK
    s = dict(QUICK if args.quick else FULL)
    for key, val in (("d_model", args.d_model), ("n_layers", args.n_layers), ("vocab_size", args.vocab_size),
                     ("shapes", args.shapes), ("context", args.context), ("new_tokens", args.new_tokens),
                     ("latency_contexts", args.latency_contexts), ("repeats", args.repeats)):
        if val is not None:
            s[key] = val
    if args.repeats is not None:
        s["decode_repeats"] = max(1, args.repeats)
    if args.no_compile:
        s["decode_compile"] = False
    if not args.compare_hf:
        s["layers"] = s.pop("n_layers", None) or s["layers"]
        s.pop("context", None), s.pop("new_tokens", None)
        s.update(compile=args.compile, params=args.params, device=args.device, dtype=args.dtype,
                 quantize=args.quantize, group_size=args.group_size)
        if args.dtype == "auto":
            from ..dtypes import resolve_dtype
            s["dtype"], label = resolve_dtype("auto", args.device)
            print(f"dtype   {label}")
        if args.params:
            s["d_model"] = None
        if args.memory is not None:
            s["memory"] = args.memory
    return s


def _suite_options(args) -> dict:
    """The instrument's flags a suite takes (as keyword arguments: twins takes --presets, --d-model, --layers,
    --vocab-size, --shapes, --repeats); one given to a suite that does not take it is an error."""
    import inspect

    from ..errors import ConfigError
    given = {k: getattr(args, k) for k in ("presets", "d_model", "n_layers", "vocab_size", "shapes", "repeats")
             if getattr(args, k) is not None}
    takes = inspect.signature(SUITES[args.suite][0]).parameters
    bad = [k for k in given if k not in takes]
    if bad:
        raise ConfigError(f"--suite {args.suite} does not take {', '.join('--' + k.replace('_', '-') for k in bad)}")
    return given


def _meta(args) -> dict:
    from ..runtime import machine_meta
    try:
        import transformers
    except ImportError:
        transformers = None
    return dict(machine_meta(), quick=bool(args.quick), transformers=transformers and transformers.__version__)


# ---------------------------------------------------------------------------------------------------
# output

def format_table(res: dict) -> str:
    """The --compare-hf table (the instrument's own is instrument.format_table)."""
    lines = ["training (forward+backward), tokens/s, medians of interleaved repeats"]
    lines.append(f"{'arch':8s} {'batch':>9s} {'ours':>9s} {'hf':>9s} {'ratio':>6s} {'MFU ours':>9s} {'MFU hf':>7s}")
    for r in res["train"]:
        lines.append(f"{r['arch']:8s} {str(r['batch']) + 'x' + str(r['seq_len']):>9s} "
                     f"{r['ours_tokens_per_s']:9.0f} {r['hf_tokens_per_s']:9.0f} {r['ratio']:6.2f} "
                     f"{r['ours_mfu']:9.3f} {r['hf_mfu']:7.3f}")
    lines.append("")
    lines.append("greedy decode, batch 1 (first to last new token; prefill excluded); transformers eager")
    lines.append(f"{'arch':8s} {'context':>8s} {'new':>4s} {'ours tok/s':>11s} {'hf tok/s':>9s} {'ratio':>6s} "
                 f"{'ours e2e s':>11s} {'hf e2e s':>9s} {'compiled tok/s':>15s} {'ratio':>6s}")
    for r in res["decode"]:
        comp = f"{r['ours_compiled_tokens_per_s']:15.1f} {r['ratio_compiled']:6.2f}" \
            if "ratio_compiled" in r else f"{'-':>15s} {'-':>6s}"
        lines.append(f"{r['arch']:8s} {r['context']:8d} {r['new_tokens']:4d} {r['ours_tokens_per_s']:11.1f} "
                     f"{r['hf_tokens_per_s']:9.1f} {r['ratio']:6.2f} {r['ours_end_to_end_s']:11.3f} "
                     f"{r['hf_end_to_end_s']:9.3f} {comp}")
    if res["latency"]:
        lines.append("")
        lines.append("mamba2 (ours) per-token decode latency")
        for r in res["latency"]:
            lines.append(f"  context {r['context']:6d}: {r['median_ms']:7.2f} ms/token (min {r['min_ms']:.2f}), "
                         f"state {r['state_bytes']} bytes")
    lines.append("")
    lines.append("targets")
    for k, t in res["targets"].items():
        lines.append(f"  {k:36s} {t['target']:>8s}  measured {t['measured']:6.2f}  "
                     f"{'met' if t['met'] else 'MISSED'}")
    pk = res["matmul_peak_gflops"]
    lines.append(f"matmul peak: {pk['start']:.1f} GFLOP/s at start, {pk['end']:.1f} at end")
    return "\n".join(lines)


def plot(res: dict, path: str) -> str:
    """The --compare-hf PNG: speed ratios vs transformers and our decode latency vs context. -> its path."""
    from ..plots import pyplot
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"train {r['arch']}\n{r['batch']}x{r['seq_len']}" for r in res["train"]] + \
             [f"decode {r['arch']}\nctx {r['context']}" for r in res["decode"]]
    ratios = [r["ratio"] for r in res["train"]] + [r["ratio"] for r in res["decode"]]
    axes[0].bar(range(len(ratios)), ratios, color="tab:blue")
    axes[0].axhline(1.0, color="gray", lw=1, ls="--")
    axes[0].set_xticks(range(len(ratios)), labels, fontsize=7)
    axes[0].set_ylabel("ours / transformers (higher is faster)")
    axes[0].set_title("speed ratio vs transformers")
    lat = res["latency"]
    for name in sorted({r.get("preset", "mamba2") for r in lat}):
        pts = [r for r in lat if r.get("preset", "mamba2") == name]
        axes[1].plot([r["context"] for r in pts], [r["median_ms"] for r in pts], "o-", label=name)
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("context (tokens)")
    axes[1].set_ylabel("ms per decoded token")
    axes[1].set_title("decode latency vs context")
    if lat:
        axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.kernels:
        from .kernels import run_kernels
        write_results(args.out, {"mode": "kernels", **run_kernels(args.shapes, repeats=args.repeats or 10,
                                                                  quick=args.quick)}, _meta(args))
        return 0
    if args.suite == "gpu":
        from .gpu import run_gpu_check, to_markdown, write
        out = os.path.join("runs", "gpu", "gpu-check.json") if args.out == DEFAULT_OUT else args.out
        parts = [x.strip() for x in args.parts.split(",") if x.strip()] if args.parts else None
        res = run_gpu_check(dry_run=args.dry_run or args.quick, parts=parts, write=lambda r: write(r, out),
                            time_limit=args.time_limit)
        print("\n" + to_markdown(res))
        print(f"results: {out} and {os.path.splitext(out)[0]}.md")
        return 1 if (res.get("correctness") or {}).get("failed") else 0
    if args.suite:
        res = {"suite": args.suite, **SUITES[args.suite][0](quick=args.quick, **_suite_options(args))}
        markdown = res.pop("markdown", None)
        write_results(args.out, res, _meta(args))
        if markdown:
            with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
                f.write(markdown)
        return 0
    from ..errors import ConfigError
    if args.compare_hf and (args.params or args.compile or args.memory or args.device != "cpu"
                            or args.dtype not in ("auto", "float32")):
        raise ConfigError("--params, --compile, --memory, --device and --dtype apply to the preset instrument, "
                          "not to --compare-hf")
    settings = _settings(args)
    log = print
    from . import instrument
    if args.compare_hf:
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise ConfigError("--compare-hf needs transformers: pip install 'hybridlm[hf]'") from None
        from .compare_hf import run_compare
        archs = [a.strip() for a in args.archs.split(",") if a.strip()]
        bad = [a for a in archs if a not in ("llama", "mamba2")]
        if bad or not archs:
            raise ConfigError(f"--archs must name llama and/or mamba2, got {args.archs!r}")
        res = dict(run_compare(settings, archs=archs, log=log), mode="compare-hf")
        draw, table = (lambda stem: [plot(res, stem + ".png")]), format_table
    else:
        names = [n.strip() for n in (args.presets or "transformer++,mamba2").split(",") if n.strip()]
        res = dict(instrument.run_instrument(settings, names, log=log), mode="ours", settings=settings)
        draw, table = (lambda stem: instrument.plot(res, stem)), instrument.format_table
    print()
    print(table(res))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    res["plots"] = [] if args.no_plot else draw(os.path.splitext(args.out)[0])
    res["plot"] = res["plots"][0] if res["plots"] else None
    if args.no_plot:
        res["plot_note"] = "plot skipped (--no-plot)"
        print(res["plot_note"])
    write_results(args.out, res, _meta(args))
    if res["plots"]:
        print(f"plots: {', '.join(res['plots'])}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m hybridlm.bench.run")
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
