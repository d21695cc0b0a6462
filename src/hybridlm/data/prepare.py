"""`data prepare`: stream documents from a source, tokenise them in parallel, write token shards.

    summary = prepare("corpus/", "data/corpus", tokenizer="bpe:8192", shard_tokens=50_000_000, workers=4)

Sources: a text file, a folder (searched like `--data`), `.jsonl` (one {"text": ...} per line), `.parquet`
(a "text" column) or a Hugging Face `datasets` dataset saved with `save_to_disk` (every split, "text" column).
Documents are read one at a time (a jsonl line, a parquet batch, a dataset batch), so memory stays bounded by
the chunks in flight plus one shard. Train/validation is split by document with `corpus.split_documents`'
rule (every 20th document to validation; fewer than 20: the last one; a single one: at ~95% on a line), so a
prepared directory holds exactly the token streams the in-memory path builds from the same source. Chunks are
tokenised by a process pool and written back in order: the output does not depend on the worker count.
"""
import collections
import multiprocessing
import os
from typing import Iterator

import numpy as np
from tqdm import tqdm

from ..errors import InputError
from .corpus import TEXT_EXTS, VAL_EVERY, _read_text, _walk, iter_jsonl, split_documents
from .loader import encode_documents
from .shards import META_FILE, ShardWriter, shard_dtype, write_meta
from .tokenizer import load_tokenizer, tokenizer_from_dir

DATASET_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")
CHUNK_CHARS = 1 << 20           # about 1 MB of text per task sent to a worker


# --- sources ---------------------------------------------------------------------------------------------
def _parquet_docs(path: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    try:
        batches = pq.ParquetFile(path).iter_batches(columns=["text"], batch_size=1024)
        for batch in batches:
            yield from (t for t in batch.column(0).to_pylist() if isinstance(t, str))
    except InputError:
        raise
    except Exception as e:  # pyarrow raises several types for bad files / missing columns
        raise InputError(f"{path}: cannot read a 'text' column ({e})") from None


def _dataset_docs(path: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise InputError(f"{path} is a saved `datasets` dataset; reading it needs: pip install datasets") from None
    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:  # FileNotFoundError, arrow errors, ...
        raise InputError(f"{path}: cannot load the saved dataset ({e})") from None
    parts = list(ds.values()) if isinstance(ds, datasets.DatasetDict) else [ds]
    for part in parts:
        if "text" not in part.column_names:
            raise InputError(f"{path}: the dataset has no 'text' column (columns: {', '.join(part.column_names)})")
        for batch in part.select_columns(["text"]).iter(batch_size=1024):
            yield from (t for t in batch["text"] if isinstance(t, str))


def list_sources(src: str, skip: str | None = None) -> tuple[list[str], bool]:
    """-> (the files to read in order, whether `src` is a saved `datasets` dataset); files under the folder
    `skip` (the output, which may sit inside the source folder) are left out."""
    if not os.path.exists(src):
        raise InputError(f"data source {src} does not exist")
    if os.path.isdir(src) and any(os.path.exists(os.path.join(src, m)) for m in DATASET_MARKERS):
        return [src], True
    files = _walk(src, TEXT_EXTS | {".jsonl", ".parquet"}, skip_tests=False) if os.path.isdir(src) else [src]
    if skip is not None:
        files = [f for f in files if not os.path.abspath(f).startswith(os.path.abspath(skip) + os.sep)]
    if not files:
        raise InputError(f"no text files (.txt, .md, .py, .jsonl, .parquet, ...) under {src}")
    return files, False


def iter_documents(files: list[str], dataset: bool = False) -> Iterator[str]:
    """Every non-empty document of the sources `list_sources` found, in order."""
    for f in files:
        if dataset:
            reader = _dataset_docs(f)
        elif f.lower().endswith(".jsonl"):
            reader = iter_jsonl(f)
        elif f.lower().endswith(".parquet"):
            reader = _parquet_docs(f)
        else:
            reader = iter([_read_text(f)])
        yield from (d for d in reader if d)


def split_stream(docs: Iterator[str], val_every: int = VAL_EVERY) -> Iterator[tuple[str, str]]:
    """(split, document) pairs with `split_documents`' rule, holding at most `val_every` documents back."""
    def label(i):
        return "val" if i % val_every == val_every - 1 else "train"
    head = []
    for i, doc in enumerate(docs):
        if i >= val_every:
            yield label(i), doc
            continue
        head.append(doc)
        if i == val_every - 1:  # enough documents for the every-n-th rule
            yield from ((label(j), d) for j, d in enumerate(head))
    if 0 < len(head) < val_every:  # fewer documents in all: split_documents' special cases
        train, val = split_documents(head, val_every)
        yield from [("train", d) for d in train] + [("val", d) for d in val]


def _chunks(pairs: Iterator[tuple[str, str]]) -> Iterator[tuple[str, list[str]]]:
    """Consecutive documents of one split, about CHUNK_CHARS at a time."""
    split, docs, size = None, [], 0
    for s, d in pairs:
        if docs and (s != split or size >= CHUNK_CHARS):
            yield split, docs
            docs, size = [], 0
        split = s
        docs.append(d)
        size += len(d)
    if docs:
        yield split, docs


# --- tokenising in worker processes ----------------------------------------------------------------------
_TOKENIZER = None


def _init_worker(tok_dir: str):
    global _TOKENIZER
    _TOKENIZER = tokenizer_from_dir(tok_dir)


def _encode(task: tuple[str, list[str]]) -> tuple[str, np.ndarray, int]:
    split, docs = task
    return split, encode_documents(docs, _TOKENIZER), len(docs)


def _ordered(tasks, workers: int, tok_dir: str) -> Iterator[tuple[str, np.ndarray, int]]:
    """Results of `_encode` in task order, at most 4 tasks per worker in flight (bounded memory)."""
    if workers <= 1:
        _init_worker(tok_dir)
        yield from map(_encode, tasks)
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the pool is the parallelism
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with multiprocessing.get_context(method).Pool(workers, _init_worker, (tok_dir,)) as pool:
        pending = collections.deque()
        for task in tasks:
            pending.append(pool.apply_async(_encode, (task,)))
            if len(pending) >= 4 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def prepare(src: str, out_dir: str, tokenizer: str = "byte", shard_tokens: int = 100_000_000, workers: int = 1,
            progress: bool = True) -> dict:
    """Tokenise `src` into shards in `out_dir`; returns the meta dict written to `out_dir/meta.json`."""
    if shard_tokens < 1:
        raise InputError(f"shard_tokens must be >= 1, got {shard_tokens}")
    if workers < 1:
        raise InputError(f"workers must be >= 1, got {workers}")
    if os.path.exists(os.path.join(out_dir, META_FILE)):
        raise InputError(f"{out_dir} already holds a prepared dataset; choose another --out or delete it")
    sources = list_sources(src, skip=out_dir)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise InputError(f"cannot create {out_dir} ({e.strerror or e})") from None
    train_docs = (d for s, d in split_stream(iter_documents(*sources)) if s == "train")
    tok = load_tokenizer(tokenizer, texts=train_docs)  # a BPE is trained on the train documents only
    tok.save(out_dir)
    dtype = shard_dtype(tok.vocab_size)
    side = {"vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "tokenizer": tok.to_dict()}
    writers = {s: ShardWriter(out_dir, s, dtype, shard_tokens, side) for s in ("train", "val")}
    bar = tqdm(desc="prepare", unit=" doc", disable=not progress, dynamic_ncols=True)
    tokens = 0
    for split, ids, n_docs in _ordered(_chunks(split_stream(iter_documents(*sources))), workers, out_dir):
        writers[split].add(ids, n_docs)
        tokens += len(ids)
        bar.update(n_docs)
        bar.set_postfix(tokens=f"{tokens:,}")
    bar.close()
    splits = {s: w.summary() for s, w in writers.items()}
    if not splits["train"]["tokens"] or not splits["val"]["tokens"]:
        raise InputError(f"{src} holds too little text for a train and a validation split")
    meta = {"source": os.path.abspath(src), "tokenizer": tok.to_dict(), "dtype": dtype.name,
            "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "shard_tokens": shard_tokens, "splits": splits}
    write_meta(out_dir, meta)
    return meta
