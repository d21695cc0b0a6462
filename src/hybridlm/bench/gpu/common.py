"""What every part of the GPU check shares: its parts and sizes (FULL on a GPU, DRY on a CPU), the time budget of a
part, the rows that write themselves, and the sized models."""
import dataclasses
import functools
import gc
import time
from typing import Callable

import torch

# the most-wanted figures first (every part writes its rows as they come): the presets' tokens/s against
# transformer++ and MFU, then each letter's op in its three forms, then the checks, then the rest
PARTS = ("training", "kernels", "correctness", "decode", "memory", "steps")
FAMILIES = ("transformer++", "mamba2", "rodimus++", "cheems")          # decode = forward
TRAIN_FAMILIES = ("transformer++", "mamba2", "rodimus", "rodimus++", "mamba2-attention", "cheems", "doge",
                  "qwen3-next", "kimi-linear", "deepseek-mla")

FULL = dict(
    budget_s=dict(correctness=60, kernels=100, training=200, decode=60, memory=25, steps=60),
    check=dict(ssd=[dict(b=2, T=512, h=8, p=64, n=128, g=1), dict(b=1, T=1000, h=4, p=64, n=64, g=2)],
               gla=[dict(b=2, T=512, h=4, k=128, v=128), dict(b=1, T=1000, h=2, k=64, v=256)],
               delta=[dict(b=2, T=512, h=4, k=128, v=128), dict(b=1, T=1000, h=2, k=64, v=128)],
               cdmoe=[dict(N=4096, d=512, E=4096, k=16), dict(N=1000, d=256, E=1024, k=8)],
               model=dict(d_model=256, n_layers=4, vocab_size=1024), context=200, decode=16),
    kernels=dict(b=8, T=4096, ssd=dict(h=32, p=64, n=128, g=1), gla=dict(h=16, k=128, v=128),
                 delta=dict(h=16, k=128, v=128), cdmoe=dict(d_model=1024, experts=16384, k=64), repeats=10,
                 ops=("ssd", "gla", "delta", "kda", "cdmoe")),
    # transformer++ first at each length: the others' tokens/s are reported relative to it
    training=dict(presets=("transformer++", "mamba2", "rodimus", "qwen3-next", "kimi-linear", "rodimus++",
                           "mamba2-attention"), params=125_000_000, layers=12, vocab_size=32000, batch=8,
                  seq_lens=(2048, 8192), repeats=5, compile=True),
    decode=dict(presets=("transformer++", "mamba2", "rodimus++"), params=125_000_000, layers=12, vocab_size=32000,
                contexts=(1024, 8192), batches=(1, 64), steps=20, prefill_chunk=1024),
    memory=dict(presets=("mamba2", "transformer++"), params=125_000_000, layers=12, vocab_size=32000,
                seq_len=16384),
    steps=dict(scales=(1, 2, 4, 8), mqar_d=(64, 256), mqar_T=128, repeats=3, mqar_batch=64),
    matmul=8192,
)
DRY = dict(
    budget_s=dict(correctness=60, kernels=30, training=40, decode=20, memory=10, steps=30),
    check=dict(ssd=[dict(b=1, T=40, h=2, p=8, n=16, g=1), dict(b=1, T=33, h=2, p=8, n=8, g=2)],
               gla=[dict(b=1, T=40, h=2, k=16, v=8), dict(b=1, T=33, h=1, k=8, v=16)],
               delta=[dict(b=1, T=40, h=2, k=16, v=8), dict(b=1, T=33, h=1, k=8, v=16)],
               cdmoe=[dict(N=16, d=16, E=64, k=4), dict(N=9, d=8, E=32, k=2)],
               model=dict(d_model=64, n_layers=2, vocab_size=128), context=24, decode=4),
    kernels=dict(b=1, T=32, ssd=dict(h=1, p=8, n=16, g=1), gla=dict(h=1, k=16, v=16), delta=dict(h=1, k=16, v=16),
                 cdmoe=dict(d_model=16, experts=64, k=4), repeats=1, ops=("ssd", "gla", "delta", "kda", "cdmoe")),
    training=dict(presets=("transformer++", "mamba2"), params=None, d_model=64, layers=2, vocab_size=256, batch=2,
                  seq_lens=(64, 128), repeats=2, compile=False),   # compiling on a CPU takes minutes: the GPU run's
    decode=dict(presets=("transformer++", "mamba2"), params=None, d_model=64, layers=2, vocab_size=256,
                contexts=(16, 48), batches=(1, 4), steps=3, prefill_chunk=16),
    memory=dict(presets=("mamba2", "transformer++"), params=None, d_model=64, layers=2, vocab_size=256, seq_len=256),
    steps=dict(scales=(1,), mqar_d=(32,), mqar_T=32, repeats=1, recipes=("rodimus-gates",), batch=2, seq_len=32,
               mqar_batch=4),
    matmul=256,
)


class Budget:
    """A part's deadline: `left()` seconds remain; `fits(s)` says whether work expected to take `s` still fits,
    and notes each item skipped for time."""

    def __init__(self, seconds: float):
        self.end, self.cut = time.monotonic() + seconds, []

    def left(self) -> float:
        return self.end - time.monotonic()

    def fits(self, what: str, expected_s: float = 0.0) -> bool:
        if self.left() > expected_s:
            return True
        self.cut.append(what)
        return False


class Rows(list):
    """A part's rows: each append also calls `saved()` (the run writes its results), so a job that hangs past the
    run's timeout still leaves every row measured before it."""

    def __init__(self, saved: Callable[[], None] = lambda: None):
        super().__init__()
        self.saved = saved

    def append(self, row: dict):
        super().append(row)
        self.saved()


@functools.cache
def _config(name: str, layers: int, d_model, params, vocab_size: int):
    """Sizing to a parameter count searches widths (seconds): once per preset and size for all parts."""
    from ..instrument import preset_config
    return preset_config(name, layers=layers, d_model=d_model, params=params, vocab_size=vocab_size, max_seq_len=256)


def build(name: str, device, dtype=None, *, params=None, d_model=None, layers=2, vocab_size=256, max_seq_len=256,
          seed: int = 0):
    """Preset `name` at `layers` mixers, sized to `params` or width d_model, on device (weights in dtype)."""
    from ...models import CausalLM
    cfg = dataclasses.replace(_config(name, layers, d_model, params, vocab_size), max_seq_len=max_seq_len)
    torch.manual_seed(seed)
    return CausalLM(cfg).to(device=device, dtype=dtype or torch.float32)


def free(device):
    """Drop what the last job left on the device."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def sized(name: str, t: dict, device, dtype=None, max_seq_len: int = 2048, seed: int = 0):
    """Preset `name` at the sizes of a timing part's settings `t` (params or d_model, layers, vocab_size)."""
    return build(name, device, dtype, params=t.get("params"), d_model=t.get("d_model"), layers=t["layers"],
                 vocab_size=t["vocab_size"], max_seq_len=max_seq_len, seed=seed)
