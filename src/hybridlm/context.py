"""What every mixer needs to know about the current call besides its input: positions, masks, resets.

One object passed to every token mixer (`forward(x, *, ctx, cache)`) instead of separate position and mask
arguments: the model builds it once per call, and the rotary tables it hands out are computed once per
(dim, base) and shared by all layers.
"""
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .ops.rope import rope_cos_sin


@dataclass
class SeqContext:
    """Per-forward facts shared by all layers (built once by the model).

    positions  [B, T] long: rotary position of each new token (left padding starts real tokens at 0).
    pad_mask   [B, T] bool or None: True for real tokens of this call.
    key_mask   [B, S] bool or None: True for real tokens among cached + new keys (S = cached + T). With cache rows at
               their own lengths (`lengths`) it says which columns each row's queries see: [B, S] for one query,
               [B, T, S] for several (row b's query t sees its first lengths[b] + t + 1 keys).
    resets     [B, T] bool or None: a packed document starts here; recurrent state and attention stop
               at the boundary.
    segment_ids ([B, T], [B, S]) or None: document index of queries/keys, derived from `resets`.
    embeddings [B, T, d] or None: the input of the first block (token embeddings after scale/norm/positions),
               set by CausalLM; Zamba2's shared blocks (`Z`) concatenate it to their input.
    cache_pos  [1] long or None: static decode (one token): the cache slot it is written to; key_mask then
               spans the whole preallocated cache [B, max_tokens] and hides the unwritten tail.
    lengths    [B] long or None: the cache's rows hold their own lengths (the serving batch): tokens row b held
               before this call; its T new tokens go to columns [lengths[b], lengths[b] + T).
    cpu_steps  True on a CPU decode step the blocks hand to the mixers' whole C++ steps (layers/cpu_steps.py).
    """
    positions: Tensor
    pad_mask: Tensor | None = None
    key_mask: Tensor | None = None
    resets: Tensor | None = None
    segment_ids: tuple[Tensor, Tensor] | None = None
    embeddings: Tensor | None = None
    cache_pos: Tensor | None = None
    lengths: Tensor | None = None
    cpu_steps: bool = False
    _memo: dict = field(default_factory=dict, repr=False)     # per forward: rotary tables, left pads

    def rope(self, dim: int, base: float) -> tuple[Tensor, Tensor]:
        """cos, sin [B, T, dim/2], computed once per (dim, base) per forward and shared by layers."""
        key = (dim, base)
        if key not in self._memo:
            self._memo[key] = rope_cos_sin(self.positions, dim, base)
        return self._memo[key]

    def left_pads(self) -> "Tensor | None | bool":
        """How many pad tokens lead each row's keys, int64 [B], when the key mask is a left padding (pads, then only
        real tokens); None without a key mask; False for any other mask. Computed once per forward."""
        if "left_pads" not in self._memo:
            km = self.key_mask
            if km is None:
                self._memo["left_pads"] = None
            else:
                lo = (~km).sum(1)
                prefix = torch.arange(km.shape[1], device=km.device) >= lo[:, None]
                self._memo["left_pads"] = lo.to(torch.int64).contiguous() if bool((prefix == km).all()) else False
        return self._memo["left_pads"]
