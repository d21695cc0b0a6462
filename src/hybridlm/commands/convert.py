"""`hybridlm convert`: a transformers checkpoint directory -> a hybridlm checkpoint (--from-hf), a hybridlm run ->
a transformers directory that AutoModelForCausalLM and pipeline() load after `import hybridlm` or with
trust_remote_code=True (--to-hf; with --as-native, transformers' own class of the family the model is exactly, e.g.
Llama, Mamba2, GraniteMoeHybrid, NemotronH: no hybridlm needed, and vLLM serves it),
or a hybridlm run -> a checkpoint with quantized weights (--checkpoint with --quantize; --from-hf takes --quantize
too) that loads as it is."""
import os

from .common import add_quantize_args, out


def main(args) -> int:
    from ..errors import ConfigError
    if args.as_native and not args.to_hf:
        raise ConfigError("--as-native goes with --to-hf")
    if args.dtype and not args.from_hf:
        raise ConfigError("--dtype goes with --from-hf")
    if args.quantize and args.to_hf:
        raise ConfigError("--quantize cannot go with --to-hf: transformers cannot load hybridlm's quantized weights")
    if args.checkpoint:
        if not args.quantize:
            raise ConfigError("--checkpoint converts to quantized weights: give --quantize int8 or int4")
        path = quantize_checkpoint(args.checkpoint, args.out, args)
        out(f"quantized {args.checkpoint} -> {path} ({_scheme(args)}: hybridlm generate/eval --checkpoint {args.out})")
        return 0
    try:
        from ..hf import directory
    except ImportError as e:
        raise ConfigError(f"hybridlm convert needs transformers: pip install 'hybridlm[hf]' ({e})") from None
    if args.from_hf:
        path = directory.convert_from_hf(args.from_hf, args.out, args.dtype)
        if args.quantize:
            path = quantize_checkpoint(path, args.out, args)
        out(f"converted {args.from_hf} -> {path} (hybridlm checkpoint{', ' + _scheme(args) if args.quantize else ''}"
            f": hybridlm generate/eval --checkpoint {args.out})")
    else:
        directory.export_to_hf(args.to_hf, args.out, native=args.as_native)
        kind = f"transformers' {_written_class(args.out)}" if args.as_native else \
            "HybridLMForCausalLM: import hybridlm, or trust_remote_code=True"
        out(f"exported {args.to_hf} -> {args.out} ({kind}: AutoModelForCausalLM.from_pretrained({args.out!r}))")
    return 0


def _written_class(out_dir: str) -> str:
    import json
    with open(os.path.join(out_dir, "config.json")) as f:
        return json.load(f)["architectures"][0]


def _scheme(args) -> str:
    return args.quantize + (f", groups of {args.group_size}" if args.quantize == "int4" else "")


def quantize_checkpoint(src: str, out_dir: str, args) -> str:
    """Load `src`, quantize its linears, save `out_dir/checkpoint` atomically (trainer state and tokenizer kept, so
    eval measures the same split); returns the checkpoint path. `src` may itself lie in `out_dir` (--from-hf)."""
    from ..checkpoint import ensure_writable, load_checkpoint, save_checkpoint
    from ..data.tokenizer import tokenizer_from_dir
    from ..errors import HybridLMError
    from .common import quantized
    model, state = load_checkpoint(src)
    try:
        tok = tokenizer_from_dir(state["checkpoint_dir"])
    except HybridLMError:
        tok = None
    state = {k: v for k, v in state.items() if k not in ("checkpoint_dir", "rng")}
    quantized(model, args)
    ensure_writable(out_dir)
    return save_checkpoint(os.path.abspath(out_dir), model, state=state, tokenizer=tok)


def add_arguments(p):
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="DIR",
                     help="transformers checkpoint directory (config.json + safetensors, sharded too): Llama, Mamba2, "
                          "Doge, DeepseekV3/V32 (dense)")
    src.add_argument("--to-hf", metavar="RUN_OR_CHECKPOINT", help="hybridlm run or checkpoint directory to export")
    src.add_argument("--checkpoint", metavar="RUN_OR_CHECKPOINT",
                     help="hybridlm run or checkpoint directory to save with quantized weights (with --quantize)")
    p.add_argument("--out", required=True, help="output: run directory (--from-hf, --checkpoint) or transformers "
                                                "directory (--to-hf)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="--from-hf: cast the weights (default: keep the dtype of the files)")
    p.add_argument("--as-native", nargs="?", const="auto", default=None, metavar="auto|FAMILY",
                   help="--to-hf: write transformers' own class when the model is exactly one (auto: the first that "
                        "is, of Llama, Mamba2, GraniteMoeHybrid, NemotronH, Bamba, FalconH1, Jamba, Mamba, "
                        "FalconMamba, Zamba2, Qwen3Next, KimiLinear, Lfm2, Doge, DeepseekV3, DeepseekV32; or name one)")
    add_quantize_args(p)
