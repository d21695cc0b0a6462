"""Inference state for every mixer kind, held in one `InferenceCache`.

Each token mixer owns one slot (`cache.layer(i, factory)`) and reads/writes it during its forward, so
prefill, chunked prefill and one-token decode are the same call. The cache also tracks, per row, which
of the tokens seen so far are real (`key_mask`, for left-padded batches) and the next position id.

Two layouts of the rows:
  shared time axis  every row has seen the same `seen` tokens (`generate`, a prefill): a left-padded batch marks its
                    padding in `key_mask`. Buffers are written with slices.
  own lengths       (`lengths` [B] set: the serving batch) row b holds its lengths[b] tokens at columns
                    [0, lengths[b]) of every attention buffer, never padded; a call writes each row's new tokens at
                    its own columns and attention reads each row's own keys (the model turns `lengths` into the
                    masks of `SeqContext`). The row operations below move between the two: rows of equal length
                    go back to the shared axis.

Slots: `KVCache` (attention: allocated once at `max_tokens` when the caller knows it, else grown by doubling),
`WindowKVCache` (a ring of `window` tokens, row b's token t in slot t % window: prefill reads it in time order, a
one-token decode as it lies), `LatentCache` (MLA's latent and shared roped key), `IndexerCache` (the lightning
indexer's keys plus the wrapped attention's slot), `RecurrentCache` (conv tail + float32 state). `nbytes` counts
what is held (tokens seen), not the capacity.

Row operations (the serving engine and speculative decoding use only these; each kind implements them for its own
layout, nothing outside this file asks which kind a slot is):
  `gather(parts, cap)`   a new slot of chosen rows of several slots, each row left-aligned (padding dropped)
  `place(rows, src)`     rows of this slot := the rows of `src` (left-aligned), in place
  `free(rows)`           rows hold nothing (their content is left to be overwritten)
  `trim(rows, n)`        rows keep their first n tokens (attention only: a ring or a recurrent state has no history)
  `snapshot(rows)` / `restore(snap)`   what these rows would lose to later tokens, and putting it back
  `cut(lo)` / `join(parts, extra)`     prefix-cache parts: a batch-1 slot's tokens from `lo`, and a chain joined back
  `tensors()`, `nbytes`, `reserve(n)`, `room`
`InferenceCache` applies each to every layer and keeps the shared bookkeeping (seen, next_pos, lengths) in step.

Static decoding (`make_static`, for CUDA graphs): after the prefill every K/V buffer is grown to `max_tokens`, the
write slot and the key mask become tensors advanced in place, a recurrent slot copies new states into its existing
tensors, and host counters move in `advance()` outside the step, so every step has the same shapes and addresses.
"""
from dataclasses import dataclass

import torch
from torch import Tensor


def time_buffer(x: Tensor, cap: int, rows: int | None = None) -> Tensor:
    """An empty buffer shaped like x [B, T, ...] with `cap` time steps (`rows` rows instead of B if given). Per-head
    tensors [B, T, H, D] are stored head-major ([B, H, cap, D] seen through a transposed view), so attention reads
    each head's keys contiguously.
    Zeros, not garbage: the static decode step reads the unwritten tail too (masked, but NaN · 0 would be NaN)."""
    B = x.shape[0] if rows is None else rows
    if x.dim() == 4:
        return x.new_zeros(B, x.shape[2], cap, x.shape[3]).transpose(1, 2)
    return x.new_zeros(B, cap, *x.shape[2:])


def _rows(rows, device) -> Tensor:
    return rows if isinstance(rows, Tensor) else torch.as_tensor(rows, dtype=torch.long, device=device)


def _per_row(n, rows: Tensor) -> Tensor:
    """n (an int or [r] ints) as a [r] long tensor beside `rows`."""
    return torch.as_tensor(n, dtype=torch.long, device=rows.device).expand(len(rows)).clone()


class _Rows:
    """Per-row lengths shared by the attention kinds. `length` (host int) is the columns in use: every row's length
    on a shared time axis (`_lengths` None), the longest row's otherwise."""
    length: int
    _lengths: Tensor | None

    @property
    def lengths(self) -> Tensor | None:
        """[B] long: tokens held by each row (None before the first write)."""
        if self._lengths is not None:
            return self._lengths
        buf = self._buffer()
        return None if buf is None else torch.full((buf.shape[0],), self.length, dtype=torch.long,
                                                   device=buf.device)

    @property
    def ragged(self) -> bool:
        """Whether rows hold their own lengths (else all hold `length`)."""
        return self._lengths is not None

    def _own_lengths(self) -> Tensor:
        if self._lengths is None:
            self._lengths = self.lengths
        return self._lengths

    def settle(self):
        """Back to the shared time axis when every row holds the same tokens (one host sync: row operations only);
        `length` becomes the longest row's."""
        if self._lengths is not None:
            hi = int(self._lengths.max()) if len(self._lengths) else 0
            self.length = hi
            if len(self._lengths) and int(self._lengths.min()) == hi:
                self._lengths = None

    def free(self, rows: Tensor):
        """Rows `rows` hold nothing (their content stays, to be overwritten)."""
        self._own_lengths()[rows] = 0

    def snapshot_lengths(self, rows: Tensor) -> Tensor:
        return self._own_lengths()[rows].clone()

    def advance(self):
        self.length += 1

    def make_static(self, n: int):
        self.reserve(n)


class KVCache(_Rows):
    """Key/value buffers [B, cap, H, D] (head-major storage) grown with amortised doubling (no per-token
    reallocation). Row b's tokens are at columns [0, lengths[b])."""
    # how a sequence cut into consecutive chunks (context parallelism) joins up: a chunk attends to the keys of
    # every earlier one ("keys"; "latent" and "indexer" the same with their own update), or starts from the
    # state the previous chunk ended with ("carry")
    chunk_join = "keys"

    def __init__(self, capacity: int = 0):
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.length = 0
        self._lengths = None
        self.capacity = capacity           # tokens to allocate at first use (the expected total, if known)

    def _buffer(self):
        return self.k

    def _grow(self, need: int, like_k: Tensor, like_v: Tensor):
        cap = max(need, 2 * (self.k.shape[1] if self.k is not None else 0), self.capacity, 16)
        k_new, v_new = time_buffer(like_k, cap), time_buffer(like_v, cap)
        if self.length:
            k_new[:, : self.length] = self.k[:, : self.length]
            v_new[:, : self.length] = self.v[:, : self.length]
        self.k, self.v = k_new, v_new

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append k [B, T, Hk, D], v [B, T, Hk, Dv] (row b's at its own columns [lengths[b], lengths[b] + T) when
        rows hold their own lengths); return the buffers' first `length` columns (row b's keys are its first
        lengths[b]: the caller masks the rest)."""
        T = k.shape[1]
        need = self.length + T
        if self.k is None or need > self.k.shape[1]:
            self._grow(need, k, v)
        if self._lengths is None:
            self.k[:, self.length: need] = k
            self.v[:, self.length: need] = v
        else:
            cols = self._lengths[:, None] + torch.arange(T, device=k.device)         # [B, T]
            rows = torch.arange(k.shape[0], device=k.device)[:, None]
            self.k[rows, cols] = k
            self.v[rows, cols] = v
            self._lengths += T
        self.length = need
        return self.k[:, :need], self.v[:, :need]

    def reserve(self, n: int):
        """Make the buffers hold at least n tokens per row (one reallocation at most)."""
        if self.k is not None and self.k.shape[1] < n:
            k_new, v_new = time_buffer(self.k, n), time_buffer(self.v, n)
            k_new[:, : self.length] = self.k[:, : self.length]
            v_new[:, : self.length] = self.v[:, : self.length]
            self.k, self.v = k_new, v_new

    def write(self, k: Tensor, v: Tensor, at: Tensor, n: int) -> tuple[Tensor, Tensor]:
        """Static decode: write one token k [B, 1, Hk, D], v [B, 1, Hk, Dv] at slot `at` ([1] long tensor) and return
        the first n slots of the buffers whatever the length (fixed shapes; the caller masks the unwritten tail).
        `length` is left to `InferenceCache.advance` (outside any compiled graph: no int to specialise on)."""
        self.k.index_copy_(1, at, k)
        self.v.index_copy_(1, at, v)
        return self.k[:, :n], self.v[:, :n]

    @property
    def room(self) -> int | None:
        """Tokens every row can still take without reallocating."""
        return None if self.k is None else self.k.shape[1] - self.length

    def _token_bytes(self) -> int:
        return self.k[:1, :1].nbytes + self.v[:1, :1].nbytes

    @property
    def nbytes(self) -> int:
        if self.k is None:
            return 0
        held = self.length * self.k.shape[0] if self._lengths is None else int(self._lengths.sum())
        return held * self._token_bytes()

    def tensors(self):
        yield from (t for t in (self.k, self.v, self._lengths) if t is not None)

    # ---------------------------------------------------------------- row operations
    def _new(self):
        return type(self)()

    @classmethod
    def gather(cls, parts: list, cap: int):
        """A slot of the rows of several slots of this kind, in order. parts: (slot, rows [r] long, starts [r] long
        or None: the column of each row's first real token, to drop left padding); every slot's buffers are copied
        (the parts are left untouched). Row i holds its tokens at [0, n_i) of `cap` columns."""
        new = parts[0][0]._new()
        ks, vs, ns = [], [], []
        for slot, rows, starts in parts:
            n = slot.lengths[rows] - (starts if starts is not None else 0)
            L = int(n.max())                       # the chosen rows' columns only (a batch is compacted)
            if starts is None:
                ks.append(slot.k[rows, :L])
                vs.append(slot.v[rows, :L])
            else:      # row i's columns [starts_i, starts_i + L): what lies past its tokens is masked
                cols = (starts[:, None] + torch.arange(L, device=rows.device)).clamp(max=slot.length - 1)
                ks.append(slot.k[rows[:, None], cols])
                vs.append(slot.v[rows[:, None], cols])
            ns.append(n)
        cap = max(cap, *(k.shape[1] for k in ks))
        R = sum(k.shape[0] for k in ks)
        new.k, new.v = time_buffer(ks[0], cap, rows=R), time_buffer(vs[0], cap, rows=R)
        b = 0
        for k, v in zip(ks, vs):
            new.k[b:b + k.shape[0], : k.shape[1]] = k
            new.v[b:b + v.shape[0], : v.shape[1]] = v
            b += k.shape[0]
        new._lengths = torch.cat(ns)
        new.capacity = cap
        new.settle()
        return new

    def place(self, rows: Tensor, src: "KVCache"):
        """Rows `rows` := the rows of `src` (left-aligned, as `gather` leaves them), growing the buffers if needed."""
        L = src.length
        if self.k is None:
            raise ValueError("cannot place rows into a slot that holds no buffers yet")
        self.reserve(L)
        self.k[rows, :L] = src.k[:, :L]
        self.v[rows, :L] = src.v[:, :L]
        self._own_lengths()[rows] = src.lengths
        self.length = max(self.length, L)

    def trim(self, rows: Tensor, n):
        """Rows `rows` keep their first n tokens (an int or [r] ints): what follows is forgotten."""
        self._own_lengths()[rows] = _per_row(n, rows)

    def snapshot(self, rows: Tensor):
        """Keys already held are never overwritten by later tokens: the lengths are enough to roll back."""
        return self.snapshot_lengths(rows)

    def restore(self, rows: Tensor, snap):
        self._own_lengths()[rows] = snap

    def cut(self, lo: int):
        """Tokens [lo, length) of this batch-1 slot, copied: a prefix-cache part."""
        new = self._new()
        new.k, new.v = self.k[:, lo:self.length].clone(), self.v[:, lo:self.length].clone()
        new.length = new.capacity = self.length - lo
        return new

    def cut_bytes(self, lo: int) -> int:
        return (self.length - lo) * self._token_bytes()

    @classmethod
    def join(cls, parts: list, extra: int):
        """The batch-1 slot of a chain of `cut`s (oldest first) with `extra` free columns."""
        last = parts[-1]
        new = last._new()
        S = sum(p.length for p in parts)
        new.k, new.v = time_buffer(last.k, S + extra), time_buffer(last.v, S + extra)
        at = 0
        for p in parts:
            new.k[:, at:at + p.length], new.v[:, at:at + p.length] = p.k, p.v
            at += p.length
        new.length, new.capacity = S, S + extra
        return new


class WindowKVCache(_Rows):
    """Sliding-window attention (`W`): keys/values of the last `window` tokens in ring buffers
    [B, window, H, D] allocated once, so the cache never grows with the context. Row b's token t lies in slot
    t % window."""
    chunk_join = "keys"

    def __init__(self, window: int):
        self.window = window
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.length = 0                    # tokens seen; the ring holds the last min(length, window)
        self._lengths = None

    def _buffer(self):
        return self.k

    def _alloc(self, k: Tensor, v: Tensor):
        if self.k is None:
            self.k = k.new_zeros(k.shape[0], self.window, *k.shape[2:])
            self.v = v.new_zeros(v.shape[0], self.window, *v.shape[2:])

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append k [B, T, Hk, D], v [B, T, Hv, Dv]; return the P + T keys/values a query of this call can
        see, oldest first: the last P = min(seen, window - 1) cached tokens, then the T new ones. With rows at
        their own lengths P is the longest row's: row b's first P - min(lengths[b], P) are not its tokens (the
        caller masks them)."""
        W, T = self.window, k.shape[1]
        self._alloc(k, v)
        P = min(self.length, W - 1)
        n = min(T, W)                                                      # only the last W new tokens stay
        if self._lengths is None:
            past = (self.length - P + torch.arange(P, device=k.device)) % W   # ring slots, oldest first
            keys, values = torch.cat((self.k[:, past], k), 1), torch.cat((self.v[:, past], v), 1)
            slots = (self.length + T - n + torch.arange(n, device=k.device)) % W
            self.k[:, slots] = k[:, T - n:]
            self.v[:, slots] = v[:, T - n:]
        else:
            rows = torch.arange(k.shape[0], device=k.device)[:, None]
            t = self._lengths[:, None] - P + torch.arange(P, device=k.device)   # [B, P] token index, < 0: none
            keys = torch.cat((self.k[rows, t % W], k), 1)
            values = torch.cat((self.v[rows, t % W], v), 1)
            slots = (self._lengths[:, None] + T - n + torch.arange(n, device=k.device)) % W
            self.k[rows, slots] = k[:, T - n:]
            self.v[rows, slots] = v[:, T - n:]
            self._lengths += T
        self.length += T
        return keys, values

    def step(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """One decode token k [B, 1, Hk, D], v [B, 1, Hv, Dv]: write it into the ring and return the ring as it
        lies (its first F = min(seen, window) slots, no copy) and `order` [F], the chronological place of each
        slot among the last F tokens (to permute a key mask). One query sees all of them: order is irrelevant.
        With rows at their own lengths `order` is None: row b sees its first min(lengths[b], window) slots."""
        W = self.window
        self._alloc(k, v)
        if self._lengths is None:
            self.k[:, self.length % W] = k[:, 0]
            self.v[:, self.length % W] = v[:, 0]
        else:
            rows = torch.arange(k.shape[0], device=k.device)
            self.k[rows, self._lengths % W] = k[:, 0]
            self.v[rows, self._lengths % W] = v[:, 0]
            self._lengths += 1
        self.length += 1
        F = min(self.length, W)
        order = (torch.arange(F, device=k.device) - self.length) % F if self._lengths is None else None
        return self.k[:, :F], self.v[:, :F], order

    def write(self, k: Tensor, v: Tensor, at: Tensor, key_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Static decode of token `at` ([1] long tensor): write it into the ring and return the window in
        chronological order, keys/values [B, window, ...] and their key mask [B, window] (False before the first
        token or on padding; `key_mask` [B, S] covers every token). Fixed shapes at every step."""
        W = self.window
        self.k.index_copy_(1, at % W, k)
        self.v.index_copy_(1, at % W, v)
        t = at - W + 1 + torch.arange(W, device=at.device)                 # the window's tokens, oldest first
        slots = t % W
        km = key_mask.index_select(1, t.clamp(min=0)) & (t >= 0)
        return self.k.index_select(1, slots), self.v.index_select(1, slots), km

    room = None

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else self.k.nbytes + self.v.nbytes

    def tensors(self):
        yield from (t for t in (self.k, self.v, self._lengths) if t is not None)

    # ---------------------------------------------------------------- row operations
    @classmethod
    def gather(cls, parts: list, cap: int):
        """As `KVCache.gather`: a row with `starts` s of padding is rolled back by s (its token t - s lands in slot
        (t - s) % window)."""
        W = parts[0][0].window
        new = cls(W)
        ks, vs, ns = [], [], []
        for slot, rows, starts in parts:
            n = slot.lengths[rows]
            if starts is None:
                ks.append(slot.k[rows])
                vs.append(slot.v[rows])
            else:
                idx = (torch.arange(W, device=rows.device) + starts[:, None]) % W
                ks.append(slot.k[rows[:, None], idx])
                vs.append(slot.v[rows[:, None], idx])
                n = n - starts
            ns.append(n)
        new.k, new.v = torch.cat(ks), torch.cat(vs)
        new._lengths = torch.cat(ns)
        new.settle()
        return new

    def place(self, rows: Tensor, src: "WindowKVCache"):
        self.k[rows] = src.k
        self.v[rows] = src.v
        self._own_lengths()[rows] = src.lengths
        self.length = max(self.length, src.length)

    def trim(self, rows: Tensor, n):
        raise ValueError("a window's ring has no history to trim (its older slots are overwritten): snapshot and "
                         "restore it instead")

    def snapshot(self, rows: Tensor):
        return self.k[rows].clone(), self.v[rows].clone(), self.snapshot_lengths(rows)

    def restore(self, rows: Tensor, snap):
        self.k[rows], self.v[rows], self._own_lengths()[rows] = snap

    def cut(self, lo: int):
        new = WindowKVCache(self.window)
        new.k, new.v, new.length = self.k.clone(), self.v.clone(), self.length
        return new

    def cut_bytes(self, lo: int) -> int:
        return self.nbytes

    @classmethod
    def join(cls, parts: list, extra: int):
        return parts[-1].cut(0)                      # fixed-size state: the last part's, copied

    def reserve(self, n: int):
        pass


class LatentCache(KVCache):
    """MLA (`L`): only the normalised KV latent [B, S, kv_lora_rank] and the shared roped key [B, S, rope_dim],
    side by side in one buffer (the absorbed decode reads it as one key head without a copy), so a token costs
    (kv_lora_rank + rope_dim) × element size bytes per row."""
    chunk_join = "latent"

    def update(self, latent: Tensor, k_rope: Tensor, at: Tensor | None = None, n: int = 0) -> Tensor:
        """Append latent [B, T, R] and k_rope [B, T, rope]; return [latent | k_rope] of all tokens [B, S, R+rope].
        With `at` (static decode, see `KVCache.write`): write at that slot and return the first n slots."""
        ck = torch.cat((latent, k_rope), -1)
        if at is not None:
            return self.write(ck, latent[..., :0], at, n)[0]
        return super().update(ck, latent[..., :0])[0]


class IndexerCache:
    """Lightning-indexer layer (`I`): the indexer's own keys [B, S, D] plus the slot of the attention it masks
    (`main`, handed out by `layer()` so the wrapped attention reads its cache as usual). Row operations apply to
    both."""
    chunk_join = "indexer"

    def __init__(self):
        self.main = None
        self.keys = KVCache()          # keys in `k`; `v` has zero width

    def layer(self, idx: int, factory):
        if self.main is None:
            self.main = factory()
        return self.main

    def update_keys(self, k: Tensor, at: Tensor | None = None, n: int = 0) -> Tensor:
        if at is not None:
            return self.keys.write(k, k[..., :0], at, n)[0]
        return self.keys.update(k, k[..., :0])[0]

    def _both(self):
        return [s for s in (self.keys, self.main) if s is not None]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._both())

    @property
    def room(self) -> int | None:
        rooms = [s.room for s in self._both() if s.room is not None]
        return min(rooms) if rooms else None

    def tensors(self):
        for s in self._both():
            yield from s.tensors()

    @classmethod
    def gather(cls, parts: list, cap: int):
        new = cls()
        new.keys = KVCache.gather([(p.keys, r, s) for p, r, s in parts], cap)
        if parts[0][0].main is not None:
            main = [(p.main, r, s) for p, r, s in parts]
            new.main = type(main[0][0]).gather(main, cap)
        return new

    def place(self, rows, src):
        self.keys.place(rows, src.keys)
        if self.main is not None:
            self.main.place(rows, src.main)

    def _each(self, name: str, rows, *args):
        return [getattr(s, name)(rows, *args) for s in self._both()]

    def free(self, rows):
        self._each("free", rows)

    def trim(self, rows, n):
        self._each("trim", rows, n)

    def snapshot(self, rows):
        return self._each("snapshot", rows)

    def restore(self, rows, snap):
        for s, part in zip(self._both(), snap):
            s.restore(rows, part)

    def reserve(self, n: int):
        for s in self._both():
            s.reserve(n)

    def settle(self):
        for s in self._both():
            s.settle()

    def advance(self):
        for s in self._both():
            s.advance()

    def make_static(self, n: int):
        for s in self._both():
            s.make_static(n)

    def cut(self, lo: int):
        new = IndexerCache()
        new.keys = self.keys.cut(lo)
        new.main = self.main.cut(lo) if self.main is not None else None
        return new

    def cut_bytes(self, lo: int) -> int:
        return sum(s.cut_bytes(lo) for s in self._both())

    @classmethod
    def join(cls, parts: list, extra: int):
        new = cls()
        new.keys = KVCache.join([p.keys for p in parts], extra)
        if parts[-1].main is not None:
            new.main = type(parts[-1].main).join([p.main for p in parts], extra)
        return new


@dataclass
class RecurrentCache:
    """Fixed-size state of a recurrent mixer: the short-conv tail [B, K-1, C] and the float32 state.
    Once `static` (static decoding), assigning a same-shaped new conv/state copies it into the existing tensor,
    so the buffers a captured graph reads and writes keep their addresses while mixers keep rebinding."""
    chunk_join = "carry"
    conv: Tensor | None = None
    state: Tensor | None = None
    static: bool = False

    def __setattr__(self, name, value):
        old = self.__dict__.get(name)
        if self.__dict__.get("static") and isinstance(old, Tensor) and isinstance(value, Tensor) \
                and old.shape == value.shape:
            if value is not old:                        # (a data_ptr test would break the compiled decode graph)
                old.copy_(value)
        else:
            object.__setattr__(self, name, value)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    room = None

    def tensors(self):
        yield from (t for t in (self.conv, self.state) if t is not None)

    # ---------------------------------------------------------------- row operations (no time axis)
    @classmethod
    def gather(cls, parts: list, cap: int):
        new = cls()
        for name in ("conv", "state"):
            ts = [(getattr(slot, name), rows) for slot, rows, _ in parts]
            if any(t is not None for t, _ in ts):
                setattr(new, name, torch.cat([t[rows] for t, rows in ts]))
        return new

    def place(self, rows: Tensor, src: "RecurrentCache"):
        for name in ("conv", "state"):
            t = getattr(src, name)
            if t is not None:
                getattr(self, name)[rows] = t

    def free(self, rows):
        pass

    def trim(self, rows, n):
        raise ValueError("a recurrent state cannot be cut back to an earlier token: snapshot and restore it instead")

    def snapshot(self, rows: Tensor):
        return [t[rows].clone() if t is not None else None for t in (self.conv, self.state)]

    def restore(self, rows: Tensor, snap):
        for t, saved in zip((self.conv, self.state), snap):
            if t is not None:
                t[rows] = saved

    def reserve(self, n: int):
        pass

    def settle(self):
        pass

    def advance(self):
        pass

    def make_static(self, n: int):
        self.static = True

    def cut(self, lo: int):
        return RecurrentCache(*(t.clone() if t is not None else None for t in (self.conv, self.state)))

    def cut_bytes(self, lo: int) -> int:
        return self.nbytes

    @classmethod
    def join(cls, parts: list, extra: int):
        return parts[-1].cut(0)


class InferenceCache:
    """Per-layer inference state plus the bookkeeping shared by all layers.

    key_mask [B, S] bool: which of the S tokens seen so far are real (None while all are; shared time axis only).
    next_pos [B] long: position id of the next real token of each row.
    lengths [B] long or None: tokens held by each row when rows hold their own lengths (the serving batch: row b's
        attention keys at columns [0, lengths[b]), no padding), None on a shared time axis. `seen` is then the
        longest row's.
    """

    def __init__(self, batch_size: int, num_layers: int, device=None, max_tokens: int | None = None):
        self.batch_size = batch_size
        self.max_tokens = max_tokens       # expected total tokens: growing K/V buffers are allocated once
        self.layers: list = [None] * num_layers
        self.seen = 0
        self.key_mask: Tensor | None = None
        self.next_pos = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.lengths: Tensor | None = None
        self.static_pos: Tensor | None = None     # static decode: [1] long, the slot of the next token
        self.static_mask: Tensor | None = None    # static decode: [B, max_tokens] bool, real tokens written so far
        # packed documents run in pieces (context parallelism): [B, seen] document index of every token seen; while
        # None, calls with `resets` are refused
        self.segments: Tensor | None = None

    @property
    def device(self):
        return self.next_pos.device

    def layer(self, idx: int, factory):
        """The slot of layer `idx`, created by `factory()` on first use."""
        slot = self.layers[idx]
        if slot is None:
            slot = self.layers[idx] = factory()
            if self.max_tokens and hasattr(slot, "capacity"):
                slot.capacity = self.max_tokens
        return slot

    def _slots(self):
        return [s for s in self.layers if s is not None]

    def make_static(self):
        """Switch to fixed-shape decoding (after the prefill): every K/V buffer is made `max_tokens` long, and the
        write slot and the key mask become tensors updated in place, so one decode step has the same shapes and
        buffer addresses every time (what CUDA graphs and torch.compile(mode="reduce-overhead") need)."""
        from .errors import InputError
        if not self.max_tokens:
            raise InputError("static decoding needs a cache made with max_tokens (prompt + new tokens)")
        if self.seen >= self.max_tokens:
            raise InputError(f"the cache is full: {self.seen} of max_tokens {self.max_tokens} tokens seen")
        if self.lengths is not None:
            raise InputError("static decoding needs rows on a shared time axis, not at their own lengths")
        dev = self.next_pos.device
        for slot in self._slots():
            slot.make_static(self.max_tokens)
        self.static_pos = torch.tensor([self.seen], dtype=torch.long, device=dev)
        self.static_mask = torch.zeros(self.batch_size, self.max_tokens, dtype=torch.bool, device=dev)
        self.static_mask[:, : self.seen] = True if self.key_mask is None else self.key_mask
        if dev.type == "cuda":   # buffers mutated in place by a captured graph must keep their address
            for t in self.static_tensors():
                torch._dynamo.mark_static_address(t)

    def static_tensors(self):
        yield from (self.static_pos, self.static_mask, self.next_pos)
        for slot in self._slots():
            yield from slot.tensors()

    def advance(self):
        """Bookkeeping after a static decode step (host ints, kept out of the step so a compiled graph never
        specialises on them): one more token seen in every slot."""
        self.seen += 1
        for slot in self._slots():
            slot.advance()
        if self.key_mask is not None:
            self.key_mask = self.static_mask[:, : self.seen]

    @property
    def nbytes(self) -> int:
        """Bytes of inference state held (K/V of seen tokens + recurrent states)."""
        return sum(c.nbytes for c in self.layers if c is not None)

    def tensors(self):
        """Every tensor the cache holds: bookkeeping and each slot's."""
        yield from (t for t in (self.next_pos, self.key_mask, self.lengths) if t is not None)
        for slot in self.layers:
            if slot is not None:
                yield from slot.tensors()

    # ---------------------------------------------------------------- row operations
    def row_lengths(self) -> Tensor:
        """[B] long: tokens each row holds (padding of a left-padded row excluded)."""
        if self.lengths is not None:
            return self.lengths
        n = torch.full((self.batch_size,), self.seen, dtype=torch.long, device=self.device)
        return n if self.key_mask is None else n - self._starts()

    def _starts(self) -> Tensor | None:
        """[B] long: the column of each row's first real token (None when no row is padded)."""
        if self.key_mask is None:
            return None
        return self.key_mask.long().argmax(1)

    def settle(self):
        """Rows that all hold the same tokens go back to the shared time axis, and the columns in use shrink to the
        longest row's (host syncs: between steps only). Every slot follows."""
        if self.lengths is None:
            return
        self.seen = int(self.lengths.max()) if self.batch_size else 0
        if self.batch_size and int(self.lengths.min()) == self.seen:
            self.lengths = None
        for slot in self._slots():
            slot.settle()

    def _own_lengths(self) -> Tensor:
        if self.key_mask is not None:
            raise ValueError("row operations need rows without padding: take the rows out first (`take`)")
        if self.lengths is None:
            self.lengths = self.row_lengths().clone()
        return self.lengths

    @classmethod
    def concat(cls, sources: list, cap: int = 0, consume: bool = False) -> "InferenceCache":
        """A new cache of the given rows of each source (source, rows), in order, every row left-aligned at its own
        length (padding dropped), with room for `cap` tokens per row in growing K/V buffers (at least the longest
        row). Every tensor is copied: the sources are left untouched, unless `consume`: then each source layer is
        dropped as soon as it is copied, so old and new state coexist for one layer at a time."""
        sources = [(c, _rows(rows, c.device)) for c, rows in sources if len(rows)]
        if not sources:
            raise ValueError("concat needs at least one row")
        first = sources[0][0]
        starts = [c._starts() for c, _ in sources]
        starts = [s[r] if s is not None else None for s, (_, r) in zip(starts, sources)]
        out = cls(sum(len(r) for _, r in sources), len(first.layers), device=first.device)
        out.next_pos = torch.cat([c.next_pos[r] for c, r in sources])
        out.lengths = torch.cat([c.row_lengths()[r] for c, r in sources])
        out.settle()
        cap = max(cap, out.seen)
        for i in range(len(out.layers)):
            slots = [c.layers[i] for c, _ in sources]
            if all(s is None for s in slots):
                continue
            if any(s is None for s in slots):
                raise ValueError(f"layer {i} has state in some caches and not in others")
            kinds = {type(s) for s in slots}
            if len(kinds) > 1:
                raise TypeError(f"cannot batch cache slots of kinds {sorted(k.__name__ for k in kinds)}")
            out.layers[i] = type(slots[0]).gather([(s, r, st) for s, (_, r), st in zip(slots, sources, starts)],
                                                  cap)
            if consume:
                for c, _ in sources:
                    c.layers[i] = None
        return out

    def take(self, rows, cap: int = 0) -> "InferenceCache":
        """A new cache of `rows` (copies, left-aligned: a padded row loses its padding), room for `cap` tokens."""
        return InferenceCache.concat([(self, rows)], cap)

    def place(self, rows, src: "InferenceCache"):
        """Rows `rows` of this cache := every row of `src` (unpadded), in place: each row's tokens at columns
        [0, its length), the rest of the batch untouched. Buffers too short for them grow (prefer `reserve`)."""
        rows = _rows(rows, self.device)
        if src.key_mask is not None:
            src = src.take(range(src.batch_size))
        lengths = self._own_lengths()
        n = src.row_lengths()
        for dst, s in zip(self.layers, src.layers):
            if dst is not None:
                if type(dst) is not type(s):
                    raise TypeError(f"cannot place a {type(s).__name__} into a {type(dst).__name__}")
                dst.place(rows, s)
        lengths[rows] = n
        self.next_pos[rows] = src.next_pos
        self.seen = max(self.seen, src.seen)
        self.settle()

    def free(self, rows):
        """Rows `rows` hold nothing from now on (a free row of the serving batch: it runs a dummy token at position 0,
        whose output is dropped, until a request is placed there)."""
        rows = _rows(rows, self.device)
        lengths = self._own_lengths()
        for slot in self.layers:
            if slot is not None:
                slot.free(rows)
        lengths[rows] = 0
        self.next_pos[rows] = 0

    def trim(self, rows, n):
        """Rows `rows` keep their first n tokens (an int or [r] ints) in every attention layer, and their next
        position goes back by what they drop. A layer with no per-token history (a ring, a recurrent state) raises
        ValueError: roll those back with `snapshot` / `restore`."""
        rows = _rows(rows, self.device)
        n = _per_row(n, rows)
        lengths = self._own_lengths()
        for slot in self.layers:
            if slot is not None:
                slot.trim(rows, n)
        self.next_pos[rows] -= lengths[rows] - n
        lengths[rows] = n

    def snapshot(self, rows=None):
        """What rows `rows` (default all) would lose to later tokens: each slot's own (a K/V buffer its lengths, a
        ring or recurrent state a copy) and the bookkeeping. `restore(snap)` puts them back exactly."""
        rows = _rows(range(self.batch_size) if rows is None else rows, self.device)
        lengths = self._own_lengths()
        return (rows, lengths[rows].clone(), self.next_pos[rows].clone(),
                [s.snapshot(rows) if s is not None else None for s in self.layers])

    def restore(self, snap):
        """Back to a `snapshot` of some rows: tokens written since are forgotten, states are as they were."""
        rows, lengths, next_pos, layers = snap
        for slot, part in zip(self.layers, layers):
            if slot is not None and part is not None:
                slot.restore(rows, part)
        self._own_lengths()[rows] = lengths
        self.next_pos[rows] = next_pos

    def reserve(self, n: int):
        """Every growing K/V buffer holds at least n tokens per row (one reallocation each at most)."""
        for slot in self.layers:
            if slot is not None:
                slot.reserve(n)

    @property
    def room(self) -> int | None:
        """Tokens every row's growing K/V buffers can still take without reallocating (None: it has none)."""
        rooms = [s.room for s in self.layers if s is not None and s.room is not None]
        return min(rooms) if rooms else None

    def cut(self, lo: int) -> "InferenceCache":
        """What a prefix snapshot of this unpadded batch-1 cache adds to the snapshot at token `lo`: the K/V of
        tokens [lo, seen) and a copy of every fixed-size state. `stitch` joins a chain of these back."""
        if self.key_mask is not None or self.lengths is not None or self.batch_size != 1:
            raise ValueError("a snapshot is cut from an unpadded batch-1 cache")
        out = InferenceCache(1, len(self.layers), device=self.device)
        out.seen, out.next_pos = self.seen, self.next_pos.clone()
        out.layers = [s.cut(lo) if s is not None else None for s in self.layers]
        return out

    def cut_bytes(self, lo: int) -> int:
        """The bytes `cut(lo)` will hold (checked against a budget before anything is copied)."""
        return self.next_pos.nbytes + sum(s.cut_bytes(lo) for s in self.layers if s is not None)

    @classmethod
    def stitch(cls, parts: list, extra: int = 0) -> "InferenceCache":
        """A batch-1 cache from a chain of `cut`s (oldest first): K/V joined in order with `extra` free columns,
        the fixed-size states of the last part. The parts are left untouched."""
        last = parts[-1]
        out = cls(1, len(last.layers), device=last.device)
        out.seen, out.next_pos = last.seen, last.next_pos.clone()
        out.layers = [type(s).join([p.layers[i] for p in parts], extra) if s is not None else None
                      for i, s in enumerate(last.layers)]
        return out

    def __repr__(self) -> str:
        return f"InferenceCache(batch={self.batch_size}, seen={self.seen}, nbytes={self.nbytes})"


def allocated_bytes(caches) -> int:
    """Bytes of the storage the caches hold, each storage counted once: capacity, padding and bookkeeping
    included (what is allocated, not the tokens seen), shared storage once."""
    seen, total = set(), 0
    for c in caches:
        for t in c.tensors():
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total
