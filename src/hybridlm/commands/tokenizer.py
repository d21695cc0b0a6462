"""`hybridlm tokenizer train`: train a byte-level BPE on your text (or the built-in corpus) and save it where
`hybridlm train --tokenizer DIR` and transformers' `AutoTokenizer.from_pretrained(DIR)` both read it."""
import os

from .common import out


def main(args) -> int:
    from ..data.corpus import load_corpus
    from ..data.tokenizer import BPETokenizer
    corpus = load_corpus(args.data, max_bytes=args.max_bytes or None)
    tok = BPETokenizer.train(corpus.train, args.vocab_size)
    os.makedirs(args.out, exist_ok=True)
    tok.save(args.out)
    sample = corpus.train[0][:2000] if corpus.train else ""
    ratio = len(sample.encode()) / max(1, len(tok.encode(sample)))
    out(f"saved a byte-level BPE of {tok.vocab_size} ids (eos {tok.eos_id}) trained on {corpus.source} to {args.out}; "
        f"{ratio:.2f} bytes per token on the first training document")
    return 0


def add_arguments(p):
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    t = sub.add_parser("train", help="train a byte-level BPE with the tokenizers library and save it")
    t.add_argument("--vocab-size", type=int, required=True, help="ids in the vocabulary (> 257: 256 bytes + eos)")
    t.add_argument("--data", default=None,
                   help="text file, folder, .jsonl or .parquet (default: the Python standard library sources)")
    t.add_argument("--max-bytes", type=int, default=8_000_000, help="cap on corpus size in bytes (0 = no cap)")
    t.add_argument("--out", required=True, help="directory for tokenizer.json + tokenizer_config.json")
