"""Cache surgery for continuous batching: one function, `gather`, builds a new `InferenceCache` from chosen rows of
several caches, whatever each layer holds.

The model decodes a batch through one left-padded cache: every row shares the time axis (`seen`) and the key mask
hides each row's padding. Rows of different lengths are aligned at their last token: a row that has seen fewer
tokens is padded on the left, columns that are padding in every chosen row are dropped. Per slot kind:
  KVCache / LatentCache  keys/values [B, S, H, D]: copied at their new offset (zeros, masked, in the padding)
  WindowKVCache          ring [B, W, ...]: token t lies in slot t % W, so shifting a row by d tokens rolls its ring
  RecurrentCache         conv tail and float32 state: no time axis, rows are taken as they are
  IndexerCache           its keys as a KVCache plus the slot of the attention it wraps
The same call clones one cache compactly (a prefix-cache snapshot), resumes from a snapshot, adds a prefilled
request to the running batch and drops finished rows. `place` is the cheap path of the last two: it writes one
prefilled request into a free row of the batch in place (the rest of the batch is not copied).
"""
import torch
from torch import Tensor

from ..cache import IndexerCache, InferenceCache, KVCache, RecurrentCache, WindowKVCache, time_buffer


def _shift_time(parts: list[tuple[Tensor, Tensor, int]], S: int, cap: int) -> Tensor:
    """parts: (buffer [b, S_i(+), ...], rows [r], shift d_i) -> [sum r, cap, ...] holding each source's last S - d_i
    tokens at [d_i, S) (d_i < 0 drops the first -d_i tokens)."""
    first = torch.cat([buf[rows, :1] for buf, rows, _ in parts])
    out = time_buffer(first, cap)
    b = 0
    for buf, rows, (d, s) in parts:
        n = len(rows)
        lo = max(0, -d)
        out[b:b + n, max(0, d):S] = buf[rows, lo:s]
        b += n
    return out


def _gather_slot(slots: list, sources: list[tuple[Tensor, int, int]], S: int, cap: int):
    """One layer's slot from the same layer of every source; sources: (rows, shift d, seen s)."""
    kind = type(slots[0])
    if any(type(s) is not kind for s in slots):
        raise TypeError(f"cannot batch cache slots of kinds {sorted({type(s).__name__ for s in slots})}")
    if isinstance(slots[0], KVCache):                 # KVCache and LatentCache
        new = kind()
        new.k = _shift_time([(sl.k, r, (d, s)) for sl, (r, d, s) in zip(slots, sources)], S, cap)
        new.v = _shift_time([(sl.v, r, (d, s)) for sl, (r, d, s) in zip(slots, sources)], S, cap)
        new.length, new.capacity = S, cap
        return new
    if kind is WindowKVCache:
        new = WindowKVCache(slots[0].window)
        new.k = torch.cat([torch.roll(sl.k[r], d, 1) for sl, (r, d, _) in zip(slots, sources)])
        new.v = torch.cat([torch.roll(sl.v[r], d, 1) for sl, (r, d, _) in zip(slots, sources)])
        new.length = S
        return new
    if kind is RecurrentCache:
        new = RecurrentCache()
        for name in ("conv", "state"):
            ts = [getattr(sl, name) for sl in slots]
            if any(t is not None for t in ts):
                setattr(new, name, torch.cat([t[r] for t, (r, _, _) in zip(ts, sources)]))
        return new
    if kind is IndexerCache:
        new = IndexerCache()
        new.keys = _gather_slot([sl.keys for sl in slots], sources, S, cap)
        if slots[0].main is not None:
            new.main = _gather_slot([sl.main for sl in slots], sources, S, cap)
        return new
    raise TypeError(f"no batching rule for cache slot {kind.__name__}")


def first_real(cache: InferenceCache) -> Tensor:
    """[B] long: the column of each row's first real token (0 where the row has no padding)."""
    if cache.key_mask is None:
        return torch.zeros(cache.batch_size, dtype=torch.long, device=cache.next_pos.device)
    return cache.key_mask.long().argmax(1)


def gather(sources: list[tuple[InferenceCache, list[int]]], extra: int = 0, consume: bool = False) -> InferenceCache:
    """A new cache of the given rows of each source, in order, aligned at their last token, with `extra` free
    time steps in every growing K/V buffer. The sources are left untouched (every tensor is copied), unless
    `consume`: then each source layer is dropped as soon as it is copied, so old and new state coexist for one
    layer at a time (a rebuild of the running batch), not for the whole model."""
    sources = [(c, rows) for c, rows in sources if rows]
    if not sources:
        raise ValueError("gather needs at least one row")
    dev = sources[0][0].next_pos.device
    idx = [torch.tensor(rows, dtype=torch.long, device=dev) for _, rows in sources]
    span = max(int((c.seen - first_real(c)[r]).max()) for (c, _), r in zip(sources, idx))
    S = span
    cap = S + extra
    shifts = [(r, S - c.seen, c.seen) for (c, _), r in zip(sources, idx)]
    out = InferenceCache(sum(len(r) for r in idx), sources[0][0].layers.__len__(), device=dev)
    out.seen = S
    out.next_pos = torch.cat([c.next_pos[r] for (c, _), r in zip(sources, idx)])
    masks = []
    for (c, _), (r, d, s) in zip(sources, shifts):
        km = c.key_mask[r] if c.key_mask is not None else torch.ones(len(r), s, dtype=torch.bool, device=dev)
        m = torch.zeros(len(r), S, dtype=torch.bool, device=dev)
        m[:, max(0, d):] = km[:, max(0, -d):]
        masks.append(m)
    km = torch.cat(masks)
    out.key_mask = None if bool(km.all()) else km
    for i in range(len(out.layers)):
        slots = [c.layers[i] for c, _ in sources]
        if all(s is None for s in slots):
            continue
        if any(s is None for s in slots):
            raise ValueError(f"layer {i} has state in some caches and not in others")
        out.layers[i] = _gather_slot(slots, shifts, S, cap)
        if consume:
            for c, _ in sources:
                c.layers[i] = None
    return out


def _place_slot(dst, i: int, src, d: int, s: int):
    """Write row 0 of slot `src` (s tokens seen) into row i of slot `dst`, shifted right by d tokens."""
    if type(dst) is not type(src):
        raise TypeError(f"cannot place a {type(src).__name__} into a {type(dst).__name__}")
    if isinstance(dst, KVCache):
        dst.k[i, d:d + s] = src.k[0, :s]
        dst.v[i, d:d + s] = src.v[0, :s]
    elif isinstance(dst, WindowKVCache):
        dst.k[i] = torch.roll(src.k[0], d, 0)
        dst.v[i] = torch.roll(src.v[0], d, 0)
    elif isinstance(dst, RecurrentCache):
        for name in ("conv", "state"):
            t = getattr(src, name)
            if t is not None:
                getattr(dst, name)[i] = t[0]
    elif isinstance(dst, IndexerCache):
        _place_slot(dst.keys, i, src.keys, d, s)
        if dst.main is not None:
            _place_slot(dst.main, i, src.main, d, s)
    else:
        raise TypeError(f"no batching rule for cache slot {type(dst).__name__}")


def place(batch: InferenceCache, i: int, src: InferenceCache):
    """Row i of `batch` := the state of the batch-1 cache `src` (whose `seen` must not exceed the batch's: it is
    aligned at its last token, the columns before it masked)."""
    S, s = batch.seen, src.seen
    if s > S:
        raise ValueError(f"a row of {s} tokens does not fit a batch of {S}")
    d = S - s
    if batch.key_mask is None:
        batch.key_mask = torch.ones(batch.batch_size, S, dtype=torch.bool, device=batch.next_pos.device)
    batch.key_mask[i] = False
    batch.key_mask[i, d:] = True if src.key_mask is None else src.key_mask[0]
    batch.next_pos[i] = src.next_pos[0]
    for dst_slot, src_slot in zip(batch.layers, src.layers):
        if dst_slot is not None:
            _place_slot(dst_slot, i, src_slot, d, s)


def _tensors(slot):
    """Every tensor a slot holds."""
    if isinstance(slot, IndexerCache):
        yield from _tensors(slot.keys)
        slot = slot.main
    for name in ("k", "v", "conv", "state"):
        t = getattr(slot, name, None)
        if isinstance(t, Tensor):
            yield t


def allocated_bytes(caches) -> int:
    """Bytes of the storage the caches hold, each storage counted once: capacity, padding and bookkeeping
    included (what is allocated, not the tokens seen), shared storage once."""
    seen, total = set(), 0
    for c in caches:
        ts = [c.next_pos] + ([c.key_mask] if c.key_mask is not None else [])
        ts += [t for slot in c.layers if slot is not None for t in _tensors(slot)]
        for t in ts:
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def _cut_slot(slot, lo: int):
    if isinstance(slot, KVCache):
        new = type(slot)()
        new.k, new.v = slot.k[:, lo:slot.length].clone(), slot.v[:, lo:slot.length].clone()
        new.length = new.capacity = slot.length - lo
        return new
    if isinstance(slot, IndexerCache):
        new = IndexerCache()
        new.keys = _cut_slot(slot.keys, lo)
        new.main = _cut_slot(slot.main, lo) if slot.main is not None else None
        return new
    new = type(slot)(slot.window) if isinstance(slot, WindowKVCache) else type(slot)()
    for name in ("k", "v", "conv", "state", "length"):
        if hasattr(slot, name):
            t = getattr(slot, name)
            setattr(new, name, t.clone() if isinstance(t, Tensor) else t)
    return new


def cut(cache: InferenceCache, lo: int) -> InferenceCache:
    """What a prefix snapshot of the unpadded batch-1 `cache` adds to the snapshot at token `lo`: the K/V of
    tokens [lo, seen) and a copy of every fixed-size state. `stitch` joins a chain of these back into a cache."""
    if cache.key_mask is not None or cache.batch_size != 1:
        raise ValueError("a snapshot is cut from an unpadded batch-1 cache")
    out = InferenceCache(1, len(cache.layers), device=cache.next_pos.device)
    out.seen, out.next_pos = cache.seen, cache.next_pos.clone()
    out.layers = [_cut_slot(s, lo) if s is not None else None for s in cache.layers]
    return out


def cut_bytes(cache: InferenceCache, lo: int) -> int:
    """The bytes `cut(cache, lo)` will hold (checked against the budget before anything is copied)."""
    total = cache.next_pos.nbytes
    for slot in cache.layers:
        for sl in ([slot.keys, slot.main] if isinstance(slot, IndexerCache) else [slot]):
            if isinstance(sl, KVCache):
                total += (sl.length - lo) * (sl.k[:, :1].nbytes + sl.v[:, :1].nbytes)
            elif sl is not None:
                total += sum(t.nbytes for t in _tensors(sl))
    return total


def _stitch_slot(parts: list, extra: int):
    last = parts[-1]
    if isinstance(last, KVCache):
        new = type(last)()
        S = sum(p.length for p in parts)
        new.k, new.v = time_buffer(last.k, S + extra), time_buffer(last.v, S + extra)
        at = 0
        for p in parts:
            new.k[:, at:at + p.length], new.v[:, at:at + p.length] = p.k, p.v
            at += p.length
        new.length, new.capacity = S, S + extra
        return new
    if isinstance(last, IndexerCache):
        new = IndexerCache()
        new.keys = _stitch_slot([p.keys for p in parts], extra)
        new.main = _stitch_slot([p.main for p in parts], extra) if last.main is not None else None
        return new
    return _cut_slot(last, 0)                      # fixed-size state: the last part's, copied


def stitch(parts: list[InferenceCache], extra: int = 0) -> InferenceCache:
    """A batch-1 cache from a chain of `cut`s (oldest first): K/V joined in order with `extra` free steps, the
    fixed-size state of the last part. The parts are left untouched."""
    last = parts[-1]
    out = InferenceCache(1, len(last.layers), device=last.next_pos.device)
    out.seen, out.next_pos = last.seen, last.next_pos.clone()
    out.layers = [_stitch_slot([p.layers[i] for p in parts], extra) if s is not None else None
                  for i, s in enumerate(last.layers)]
    return out


def room(cache: InferenceCache) -> int | None:
    """Tokens every growing K/V buffer of `cache` can still take without reallocating (None: it has none)."""
    left = None
    for slot in cache.layers:
        for sl in ([slot.keys, slot.main] if isinstance(slot, IndexerCache) else [slot]):
            if isinstance(sl, KVCache) and sl.k is not None:
                n = sl.k.shape[1] - sl.length
                left = n if left is None else min(left, n)
    return left
