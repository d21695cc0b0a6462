"""Inference state for every mixer kind, held in one `InferenceCache`.

Each token mixer owns one slot (`cache.layer(i, factory)`) and reads/writes it during its forward, so
prefill, chunked prefill and one-token decode are the same call. The cache also tracks, per row, which
of the tokens seen so far are real (`key_mask`, for left-padded batches) and the next position id.

Slots: `KVCache` (attention: allocated once at `max_tokens` when the caller knows it, else grown by doubling),
`WindowKVCache` (a ring of `window` tokens: prefill reads it in time order, a one-token decode as it lies with the
key mask permuted into slot order), `LatentCache` (MLA's latent and shared roped key), `IndexerCache` (the lightning
indexer's keys plus the wrapped attention's slot), `RecurrentCache` (conv tail + float32 state). `nbytes` counts
what is held (tokens seen), not the capacity.

Static decoding (`make_static`, for CUDA graphs): after the prefill every K/V buffer is grown to `max_tokens`, the
write slot and the key mask become tensors advanced in place, a recurrent slot copies new states into its existing
tensors, and host counters move in `advance()` outside the step, so every step has the same shapes and addresses.
"""
from dataclasses import dataclass

import torch
from torch import Tensor


def time_buffer(x: Tensor, cap: int) -> Tensor:
    """An empty buffer shaped like x [B, T, ...] with `cap` time steps. Per-head tensors [B, T, H, D] are stored
    head-major ([B, H, cap, D] seen through a transposed view), so attention reads each head's keys contiguously.
    Zeros, not garbage: the static decode step reads the unwritten tail too (masked, but NaN · 0 would be NaN)."""
    if x.dim() == 4:
        return x.new_zeros(x.shape[0], x.shape[2], cap, x.shape[3]).transpose(1, 2)
    return x.new_zeros(x.shape[0], cap, *x.shape[2:])


class KVCache:
    """Growing key/value buffers [B, S, H, D] with amortised doubling (no per-token reallocation)."""

    def __init__(self, capacity: int = 0):
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.length = 0
        self.capacity = capacity           # tokens to allocate at first use (the expected total, if known)

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append k [B, T, Hk, D], v [B, T, Hk, Dv]; return all keys/values so far."""
        T = k.shape[1]
        need = self.length + T
        if self.k is None or need > self.k.shape[1]:
            cap = max(need, 2 * (self.k.shape[1] if self.k is not None else 0), self.capacity, 16)
            k_new, v_new = time_buffer(k, cap), time_buffer(v, cap)
            if self.length:
                k_new[:, : self.length] = self.k[:, : self.length]
                v_new[:, : self.length] = self.v[:, : self.length]
            self.k, self.v = k_new, v_new
        self.k[:, self.length: need] = k
        self.v[:, self.length: need] = v
        self.length = need
        return self.k[:, :need], self.v[:, :need]

    def reserve(self, n: int):
        """Make the buffers hold at least n tokens (one reallocation at most)."""
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
    def nbytes(self) -> int:
        if self.k is None:
            return 0
        return self.length * (self.k[:, :1].nbytes + self.v[:, :1].nbytes)


class WindowKVCache:
    """Sliding-window attention (`W`): keys/values of the last `window` tokens in ring buffers
    [B, window, H, D] allocated once, so the cache never grows with the context."""

    def __init__(self, window: int):
        self.window = window
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.length = 0                    # tokens seen; the ring holds the last min(length, window)

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append k [B, T, Hk, D], v [B, T, Hv, Dv]; return the P + T keys/values a query of this call can
        see, oldest first: the last P = min(seen, window - 1) cached tokens, then the T new ones."""
        W, T = self.window, k.shape[1]
        if self.k is None:
            self.k = k.new_zeros(k.shape[0], W, *k.shape[2:])
            self.v = v.new_zeros(v.shape[0], W, *v.shape[2:])
        P = min(self.length, W - 1)
        past = (self.length - P + torch.arange(P, device=k.device)) % W   # ring slots, oldest first
        keys, values = torch.cat((self.k[:, past], k), 1), torch.cat((self.v[:, past], v), 1)
        n = min(T, W)                                                      # only the last W new tokens stay
        slots = (self.length + T - n + torch.arange(n, device=k.device)) % W
        self.k[:, slots] = k[:, T - n:]
        self.v[:, slots] = v[:, T - n:]
        self.length += T
        return keys, values

    def step(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """One decode token k [B, 1, Hk, D], v [B, 1, Hv, Dv]: write it into the ring and return the ring as it
        lies (its first F = min(seen, window) slots, no copy) and `order` [F], the chronological place of each
        slot among the last F tokens (to permute a key mask). One query sees all of them: order is irrelevant."""
        W = self.window
        if self.k is None:
            self.k = k.new_zeros(k.shape[0], W, *k.shape[2:])
            self.v = v.new_zeros(v.shape[0], W, *v.shape[2:])
        self.k[:, self.length % W] = k[:, 0]
        self.v[:, self.length % W] = v[:, 0]
        self.length += 1
        F = min(self.length, W)
        return self.k[:, :F], self.v[:, :F], (torch.arange(F, device=k.device) - self.length) % F

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

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else self.k.nbytes + self.v.nbytes


class LatentCache(KVCache):
    """MLA (`L`): only the normalised KV latent [B, S, kv_lora_rank] and the shared roped key [B, S, rope_dim],
    side by side in one buffer (the absorbed decode reads it as one key head without a copy), so a token costs
    (kv_lora_rank + rope_dim) × element size bytes per row."""

    def update(self, latent: Tensor, k_rope: Tensor, at: Tensor | None = None, n: int = 0) -> Tensor:
        """Append latent [B, T, R] and k_rope [B, T, rope]; return [latent | k_rope] of all tokens [B, S, R+rope].
        With `at` (static decode, see `KVCache.write`): write at that slot and return the first n slots."""
        ck = torch.cat((latent, k_rope), -1)
        if at is not None:
            return self.write(ck, latent[..., :0], at, n)[0]
        return super().update(ck, latent[..., :0])[0]


class IndexerCache:
    """Lightning-indexer layer (`I`): the indexer's own keys [B, S, D] plus the slot of the attention it masks
    (`main`, handed out by `layer()` so the wrapped attention reads its cache as usual)."""

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

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + (self.main.nbytes if self.main is not None else 0)


@dataclass
class RecurrentCache:
    """Fixed-size state of a recurrent mixer: the short-conv tail [B, K-1, C] and the float32 state.
    Once `static` (static decoding), assigning a same-shaped new conv/state copies it into the existing tensor,
    so the buffers a captured graph reads and writes keep their addresses while mixers keep rebinding."""
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
        return sum(t.nbytes for t in (self.conv, self.state) if t is not None)


class InferenceCache:
    """Per-layer inference state plus the bookkeeping shared by all layers.

    key_mask [B, S] bool: which of the S tokens seen so far are real (None while all are).
    next_pos [B] long: position id of the next real token of each row.
    """

    def __init__(self, batch_size: int, num_layers: int, device=None, max_tokens: int | None = None):
        self.batch_size = batch_size
        self.max_tokens = max_tokens       # expected total tokens: growing K/V buffers are allocated once
        self.layers: list = [None] * num_layers
        self.seen = 0
        self.key_mask: Tensor | None = None
        self.next_pos = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.static_pos: Tensor | None = None     # static decode: [1] long, the slot of the next token
        self.static_mask: Tensor | None = None    # static decode: [B, max_tokens] bool, real tokens written so far
        # packed documents run in pieces (context parallelism): [B, seen] document index of every token seen; while
        # None, calls with `resets` are refused
        self.segments: Tensor | None = None

    def layer(self, idx: int, factory):
        """The slot of layer `idx`, created by `factory()` on first use."""
        slot = self.layers[idx]
        if slot is None:
            slot = self.layers[idx] = factory()
            if self.max_tokens and isinstance(slot, KVCache):
                slot.capacity = self.max_tokens
        return slot

    def _slots(self):
        for slot in self.layers:
            if isinstance(slot, IndexerCache):
                yield slot.keys
                slot = slot.main
            if slot is not None:
                yield slot

    def make_static(self):
        """Switch to fixed-shape decoding (after the prefill): every K/V buffer is made `max_tokens` long, and the
        write slot and the key mask become tensors updated in place, so one decode step has the same shapes and
        buffer addresses every time (what CUDA graphs and torch.compile(mode="reduce-overhead") need)."""
        from .errors import InputError
        if not self.max_tokens:
            raise InputError("static decoding needs a cache made with max_tokens (prompt + new tokens)")
        if self.seen >= self.max_tokens:
            raise InputError(f"the cache is full: {self.seen} of max_tokens {self.max_tokens} tokens seen")
        dev = self.next_pos.device
        for slot in self._slots():
            if isinstance(slot, KVCache):
                slot.reserve(self.max_tokens)
            elif isinstance(slot, RecurrentCache):
                slot.static = True
        self.static_pos = torch.tensor([self.seen], dtype=torch.long, device=dev)
        self.static_mask = torch.zeros(self.batch_size, self.max_tokens, dtype=torch.bool, device=dev)
        self.static_mask[:, : self.seen] = True if self.key_mask is None else self.key_mask
        if dev.type == "cuda":   # buffers mutated in place by a captured graph must keep their address
            for t in self.static_tensors():
                torch._dynamo.mark_static_address(t)

    def static_tensors(self):
        yield from (self.static_pos, self.static_mask, self.next_pos)
        for slot in self._slots():
            for name in ("k", "v", "conv", "state"):
                t = getattr(slot, name, None)
                if isinstance(t, Tensor):
                    yield t

    def advance(self):
        """Bookkeeping after a static decode step (host ints, kept out of the step so a compiled graph never
        specialises on them): one more token seen in every slot."""
        self.seen += 1
        for slot in self._slots():
            if hasattr(slot, "length"):
                slot.length += 1
        if self.key_mask is not None:
            self.key_mask = self.static_mask[:, : self.seen]

    @property
    def nbytes(self) -> int:
        """Bytes of inference state held (K/V of seen tokens + recurrent states)."""
        return sum(c.nbytes for c in self.layers if c is not None)

    def __repr__(self) -> str:
        return f"InferenceCache(batch={self.batch_size}, seen={self.seen}, nbytes={self.nbytes})"
