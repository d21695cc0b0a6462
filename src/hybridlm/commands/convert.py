"""`hybridlm convert`: a transformers checkpoint directory -> a hybridlm checkpoint (--from-hf), or a hybridlm run ->
a transformers directory that AutoModelForCausalLM and pipeline() load after `import hybridlm` or with
trust_remote_code=True (--to-hf; with --as-native, transformers' own Llama / Mamba-2 classes, no hybridlm needed)."""
from .common import out


def main(args) -> int:
    from ..errors import ConfigError
    try:
        from ..hf import directory
    except ImportError as e:
        raise ConfigError(f"hybridlm convert needs transformers: pip install 'hybridlm[hf]' ({e})") from None
    if args.as_native and not args.to_hf:
        raise ConfigError("--as-native goes with --to-hf")
    if args.dtype and args.to_hf:
        raise ConfigError("--dtype goes with --from-hf")
    if args.from_hf:
        path = directory.convert_from_hf(args.from_hf, args.out, args.dtype)
        out(f"converted {args.from_hf} -> {path} (hybridlm checkpoint: hybridlm generate/eval --checkpoint {args.out})")
    else:
        directory.export_to_hf(args.to_hf, args.out, native=args.as_native)
        kind = "transformers' own class" if args.as_native else \
            "HybridLMForCausalLM: import hybridlm, or trust_remote_code=True"
        out(f"exported {args.to_hf} -> {args.out} ({kind}: AutoModelForCausalLM.from_pretrained({args.out!r}))")
    return 0


def add_arguments(p):
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="DIR",
                     help="transformers checkpoint directory (config.json + safetensors, sharded too): Llama, Mamba2, "
                          "Doge, DeepseekV3/V32 (dense)")
    src.add_argument("--to-hf", metavar="RUN_OR_CHECKPOINT", help="hybridlm run or checkpoint directory to export")
    p.add_argument("--out", required=True, help="output: run directory (--from-hf) or transformers directory (--to-hf)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="--from-hf: cast the weights (default: keep the dtype of the files)")
    p.add_argument("--as-native", action="store_true",
                   help="--to-hf: write LlamaForCausalLM / Mamba2ForCausalLM when the model is exactly one")
