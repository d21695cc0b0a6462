"""`hybridlm train`: train a model on the built-in corpus or your data; --resume continues a run."""
import argparse
import os

from ..dtypes import CHOICES as DTYPES
from ..eval.perplexity import describe
from ..runtime import allocator_in_force
from .common import (add_model_args, config_diff, is_main_rank, layout_summary, model_config, out, param_split,
                     parse_sets)


def _train_config(args, dtype: str):
    from ..train import TrainConfig
    return TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                       min_lr=args.min_lr, warmup=args.warmup, schedule=args.schedule,
                       weight_decay=args.weight_decay, betas=tuple(args.adam_betas), adam_eps=args.adam_eps,
                       grad_clip=args.grad_clip, grad_accum=args.grad_accum, eval_every=args.eval_every,
                       eval_tokens=args.eval_tokens, eval_batch_size=args.eval_batch_size, doc_mask=not args.no_doc_mask,
                       save_every=args.save_every, seed=args.seed, dtype=dtype, compile=args.compile,
                       grad_checkpointing=args.grad_checkpointing, log_every=args.log_every, device=args.device,
                       parallel=args.parallel, context_parallel=args.context_parallel, keep=args.keep,
                       on_nan=args.on_nan, data_order=args.data_order, stage=args.stage, init_from=args.init_from,
                       indexer_dense_steps=args.indexer_dense_steps)


def main(args) -> int:
    import torch
    from ..data.loader import load_data
    from ..dtypes import resolve_dtype
    from ..models import CausalLM, ModelConfig
    from ..train import TrainConfig, train
    from ..checkpoint import ensure_writable, find_checkpoint, load_config
    from ..checkpoint import load_tokenizer as checkpoint_tokenizer
    if args.out is None:
        args.out = os.path.join("runs", args.preset)
    dtype, label = resolve_dtype(args.dtype, args.device)
    tcfg = _train_config(args, dtype)
    ensure_writable(args.out)  # before the data is read, not after
    if args.resume:
        ckpt = find_checkpoint(args.out)
        data = load_data(args.data, checkpoint_tokenizer(ckpt), args.max_bytes or None)
        model_cfg = load_config(ckpt)
    elif args.init_from:   # the checkpoint's model and tokenizer; --set may change what leaves the weights alone
        data = load_data(args.data, checkpoint_tokenizer(args.init_from), args.max_bytes or None)
        model_cfg = load_config(args.init_from).replace(**parse_sets(args.set))
    else:
        data = load_data(args.data, args.tokenizer, args.max_bytes or None)
        model_cfg = model_config(args, data.tokenizer.vocab_size, args.seq_len)
    tok = data.tokenizer
    with torch.device("meta"):   # sizes only: no rank holds a whole model (train builds and shards its own)
        model = CausalLM(model_cfg)
    origin = "resumed" if args.resume else f"from {args.init_from}" if args.init_from else args.preset
    out(f"model   {origin}: {layout_summary(model_cfg)}")
    out(f"        {param_split(model)}")
    out(f"        config: {config_diff(model_cfg, ModelConfig(layout=model_cfg.layout))}")
    out(f"train   {config_diff(tcfg, TrainConfig())}")
    out(f"        compute {label}{', autocast with float32 weights' if dtype == 'bfloat16' else ''}")
    out(f"        allocator {allocator_in_force()}")
    del model
    out(f"data    {data.source or 'stdlib'}: {len(data.tokens('train')):,} train / {len(data.tokens('val')):,} val "
        f"tokens ({tok.kind} tokenizer, vocab {tok.vocab_size})")
    s = train(model_cfg, tcfg, data, args.out, resume=args.resume, progress=not args.no_progress)
    if not is_main_rank():
        return 0
    if s["stopped"]:
        out(f"stopped by {s['stopped']} after step {s['steps']}: checkpoint {s['checkpoint']} (continue with --resume)")
    elif s["loss"] is not None:
        val = "no validation (--eval-tokens 0)" if s["val_loss"] is None else \
            describe({"loss": s["val_loss"], "ppl": s["val_ppl"], "tokens": s["val_tokens"], "whole": s["val_whole"],
                      "bpb": s["val_bpb"]})
        out(f"done    step {s['steps']}: train loss {s['loss']:.4f}, {val}; {s['tokens_per_s']:,.0f} tokens/s; "
            f"checkpoint {s['checkpoint']}")
    else:
        out(f"nothing to do: the checkpoint in {args.out} is already at step {s['steps']}")
    return 0


def _tokens(text: str) -> int | None:
    if text == "all":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens or 'all', got {text!r}") from None


def _floats(n: int):
    def parse(text: str) -> list[float]:
        try:
            vals = [float(v) for v in text.replace(",", " ").split()]
        except ValueError:
            vals = []
        if len(vals) != n:
            raise argparse.ArgumentTypeError(f"expected {n} numbers, got {text!r}")
        return vals
    return parse


def add_arguments(p):
    add_model_args(p)
    p.add_argument("--out", default=None, help="run directory for checkpoint and metrics.jsonl (default runs/PRESET)")
    p.add_argument("--data", default=None,
                   help="text file, folder, .jsonl or .parquet; or token ids: .npy, .bin with a .bin.json sidecar "
                        "naming the dtype, a folder with train/val token files, or a `data prepare` directory "
                        "(default: the Python standard library sources)")
    p.add_argument("--max-bytes", type=int, default=8_000_000,
                   help="cap on text read, in UTF-8 bytes, whatever the source (0 = no cap)")
    p.add_argument("--tokenizer", default=None,
                   help="byte | bpe:N (train a BPE of N ids) | tokenizer.json path or directory (default: byte, or "
                        "the tokenizer a token file's sidecar names)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=None, help="final learning rate (default lr/10)")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--schedule", default="cosine", choices=["cosine", "wsd", "constant"])
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--adam-betas", type=_floats(2), default=[0.9, 0.95], metavar="B1,B2", help="default 0.9,0.95")
    p.add_argument("--adam-eps", type=float, default=1e-8)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=200,
                   help="validate every N steps and at the end (0 = only at the end)")
    p.add_argument("--eval-tokens", type=_tokens, default=1_000_000, metavar="N|all",
                   help="validate on the whole split when it has at most N tokens, else on a fixed seeded sample of "
                        "about N, shared out among the ranks (all = always the whole split; 0 = no validation)")
    p.add_argument("--eval-batch-size", type=int, default=None,
                   help="validation windows per forward on each rank (default 4 x --batch-size: no activations "
                        "are kept, and under fsdp fewer forwards mean fewer parameter gathers)")
    p.add_argument("--no-doc-mask", action="store_true",
                   help="let state and attention run across document boundaries (default: reset at each)")
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="bfloat16: autocast (float32 weights and optimizer); auto (default): bfloat16 on CPUs with "
                        "AMX-BF16 or AVX512-BF16 and GPUs with bf16, else float32")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--grad-checkpointing", action="store_true", help="recompute each block's activations in backward")
    p.add_argument("--parallel", default="auto", choices=["auto", "ddp", "fsdp"],
                   help="under torchrun: ddp replicates the model, fsdp shards it (FSDP2) and saves distributed "
                        "checkpoints (auto = ddp)")
    p.add_argument("--context-parallel", type=int, default=1, metavar="N",
                   help="under torchrun: split each sequence over N ranks (--seq-len / N positions each; data "
                        "parallel over the other ranks); every layer letter but C and O")
    p.add_argument("--keep", type=int, default=0, help="keep only the N newest step checkpoints (0 = all)")
    p.add_argument("--on-nan", default="stop", choices=["stop", "skip"],
                   help="a NaN/Inf loss stops the run (exit 1) or skips that batch (counted as nan_skipped)")
    p.add_argument("--data-order", default="random", choices=["random", "sequential"],
                   help="random windows seeded by step, or epochs read in order with the cursor saved for --resume")
    p.add_argument("--resume", action="store_true", help="continue from OUT's latest checkpoint")
    p.add_argument("--init-from", default=None, metavar="CKPT",
                   help="start from this checkpoint's weights, model config (with --set applied) and tokenizer, "
                        "at step 0 with a fresh optimizer")
    p.add_argument("--stage", default="full", choices=["full", "indexer-warmup"],
                   help="indexer-warmup: `I` layers attend densely and only their lightning indexers train, on "
                        "their KL to the main attention (DeepSeek-V3.2's first stage; use with --init-from)")
    p.add_argument("--indexer-dense-steps", type=int, default=0, metavar="N",
                   help="training from scratch: the first N steps run `I` layers densely, their indexers learning "
                        "the dense attention over all keys, then top-k")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (validation lines still print)")
