"""Prefix cache: whole-model state snapshots at block boundaries of prompts, for every layout.

A recurrent state cannot be cut at an arbitrary position, so (as vLLM's `mamba_cache_mode`) the state is saved at
block boundaries: after prefilling tokens [0, k·block) a copy of the whole cache (recurrent states, conv tails,
window rings, K/V of those tokens) is kept under the hash of blocks 0..k-1 (a chain: block k's key hashes block k's
tokens with block k-1's key). A later prompt that starts with the same blocks resumes from its longest cached
block and prefills only the rest. Since prefill always runs in chunks that end at block boundaries, the resumed
computation is the same sequence of operations as the uncached one: identical results with and without a hit.
Entries are evicted least recently used first to stay under a byte budget.
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
    """LRU of (chain key -> batch-1 InferenceCache snapshot) under `max_bytes` (0 disables it)."""

    def __init__(self, block: int, max_bytes: int):
        if block < 1:
            raise ValueError(f"prefix block must be >= 1, got {block}")
        self.block, self.max_bytes = block, max_bytes
        self.entries: OrderedDict[bytes, tuple[InferenceCache, int]] = OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = self.hit_tokens = 0

    def longest(self, keys: list[bytes]) -> tuple[int, InferenceCache | None]:
        """(blocks covered, snapshot) of the longest cached prefix among chain keys `keys` ((0, None) if none)."""
        for n in range(len(keys), 0, -1):
            entry = self.entries.get(keys[n - 1])
            if entry is not None:
                self.entries.move_to_end(keys[n - 1])
                self.hits += 1
                self.hit_tokens += n * self.block
                return n, entry[0]
        if keys:
            self.misses += 1
        return 0, None

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def put(self, key: bytes, snapshot: InferenceCache):
        """Keep `snapshot` (owned from now on) under `key`, evicting the least recently used entries to fit."""
        size = snapshot.nbytes
        if size > self.max_bytes or key in self.entries:
            return
        while self.nbytes + size > self.max_bytes:
            _, (_, old) = self.entries.popitem(last=False)
            self.nbytes -= old
        self.entries[key] = (snapshot, size)
        self.nbytes += size

    def clear(self):
        self.entries.clear()
        self.nbytes = 0
