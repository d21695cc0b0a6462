"""`hybridlm train`: train a model on the built-in corpus or your data; --resume continues a run."""
import argparse
import os

from ..eval.perplexity import describe
from .common import add_model_args, config_diff, is_main_rank, layout_summary, model_config, out, param_split


def _train_config(args):
    from ..train import TrainConfig
    return TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                       min_lr=args.min_lr, warmup=args.warmup, schedule=args.schedule,
                       weight_decay=args.weight_decay, betas=tuple(args.adam_betas), adam_eps=args.adam_eps,
                       grad_clip=args.grad_clip, grad_accum=args.grad_accum, eval_every=args.eval_every,
                       eval_tokens=args.eval_tokens, doc_mask=not args.no_doc_mask, save_every=args.save_every,
                       seed=args.seed, dtype=args.dtype, compile=args.compile,
                       grad_checkpointing=args.grad_checkpointing, log_every=args.log_every, device=args.device,
                       parallel=args.parallel, keep=args.keep, on_nan=args.on_nan, data_order=args.data_order)


def main(args) -> int:
    import torch
    from ..data.loader import load_data
    from ..models import CausalLM, ModelConfig
    from ..train import TrainConfig, train
    from ..train.checkpoint import ensure_writable, find_checkpoint, load_config
    from ..train.checkpoint import load_tokenizer as checkpoint_tokenizer
    if args.out is None:
        args.out = os.path.join("runs", args.preset)
    tcfg = _train_config(args)
    ensure_writable(args.out)  # before the data is read, not after
    if args.resume:
        ckpt = find_checkpoint(args.out)
        data = load_data(args.data, checkpoint_tokenizer(ckpt), args.max_bytes or None)
        model_cfg = load_config(ckpt)
    else:
        data = load_data(args.data, args.tokenizer, args.max_bytes or None)
        model_cfg = model_config(args, data.tokenizer.vocab_size, args.seq_len)
    tok = data.tokenizer
    with torch.device("meta"):   # sizes only: no rank holds a whole model (train builds and shards its own)
        model = CausalLM(model_cfg)
    out(f"model   {args.preset if not args.resume else 'resumed'}: {layout_summary(model_cfg)}")
    out(f"        {param_split(model)}")
    out(f"        config: {config_diff(model_cfg, ModelConfig(layout=model_cfg.layout))}")
    out(f"train   {config_diff(tcfg, TrainConfig())}")
    del model
    out(f"data    {data.source or 'stdlib'}: {len(data.tokens('train')):,} train / {len(data.tokens('val')):,} val "
        f"tokens ({tok.kind} tokenizer, vocab {tok.vocab_size})")
    s = train(model_cfg, tcfg, data, args.out, resume=args.resume, progress=not args.no_progress)
    if not is_main_rank():
        return 0
    if s["stopped"]:
        out(f"stopped by {s['stopped']} after step {s['steps']}: checkpoint {s['checkpoint']} (continue with --resume)")
    elif s["loss"] is not None:
        val = describe({"loss": s["val_loss"], "ppl": s["val_ppl"], "tokens": s["val_tokens"],
                        "whole": s["val_whole"], "bpb": s["val_bpb"]})
        out(f"done    step {s['steps']}: train loss {s['loss']:.4f}, {val}; {s['tokens_per_s']:,.0f} tokens/s; "
            f"checkpoint {s['checkpoint']}")
    else:
        out(f"nothing to do: the checkpoint in {args.out} is already at step {s['steps']}")
    return 0


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
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-tokens", type=int, default=1_000_000,
                   help="validate on the whole split when it has at most this many tokens, else on a fixed seeded "
                        "sample of that size (0 = always the whole split)")
    p.add_argument("--no-doc-mask", action="store_true",
                   help="let state and attention run across document boundaries (default: reset at each)")
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--grad-checkpointing", action="store_true", help="recompute each block's activations in backward")
    p.add_argument("--parallel", default="auto", choices=["auto", "ddp", "fsdp"],
                   help="under torchrun: ddp replicates the model, fsdp shards it (FSDP2) and saves distributed "
                        "checkpoints (auto = ddp)")
    p.add_argument("--keep", type=int, default=0, help="keep only the N newest step checkpoints (0 = all)")
    p.add_argument("--on-nan", default="stop", choices=["stop", "skip"],
                   help="a NaN/Inf loss stops the run (exit 1) or skips that batch (counted as nan_skipped)")
    p.add_argument("--data-order", default="random", choices=["random", "sequential"],
                   help="random windows seeded by step, or epochs read in order with the cursor saved for --resume")
    p.add_argument("--resume", action="store_true", help="continue from OUT's latest checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (validation lines still print)")
