"""`hybridlm train`: train a model on the built-in corpus or your data; --resume continues a run."""
import os

from .common import add_model_args, count, is_main_rank, layout_summary, model_config, out


def _train_config(args):
    from ..train import TrainConfig
    return TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                       min_lr=args.min_lr, warmup=args.warmup, schedule=args.schedule,
                       weight_decay=args.weight_decay, grad_clip=args.grad_clip, grad_accum=args.grad_accum,
                       eval_every=args.eval_every, eval_batches=args.eval_batches, save_every=args.save_every,
                       seed=args.seed, dtype=args.dtype, compile=args.compile,
                       grad_checkpointing=args.grad_checkpointing, log_every=args.log_every, device=args.device,
                       keep=args.keep, on_nan=args.on_nan, data_order=args.data_order)


def main(args) -> int:
    if args.out is None:
        args.out = os.path.join("runs", args.preset)
    from ..data.corpus import load_corpus
    from ..data.loader import TokenData
    from ..data.shards import is_shard_dir, open_shards
    from ..data.tokenizer import load_tokenizer
    from ..train import train
    from ..train.checkpoint import ensure_writable, find_checkpoint, load_config
    from ..train.checkpoint import load_tokenizer as checkpoint_tokenizer
    tcfg = _train_config(args)
    ensure_writable(args.out)  # before the data is read, not after
    ckpt_tok = checkpoint_tokenizer(find_checkpoint(args.out)) if args.resume else None
    if is_shard_dir(args.data):  # prepared shards: memory-mapped, their own tokenizer
        data = open_shards(args.data, ckpt_tok)
        tok = data.tokenizer
    else:
        corpus = load_corpus(args.data, max_bytes=args.max_bytes or None)
        tok = ckpt_tok or load_tokenizer(args.tokenizer, texts=corpus.train)
        data = TokenData.from_corpus(corpus, tok)
    model_cfg = load_config(args.out) if args.resume else model_config(args, tok.vocab_size, args.seq_len)
    from ..models import CausalLM
    out(f"model   {args.preset if not args.resume else 'resumed'}: {layout_summary(model_cfg)}, "
         f"d_model {model_cfg.d_model}, {count(CausalLM(model_cfg).num_parameters())} parameters")
    out(f"data    {data.source}: {len(data.tokens('train')):,} train / {len(data.tokens('val')):,} val tokens "
         f"({tok.kind} tokenizer, vocab {tok.vocab_size})")
    s = train(model_cfg, tcfg, data, args.out, resume=args.resume, progress=not args.no_progress)
    if not is_main_rank():
        return 0
    if s["stopped"]:
        out(f"stopped by {s['stopped']} after step {s['steps']}: checkpoint {s['checkpoint']} (continue with --resume)")
    elif s["loss"] is not None:
        out(f"done    step {s['steps']}: train loss {s['loss']:.4f}, val loss {s['val_loss']:.4f}, "
             f"val ppl {s['val_ppl']:.2f}, {s['tokens_per_s']:,.0f} tokens/s; checkpoint {s['checkpoint']}")
    else:
        out(f"nothing to do: the checkpoint in {args.out} is already at step {s['steps']}")
    return 0


def add_arguments(p):
    add_model_args(p)
    p.add_argument("--out", default=None, help="run directory for checkpoint and metrics.jsonl (default runs/PRESET)")
    p.add_argument("--data", default=None,
                   help="text file, folder, .jsonl, .parquet or a `data prepare` directory (default: the Python "
                   "standard library sources)")
    p.add_argument("--max-bytes", type=int, default=8_000_000, help="cap on corpus size in bytes (0 = no cap)")
    p.add_argument("--tokenizer", default="byte", help="byte | bpe:N (train a BPE of N ids) | tokenizer.json path")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=None, help="final learning rate (default lr/10)")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--schedule", default="cosine", choices=["cosine", "wsd", "constant"])
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--grad-checkpointing", action="store_true", help="recompute activations in backward")
    p.add_argument("--keep", type=int, default=0, help="keep only the N newest step checkpoints (0 = all)")
    p.add_argument("--on-nan", default="stop", choices=["stop", "skip"],
                   help="a NaN/Inf loss stops the run (exit 1) or skips that batch (counted as nan_skipped)")
    p.add_argument("--data-order", default="random", choices=["random", "sequential"],
                   help="random windows seeded by step, or epochs read in order with the cursor saved for --resume")
    p.add_argument("--resume", action="store_true", help="continue from OUT's latest checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
