"""`hybridlm eval`: validation loss and perplexity of a checkpoint, or lm-evaluation-harness tasks (--tasks).

By default it evaluates exactly what training's validation line measured: the same data (source and byte cap
from the checkpoint), the same split, window length, token budget, seed and document masking, so the two
figures agree."""
import os

from ..dtypes import CHOICES as DTYPES
from .common import add_quantize_args, add_tokenizer_arg, other_tokenizer, out, quantized


def main(args) -> int:
    from ..errors import ConfigError
    if args.tasks_dir:          # the shipped tasks for lm-eval's own CLI (absolute data_files)
        from ..eval.harness_tasks import write_tasks
        written = write_tasks(args.tasks_dir)
        out(f"wrote {len(written)} lm-eval tasks to {args.tasks_dir}: lm_eval --model hf --model_args "
            f"pretrained=RUN,trust_remote_code=True --tasks hybridlm_copy --include_path {args.tasks_dir}")
        if not args.checkpoint:
            return 0
    if not args.checkpoint:
        raise ConfigError("--checkpoint is required (except with --tasks-dir alone)")
    if args.tasks and args.quantize:
        raise ConfigError("--quantize goes with the validation perplexity; for --tasks quantize the checkpoint "
                          "first (hybridlm convert --checkpoint RUN --quantize ... --out RUN2)")
    if args.tasks:  # lm-evaluation-harness tasks instead of the validation perplexity (eval/harness_tasks.py)
        from ..eval.harness_tasks import evaluate_checkpoint
        out(evaluate_checkpoint(args.checkpoint, args.tasks, include_path=args.include_path, limit=args.limit,
                                num_fewshot=args.num_fewshot, batch_size=args.batch_size or 8, dtype=args.dtype,
                                output=args.output))
        return 0
    import torch
    from ..data.loader import load_data
    from ..data.tokenizer import tokenizer_from_dir
    from ..dtypes import resolve_dtype
    from ..eval.perplexity import DEFAULT_VAL_TOKENS, describe, validate
    from ..checkpoint import load_checkpoint
    model, state = load_checkpoint(args.checkpoint)
    model = quantized(model, args)
    tok = other_tokenizer(args.tokenizer, model.config.vocab_size) if args.tokenizer \
        else tokenizer_from_dir(state["checkpoint_dir"])
    tcfg = state.get("train_config", {})
    spec = state.get("data_spec") or {"data": state.get("data"), "max_bytes": 8_000_000}
    source, max_bytes = spec.get("data"), spec.get("max_bytes")
    if args.data is not None:
        source, max_bytes = args.data, (args.max_bytes if args.max_bytes is not None else max_bytes)
    elif source not in (None, "stdlib") and not os.path.exists(source):
        out(f"note    the training data {source} is gone: evaluating on the built-in corpus instead")
        source = None
    elif args.max_bytes is not None:
        max_bytes = args.max_bytes
    data = load_data(source, tok, max_bytes or None)
    seq_len = args.seq_len or tcfg.get("seq_len", 256)
    budget = args.max_tokens if args.max_tokens is not None else tcfg.get("eval_tokens", DEFAULT_VAL_TOKENS)
    dtype, label = resolve_dtype(args.dtype, "cpu")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    r = validate(model, data.tokens("val"), tok, seq_len, args.batch_size or tcfg.get("batch_size", 8),
                 max_tokens=budget, seed=tcfg.get("seed", 0), doc_mask=tcfg.get("doc_mask", True), autocast=autocast)
    from ..models.quantize import describe as weights, quantization_of
    out(f"{describe(r)} of the {data.source or 'stdlib'} validation split, seq_len {seq_len}, {label}, weights "
        f"{weights(quantization_of(model))}")
    if args.attention_mass:
        from ..eval.attention_recall import captured_mass
        m = captured_mass(model, data.tokens("val"), tok, seq_len, args.batch_size or tcfg.get("batch_size", 8),
                          max_tokens=budget or 32_768, seed=tcfg.get("seed", 0), doc_mask=tcfg.get("doc_mask", True))
        if m["mass"] is None:
            out(f"captured attention mass: no query sees more than the top-{m['k']} keys at seq_len {seq_len}")
        else:
            layers = ", ".join(f"{v:.3f}" if v is not None else "-" for v in m["per_layer"])
            out(f"captured attention mass {m['mass']:.3f} of the dense attention in the top-{m['k']} keys "
                f"(per `I` layer {layers}; the best k keys {m['oracle']:.3f}, k random keys {m['random']:.3f}) over "
                f"{m['queries']:,} queries")
    return 0


def add_arguments(p):
    p.add_argument("--checkpoint", default=None,
                   help="checkpoint directory (or the run directory holding one); required but with --tasks-dir")
    add_tokenizer_arg(p)
    p.add_argument("--data", default=None,
                   help="data to evaluate on, text, token ids or a `data prepare` directory as for train (default: "
                        "the training data's "
                        "validation split)")
    p.add_argument("--max-bytes", type=int, default=None, help="text cap in bytes (default: as in training; 0 = none)")
    p.add_argument("--seq-len", type=int, default=None, help="window length (default: the training seq_len)")
    p.add_argument("--batch-size", type=int, default=None, help="default: the training batch size (8 for --tasks)")
    p.add_argument("--tasks", default=None, metavar="NAMES",
                   help="comma-separated lm-evaluation-harness tasks (needs hybridlm[eval]), e.g. hybridlm_local (the "
                        "shipped local tasks) or lambada_openai,hellaswag; runs them instead of the validation ppl")
    p.add_argument("--include-path", action="append", default=[], metavar="DIR",
                   help="a directory of your own lm-eval task YAMLs (repeatable)")
    p.add_argument("--limit", type=float, default=None,
                   help="at most this many examples per task (a fraction if < 1), for quick checks")
    p.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples per prompt (default: the task's)")
    p.add_argument("--output", default=None, metavar="FILE", help="write lm-eval's results as JSON here")
    p.add_argument("--tasks-dir", default=None, metavar="DIR",
                   help="write the shipped lm-eval tasks (and their data) into DIR with absolute data_files, so "
                        "lm-eval's own CLI runs them from any directory (--include_path DIR)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="bfloat16: autocast (float32 weights); auto (default): bfloat16 on CPUs with AMX-BF16 or "
                        "AVX512-BF16, else float32 (training's default resolves the same way, so the figures agree)")
    p.add_argument("--attention-mass", action="store_true",
                   help="also the dense attention mass each `I` layer's top-k keys capture (eval/attention_recall.py)")
    add_quantize_args(p)
    p.add_argument("--max-tokens", type=int, default=None,
                   help="whole split up to this many tokens, else a fixed sample (default: as in training; 0 = all)")
