"""`hybridlm convert`: a checkpoint directory in another format -> a hybridlm checkpoint, chosen by the
`model_type` of its config.json (a row of FORMATS)."""
import json
import os

# model_type -> (module, function(src_dir, out_dir, dtype) -> checkpoint path)
FORMATS = {"rodimus": ("hybridlm.hf.rodimus_format", "convert_rodimus_dir")}


def main(args) -> int:
    import importlib
    import time
    from ..errors import CheckpointError, ConfigError
    from .common import out
    path = os.path.join(args.from_hf, "config.json")
    try:
        with open(path) as f:
            model_type = json.load(f).get("model_type")
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path} is not a JSON config ({e})") from None
    if model_type not in FORMATS:
        raise ConfigError(f"{path}: cannot convert model_type {model_type!r}; supported: {', '.join(sorted(FORMATS))}")
    module, fn = FORMATS[model_type]
    t0 = time.perf_counter()
    ckpt = getattr(importlib.import_module(module), fn)(args.from_hf, args.out, dtype=args.dtype)
    out(f"converted {args.from_hf} ({model_type}) -> {ckpt} in {time.perf_counter() - t0:.1f} s")
    return 0


def add_arguments(p):
    p.add_argument("--from-hf", required=True, metavar="DIR", help="checkpoint directory (config.json, safetensors, "
                   "tokenizer), e.g. a downloaded Rodimus release")
    p.add_argument("--out", required=True, metavar="RUN", help="output run directory (the checkpoint goes to RUN/checkpoint)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="cast the weights (default: keep the source dtype)")
