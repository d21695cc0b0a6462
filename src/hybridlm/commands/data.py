"""`hybridlm data prepare SRC --out DIR`: tokenise a corpus once into token shards that training streams."""
import os

from .common import out


def main(args) -> int:
    from ..data.prepare import prepare
    meta = prepare(args.src, args.out, tokenizer=args.tokenizer, shard_tokens=args.shard_tokens,
                   workers=args.workers, progress=not args.no_progress)
    for split, s in meta["splits"].items():
        out(f"{split:<5}  {s['tokens']:,} tokens, {s['documents']:,} documents, {len(s['shards'])} shard(s)")
    out(f"wrote {args.out} ({meta['tokenizer']['type']} tokenizer, vocab {meta['vocab_size']}, {meta['dtype']}); "
        f"train with --data {args.out}")
    return 0


def add_arguments(p):
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    q = sub.add_parser("prepare", help="tokenise text, a folder, jsonl, parquet or a saved `datasets` dataset "
                       "into token shards", description="Tokenise SRC into binary token shards in DIR.")
    q.add_argument("src", help="text file, folder, .jsonl, .parquet, or a directory written by datasets' save_to_disk")
    q.add_argument("--out", required=True, help="output directory (gets meta.json, the tokenizer and the shards)")
    q.add_argument("--tokenizer", default="byte", help="byte | bpe:N (trained on the train documents) | tokenizer.json")
    q.add_argument("--shard-tokens", type=int, default=100_000_000, help="token ids per shard file")
    q.add_argument("--workers", type=int, default=max(1, min(8, (os.cpu_count() or 2) - 1)),
                   help="tokenizer processes (default: CPUs - 1, at most 8)")
    q.add_argument("--no-progress", action="store_true", help="no progress bar")
