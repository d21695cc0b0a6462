"""Inference state for every mixer kind, held in one `InferenceCache`.

Each token mixer owns one slot (`cache.layer(i, factory)`) and reads/writes it during its forward, so
prefill, chunked prefill and one-token decode are the same call. The cache also tracks, per row, which
of the tokens seen so far are real (`key_mask`, for left-padded batches) and the next position id.
"""
from dataclasses import dataclass

import torch
from torch import Tensor


def _time_buffer(x: Tensor, cap: int) -> Tensor:
    """An empty buffer shaped like x [B, T, ...] with `cap` time steps. Per-head tensors [B, T, H, D] are stored
    head-major ([B, H, cap, D] seen through a transposed view), so attention reads each head's keys contiguously."""
    if x.dim() == 4:
        return x.new_empty(x.shape[0], x.shape[2], cap, x.shape[3]).transpose(1, 2)
    return x.new_empty(x.shape[0], cap, *x.shape[2:])


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
            k_new, v_new = _time_buffer(k, cap), _time_buffer(v, cap)
            if self.length:
                k_new[:, : self.length] = self.k[:, : self.length]
                v_new[:, : self.length] = self.v[:, : self.length]
            self.k, self.v = k_new, v_new
        self.k[:, self.length: need] = k
        self.v[:, self.length: need] = v
        self.length = need
        return self.k[:, :need], self.v[:, :need]

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

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else self.k.nbytes + self.v.nbytes


class LatentCache(KVCache):
    """MLA (`L`): only the normalised KV latent [B, S, kv_lora_rank] and the shared roped key [B, S, rope_dim],
    side by side in one buffer (the absorbed decode reads it as one key head without a copy), so a token costs
    (kv_lora_rank + rope_dim) × element size bytes per row."""

    def update(self, latent: Tensor, k_rope: Tensor) -> Tensor:
        """Append latent [B, T, R] and k_rope [B, T, rope]; return [latent | k_rope] of all tokens [B, S, R+rope]."""
        return super().update(torch.cat((latent, k_rope), -1), latent[..., :0])[0]


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

    def update_keys(self, k: Tensor) -> Tensor:
        return self.keys.update(k, k[..., :0])[0]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + (self.main.nbytes if self.main is not None else 0)


@dataclass
class RecurrentCache:
    """Fixed-size state of a recurrent mixer: the short-conv tail [B, K-1, C] and the float32 state."""
    conv: Tensor | None = None
    state: Tensor | None = None

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

    def layer(self, idx: int, factory):
        """The slot of layer `idx`, created by `factory()` on first use."""
        slot = self.layers[idx]
        if slot is None:
            slot = self.layers[idx] = factory()
            if self.max_tokens and isinstance(slot, KVCache):
                slot.capacity = self.max_tokens
        return slot

    @property
    def nbytes(self) -> int:
        """Bytes of inference state held (K/V of seen tokens + recurrent states)."""
        return sum(c.nbytes for c in self.layers if c is not None)

    def __repr__(self) -> str:
        return f"InferenceCache(batch={self.batch_size}, seen={self.seen}, nbytes={self.nbytes})"
