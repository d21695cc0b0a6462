"""Text corpora as lists of documents, split into train/validation deterministically.

The built-in corpus needs no download: the running interpreter's standard library `.py` sources
(test directories and site-packages skipped, sorted file order, capped at `max_bytes`). User data can
be a text file, a folder (searched recursively), a `.jsonl` file (one {"text": ...} per line) or a
`.parquet` file with a "text" column (needs pyarrow).
"""
import json
import os
import sysconfig
from dataclasses import dataclass

from ..errors import InputError

TEXT_EXTS = {".txt", ".md", ".rst", ".py", ".c", ".h", ".cpp", ".js", ".ts", ".java", ".go", ".rs", ".html",
             ".css", ".tex", ".csv", ".json", ".yaml", ".yml", ".toml", ".sh"}
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "idle_test", ".git"}
DEFAULT_MAX_BYTES = 8_000_000
VAL_EVERY = 20


@dataclass
class Corpus:
    train: list[str]
    val: list[str]
    source: str             # "stdlib" or the user path

    @property
    def nbytes(self) -> int:
        return sum(len(d.encode("utf-8")) for d in self.train + self.val)


def split_documents(docs: list[str], val_every: int = VAL_EVERY) -> tuple[list[str], list[str]]:
    """Every `val_every`-th document goes to validation; a single document is split at ~95% (on a line)."""
    docs = [d for d in docs if d]
    if not docs:
        return [], []
    if len(docs) == 1:
        text = docs[0]
        cut = text.rfind("\n", 0, int(len(text) * 0.95)) + 1 or int(len(text) * 0.95)
        return [text[:cut]], [text[cut:]]
    val = [d for i, d in enumerate(docs) if i % val_every == val_every - 1]
    train = [d for i, d in enumerate(docs) if i % val_every != val_every - 1]
    if not val:  # fewer than val_every documents: hold out the last one
        train, val = docs[:-1], docs[-1:]
    return train, val


def _walk(root: str, exts: set[str], skip_tests: bool) -> list[str]:
    """Files under `root` with one of `exts`, in deterministic sorted order."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")
                             and not (skip_tests and d.startswith("test")))
        out += [os.path.join(dirpath, f) for f in sorted(filenames) if os.path.splitext(f)[1].lower() in exts]
    return out


def _read_text(path: str, max_bytes: int | None = None) -> str:
    """The file as UTF-8 text (at most `max_bytes` bytes, cut at a character boundary). Binary data is refused
    rather than decoded into replacement characters and trained on."""
    with open(path, "rb") as f:
        raw = f.read() if max_bytes is None else f.read(max_bytes)
    if b"\0" in raw[:1 << 20]:
        raise InputError(f"{path} is binary (NUL bytes), not text: token ids go in a .npy file, or a .bin file "
                         f"with a .bin.json sidecar naming their dtype")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if max_bytes is not None and e.start >= len(raw) - 3 and e.reason.startswith("unexpected end"):
            return raw[:e.start].decode("utf-8")   # the cap split a character
        raise InputError(f"{path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start:,}): convert "
                         f"it to UTF-8, or give token ids as .npy / .bin + .bin.json") from None


def _read_jsonl(path: str) -> list[str]:
    docs = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{n}: bad JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise InputError(f"{path}:{n}: expected an object with a string 'text' field")
            docs.append(obj["text"])
    return docs


def _read_parquet(path: str) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    try:
        table = pq.read_table(path, columns=["text"])
    except Exception as e:  # pyarrow raises several types for bad files / missing columns
        raise InputError(f"{path}: cannot read a 'text' column ({e})") from None
    return [t for t in table.column("text").to_pylist() if isinstance(t, str)]


def read_documents(path: str, max_bytes: int | None = None) -> list[str]:
    """Documents of one file: a .jsonl line, a .parquet row, or the whole text file (of which at most
    `max_bytes` are read)."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".jsonl":
        return _read_jsonl(path)
    if ext == ".parquet":
        return _read_parquet(path)
    return [_read_text(path, max_bytes)]


def _cut(doc: str, n_bytes: int) -> str:
    """The longest prefix of `doc` of at most `n_bytes` UTF-8 bytes."""
    return doc.encode("utf-8")[:n_bytes].decode("utf-8", errors="ignore")


def _capped(paths: list[str], max_bytes: int | None) -> list[str]:
    """Documents of `paths` in order, at most `max_bytes` UTF-8 bytes in all (the last one cut to fit)."""
    docs, total = [], 0
    for p in paths:
        for d in read_documents(p, None if max_bytes is None else max_bytes - total):
            n = len(d.encode("utf-8"))
            if max_bytes is not None and total + n > max_bytes:
                d, n = _cut(d, max_bytes - total), max_bytes - total
            if d:
                docs.append(d)
            total += n
            if max_bytes is not None and total >= max_bytes:
                return docs
    return docs


def stdlib_corpus(max_bytes: int | None = DEFAULT_MAX_BYTES, val_every: int = VAL_EVERY) -> Corpus:
    """The Python standard library sources of this interpreter (about 12 MB uncapped)."""
    root = sysconfig.get_paths()["stdlib"]
    train, val = split_documents(_capped(_walk(root, {".py"}, skip_tests=True), max_bytes), val_every)
    if not train or not val:
        raise InputError(f"no Python sources found under {root}")
    return Corpus(train, val, "stdlib")


def load_corpus(path: str | None = None, max_bytes: int | None = DEFAULT_MAX_BYTES,
                val_every: int = VAL_EVERY) -> Corpus:
    """`path` None -> the built-in stdlib corpus; else a file or folder of text/jsonl/parquet."""
    if path is None or path == "stdlib":
        return stdlib_corpus(max_bytes, val_every)
    if not os.path.exists(path):
        raise InputError(f"data path {path} does not exist")
    files = _walk(path, TEXT_EXTS | {".jsonl", ".parquet"}, skip_tests=False) if os.path.isdir(path) else [path]
    if not files:
        raise InputError(f"no text files (.txt, .md, .py, .jsonl, .parquet, ...) under {path}")
    train, val = split_documents(_capped(files, max_bytes), val_every)
    if not train or not val:
        raise InputError(f"{path} holds no text")
    return Corpus(train, val, path)
