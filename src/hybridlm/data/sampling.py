"""Which training windows a step reads, and the read position a checkpoint keeps.

    sampler = make_sampler(data, "sequential", batch_size=8, seq_len=256, seed=0, rank=r, world=w)
    ids, resets = sampler.batch(step, micro)        # [8, 256] each, this rank's part
    state = sampler.state_dict()                    # saved with the checkpoint
    sampler.load_state_dict(state)                  # on resume: the next batch starts at the same token

`random`: windows at random offsets, the generator seeded by (seed, step, micro-batch, rank) (today's
sampler; the step alone is the position). `sequential`: an epoch reads the train stream front to back in
windows overlapping by one token (every token after the first is predicted once per epoch), the next epoch
starts again at token 0; each micro-batch takes the next `world * batch_size` windows and rank r reads the r-th
block of them, so ranks never share a window. The cursor (epoch, token offset) is the saved position. Both work
on in-memory arrays and on memory-mapped shards alike: only the windows read are touched.
"""
import numpy as np
import torch
from torch import Tensor

from ..errors import InputError
from .loader import _resets, batch_generator

ORDERS = ("random", "sequential")


class RandomWindows:
    def __init__(self, data, batch_size: int, seq_len: int, seed: int = 0, rank: int = 0, world: int = 1):
        self.data, self.B, self.T, self.seed, self.rank = data, batch_size, seq_len, seed, rank

    def batch(self, step: int, micro: int = 0) -> tuple[Tensor, Tensor]:
        return self.data.get_batch("train", self.B, self.T, batch_generator(self.seed, step, micro, self.rank))

    def state_dict(self) -> dict:
        return {"order": "random"}

    def load_state_dict(self, state: dict):
        pass


class SequentialWindows:
    def __init__(self, data, batch_size: int, seq_len: int, seed: int = 0, rank: int = 0, world: int = 1):
        self.arr, self.eos = data.tokens("train"), data.tokenizer.eos_id
        self.B, self.T, self.rank, self.world = batch_size, seq_len, rank, world
        self.stride = seq_len - 1
        if len(self.arr) < seq_len:
            raise InputError(f"the train split has {len(self.arr)} tokens; seq_len {seq_len} needs at least {seq_len}")
        self.n_windows = (len(self.arr) - 1) // self.stride  # full windows per epoch
        self.epoch, self.window = 0, 0                       # the next window to read

    def batch(self, step: int = 0, micro: int = 0) -> tuple[Tensor, Tensor]:
        """This rank's [B, T] windows of the next `world * B`; advances the cursor (call once per micro-batch)."""
        g = self.window + self.rank * self.B + np.arange(self.B)
        starts = (g % self.n_windows) * self.stride
        ahead = self.window + self.world * self.B
        self.epoch, self.window = self.epoch + ahead // self.n_windows, ahead % self.n_windows
        ids = torch.from_numpy(np.asarray(self.arr[starts[:, None] + np.arange(self.T)]).astype(np.int64))
        return ids, torch.from_numpy(_resets(self.arr, starts, self.T, self.eos))

    def state_dict(self) -> dict:
        return {"order": "sequential", "epoch": self.epoch, "token": self.window * self.stride,
                "seq_len": self.T, "tokens": len(self.arr)}

    def load_state_dict(self, state: dict):
        if state.get("order") != "sequential":
            return  # a run that sampled randomly before: start the sequential pass at the beginning
        if state.get("tokens", len(self.arr)) != len(self.arr):
            raise InputError(f"the checkpoint read a train split of {state['tokens']:,} tokens, this data has "
                             f"{len(self.arr):,}: resume on the same data")
        window = -(-int(state.get("token", 0)) // self.stride)  # the first window at or after the saved token
        self.epoch = int(state.get("epoch", 0)) + window // self.n_windows
        self.window = window % self.n_windows


def make_sampler(data, order: str, batch_size: int, seq_len: int, seed: int = 0, rank: int = 0, world: int = 1):
    if order not in ORDERS:
        raise InputError(f"data order must be one of {', '.join(ORDERS)}, got {order!r}")
    cls = RandomWindows if order == "random" else SequentialWindows
    return cls(data, batch_size, seq_len, seed, rank, world)
