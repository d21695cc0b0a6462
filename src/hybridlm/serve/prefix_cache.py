"""Prefix cache: whole-model state snapshots at block boundaries of prompts, for every layout.

A recurrent state cannot be cut at an arbitrary position, so (as vLLM's `mamba_cache_mode`) the state is saved at
block boundaries: after prefilling tokens [0, k·block) the cache is kept under the hash of blocks 0..k-1 (a chain:
block k's key hashes block k's tokens with block k-1's key). An entry stores only what its parent lacks
(`InferenceCache.cut`): the K/V of its own block and the fixed-size states (recurrent states, conv tails, window
rings), so the K/V of a long prompt is stored once, not once per block. A later prompt that starts with the same
blocks resumes from its longest cached block (`InferenceCache.stitch` joins the chain) and prefills only the rest.
Since prefill runs in chunks that end at block boundaries, the resumed computation is the sequence of operations of
the uncached one. Entries are evicted least recently used first to stay under a byte budget; an evicted entry takes
its descendants with it (they cannot be resumed without it).
"""
import hashlib
from collections import OrderedDict

import numpy as np

from ..cache import InferenceCache


def block_hashes(ids: list[int], block: int) -> list[bytes]:
    """The chain key of every full block of `ids`: key i covers tokens [0, (i+1)·block)."""
    keys, prev = [], b""
    for i in range(len(ids) // block):
        chunk = np.asarray(ids[i * block:(i + 1) * block], dtype=np.int64).tobytes()
        prev = hashlib.blake2b(prev + chunk, digest_size=16).digest()
        keys.append(prev)
    return keys


class PrefixCache:
    """LRU of (chain key -> the part of the snapshot its parent lacks) under `max_bytes` (0 disables it)."""

    def __init__(self, block: int, max_bytes: int):
        if block < 1:
            raise ValueError(f"prefix block must be >= 1, got {block}")
        self.block, self.max_bytes = block, max_bytes
        self.entries: OrderedDict[bytes, tuple[InferenceCache, bytes | None, int]] = OrderedDict()
        self.children: dict[bytes, set] = {}
        self.nbytes = 0
        self.hits = self.misses = self.hit_tokens = 0

    def longest(self, keys: list[bytes]) -> tuple[int, list[InferenceCache]]:
        """(blocks covered, the chain of parts, oldest first) of the longest cached prefix among chain keys `keys`
        ((0, []) if none)."""
        for n in range(len(keys), 0, -1):
            if keys[n - 1] in self.entries:
                for k in keys[:n]:                    # the whole chain is used: keep it recent
                    self.entries.move_to_end(k)
                self.hits += 1
                self.hit_tokens += n * self.block
                return n, [self.entries[k][0] for k in keys[:n]]
        if keys:
            self.misses += 1
        return 0, []

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def room(self, size: int, limit: int | None = None) -> bool:
        """Whether an entry of `size` bytes can be kept (evicting others if needed) with the cache held to
        min(max_bytes, limit) bytes."""
        return size <= min(self.max_bytes, self.max_bytes if limit is None else limit)

    def put(self, key: bytes, parent: bytes | None, part: InferenceCache, size: int, limit: int | None = None):
        """Keep `part` (owned from now on) under `key`, evicting the least recently used entries to fit in
        min(max_bytes, limit). The parent must be cached (block 0 has none)."""
        if key in self.entries or not self.room(size, limit) or (parent is not None and parent not in self.entries):
            return
        self.shrink(min(self.max_bytes, self.max_bytes if limit is None else limit) - size)
        if parent is not None and parent not in self.entries:      # evicted to make room: the part is useless
            return
        self.entries[key] = (part, parent, size)
        self.children.setdefault(parent, set()).add(key)
        self.nbytes += size

    def shrink(self, to: int):
        """Evict least recently used entries (with their descendants) until at most `to` bytes are held."""
        while self.nbytes > max(to, 0) and self.entries:
            self._evict(next(iter(self.entries)))

    def _evict(self, key: bytes):
        for child in self.children.pop(key, ()):
            if child in self.entries:
                self._evict(child)
        _, parent, size = self.entries.pop(key)
        self.children.get(parent, set()).discard(key)
        self.nbytes -= size

    def parts(self) -> list[InferenceCache]:
        return [e[0] for e in self.entries.values()]

    def clear(self):
        self.entries.clear()
        self.children.clear()
        self.nbytes = 0
