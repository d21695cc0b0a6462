"""`hybridlm eval`: validation loss and perplexity of a checkpoint."""
import os

from .common import out


def main(args) -> int:
    from ..data.corpus import load_corpus
    from ..data.loader import encode_documents
    from ..data.shards import is_shard_dir, open_shards
    from ..data.tokenizer import tokenizer_from_dir
    from ..eval.perplexity import perplexity
    from ..train.checkpoint import load_checkpoint
    model, state = load_checkpoint(args.checkpoint)
    tok = tokenizer_from_dir(state["checkpoint_dir"])
    source = args.data or state.get("data") or None
    if source not in (None, "stdlib") and not os.path.exists(source) and args.data is None:
        source = None  # the training data moved: fall back to the built-in corpus
    if is_shard_dir(source):  # prepared shards: read only the part evaluated
        val = open_shards(source, tok).tokens("val")
        arr, name = val[:args.max_tokens or len(val)], source
    else:
        corpus = load_corpus(source, max_bytes=args.max_bytes or None)
        arr, name = encode_documents(corpus.val, tok), corpus.source
    seq_len = args.seq_len or state.get("train_config", {}).get("seq_len", 256)
    r = perplexity(model, arr, tok, seq_len=seq_len, batch_size=args.batch_size, max_tokens=args.max_tokens or None)
    out(f"val loss {r['loss']:.4f}  ppl {r['ppl']:.2f}  ({r['tokens']:,} tokens of the {name} "
         f"validation split, seq_len {seq_len})")
    return 0


def add_arguments(p):
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (or the run directory holding one)")
    p.add_argument("--data", default=None,
                   help="text data or a `data prepare` directory to evaluate on (default: the training data's "
                   "validation split)")
    p.add_argument("--max-bytes", type=int, default=8_000_000, help="corpus cap in bytes, as in training (0 = none)")
    p.add_argument("--seq-len", type=int, default=None, help="window length (default: the training seq_len)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=100_000, help="evaluate at most this many tokens (0 = all)")
