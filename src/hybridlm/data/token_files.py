"""Token-id files: already tokenised data, read memory-mapped, never decoded as text.

Two forms of one flat stream of ids (documents separated by the tokenizer's eos id):

    ids.npy                 a 1-D unsigned or int32/int64 NumPy array (np.save)
    ids.bin + ids.bin.json  raw little-endian ids; the sidecar says {"dtype": "uint16"} and optionally
                            "vocab_size", "eos_id" and "tokenizer" (a tokenizer spec for load_tokenizer)

`write_token_file` writes either form atomically (the format `hybridlm data prepare` writes per shard). A
single file is split into train/validation at the last document boundary before 95% of the stream (the
text path's rule); a folder holding `train.{npy,bin}` and `val.{npy,bin}` (nanoGPT's layout, with sidecars)
gives the two splits directly.
"""
import json
import os

import numpy as np

from ..errors import InputError
from ..jsonio import read_json_object

TOKEN_EXTS = (".npy", ".bin")
DTYPES = {"uint8", "uint16", "uint32", "int32", "int64"}
VAL_FRACTION = 0.05


def is_token_path(path: str) -> bool:
    """A token file, or a folder with train/val token files."""
    if os.path.isdir(path):
        return any(os.path.exists(os.path.join(path, f"train{e}")) for e in TOKEN_EXTS)
    return os.path.splitext(path)[1].lower() in TOKEN_EXTS


def sidecar_path(path: str) -> str:
    return path + ".json"


def read_token_file(path: str) -> tuple[np.ndarray, dict]:
    """-> (1-D memory-mapped ids, metadata dict: dtype and whatever the sidecar adds)."""
    if not os.path.exists(path):
        raise InputError(f"token file {path} does not exist")
    if path.lower().endswith(".npy"):
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as e:
            raise InputError(f"{path}: not a readable .npy array ({e})") from None
        meta = {}
        if os.path.exists(sidecar_path(path)):
            meta = _read_sidecar(path)
    else:
        meta = _read_sidecar(path)
        if meta.get("dtype") not in DTYPES:
            raise InputError(f"{sidecar_path(path)}: 'dtype' must be one of {sorted(DTYPES)}, got {meta.get('dtype')!r}")
        itemsize = np.dtype(meta["dtype"]).itemsize
        size = os.path.getsize(path)
        if size % itemsize:
            raise InputError(f"{path}: {size} bytes is not a whole number of {meta['dtype']} ids (truncated?)")
        arr = np.memmap(path, dtype=np.dtype(meta["dtype"]).newbyteorder("<"), mode="r") if size \
            else np.zeros(0, np.dtype(meta["dtype"]))
    if arr.ndim != 1 or arr.dtype.name not in DTYPES:
        raise InputError(f"{path}: token ids must be a 1-D integer array ({'/'.join(sorted(DTYPES))}), found "
                         f"{arr.dtype.name} of shape {tuple(arr.shape)}")
    if "tokens" in meta and int(meta["tokens"]) != len(arr):
        raise InputError(f"{path}: holds {len(arr):,} ids but its sidecar says {int(meta['tokens']):,} (truncated?)")
    return arr, {**meta, "dtype": arr.dtype.name}


def _read_sidecar(path: str) -> dict:
    side = sidecar_path(path)
    if not os.path.exists(side):
        raise InputError(f"{path}: raw token ids need a sidecar {os.path.basename(side)} naming their dtype, e.g. "
                         f'{{"dtype": "uint16"}} (nanoGPT\'s .bin files are uint16)')
    return read_json_object(side)


def check_ids(arr: np.ndarray, vocab_size: int, name: str):
    """Refuse negative ids and ids >= vocab_size (one pass over a memory map, in blocks)."""
    step = 1 << 24
    for i in range(0, len(arr), step):
        block = arr[i: i + step]
        lo, hi = int(block.min()), int(block.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            at = i + int(np.argmax(block == bad))
            raise InputError(f"{name}: token id {bad} at position {at:,} is outside the vocabulary [0, {vocab_size})")


def write_token_file(path: str, ids, meta: dict | None = None) -> str:
    """Write ids as `.npy` or `.bin` + sidecar, through a temporary name renamed into place."""
    arr = np.asarray(ids)
    if arr.dtype.name not in DTYPES:
        raise InputError(f"token ids must be one of {sorted(DTYPES)}, got {arr.dtype.name}")
    tmp = path + ".tmp"
    if path.lower().endswith(".npy"):
        with open(tmp, "wb") as f:
            np.save(f, arr)
    elif path.lower().endswith(".bin"):
        arr.astype(arr.dtype.newbyteorder("<"), copy=False).tofile(tmp)
        side = {**(meta or {}), "dtype": arr.dtype.name, "tokens": int(arr.size)}
        with open(sidecar_path(tmp), "w") as f:
            json.dump(side, f, indent=2)
        os.replace(sidecar_path(tmp), sidecar_path(path))
    else:
        raise InputError(f"{path}: token files end in .npy or .bin")
    os.replace(tmp, path)
    return path


def split_tokens(arr: np.ndarray, eos_id: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) views of one stream: cut after the last eos before 95% (or at 95% with no eos there)."""
    cut = int(len(arr) * (1 - VAL_FRACTION))
    if eos_id is not None and cut > 0:
        step = 1 << 22
        for hi in range(cut, 0, -step):  # scan back for an eos without reading the whole map
            block = np.asarray(arr[max(0, hi - step): hi])
            hits = np.flatnonzero(block == eos_id)
            if hits.size:
                cut = max(0, hi - step) + int(hits[-1]) + 1
                break
    return arr[:cut], arr[cut:]


def load_token_splits(path: str, eos_id: int | None = None) -> tuple[np.ndarray, np.ndarray, dict]:
    """A token file (split 95/5 at a document end: the sidecar's eos_id, else `eos_id`) or a folder with
    train/val token files -> (train, val, metadata)."""
    if os.path.isdir(path):
        found = {}
        for split in ("train", "val"):
            files = [os.path.join(path, split + e) for e in TOKEN_EXTS if os.path.exists(os.path.join(path, split + e))]
            if not files:
                raise InputError(f"{path}: has train{'/'.join(TOKEN_EXTS)} but no {split}.npy or {split}.bin")
            found[split] = read_token_file(files[0])
        (train, meta), (val, _) = found["train"], found["val"]
    else:
        arr, meta = read_token_file(path)
        train, val = split_tokens(arr, meta.get("eos_id", eos_id))
    if len(train) < 2 or len(val) < 2:
        raise InputError(f"{path}: too few tokens to split into train and validation ({len(train) + len(val)})")
    return train, val, meta
