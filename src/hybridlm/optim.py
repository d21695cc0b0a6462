"""AdamW with nanoGPT-style weight-decay groups, and learning-rate schedules.

Decay applies to matrices only (dim >= 2: linears, embeddings, experts); vectors (norms, biases, SSD `D` and
`dt_bias`, gate biases, residual weights) and the matrices named in NO_DECAY are not decayed.
"""
import math

import torch
from torch import nn

from .errors import ConfigError


# matrices that are not weights: Mamba-1's A_log [d_inner, d_state] (a decay towards 0 would make A -> -1) and the
# WM position mask [heads, positions] (decay would pull it towards "masked")
NO_DECAY = ("A_log", "pos_mask")


def decays(name: str, p: torch.Tensor) -> bool:
    """Whether the parameter called `name` (any prefix, wrappers' included) is weight-decayed."""
    return p.dim() >= 2 and name.rsplit(".", 1)[-1] not in NO_DECAY


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():  # a tied weight once
        if p.requires_grad:
            (decay if decays(name, p) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.1,
                   betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW, fused on CPU and CUDA (one pass per tensor, no temporaries: on a CPU several times faster than the multi-tensor
    form, which holds another copy of the parameters' size during the step), multi-tensor elsewhere."""
    device = next(model.parameters()).device
    kw = {"fused": True} if device.type in ("cpu", "cuda") else {"foreach": True}
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=tuple(betas), eps=eps, **kw)


def lr_at(step: int, *, lr: float, total: int, warmup: int = 0, min_lr: float = 0.0, schedule: str = "cosine",
          decay_frac: float = 0.2) -> float:
    """Learning rate for optimizer step `step` (0-based) of `total`.

    cosine: linear warmup to `lr`, then cosine to `min_lr` at the last step.
    wsd:    warmup, stable at `lr`, then linear decay to `min_lr` over the last `decay_frac` of steps.
    constant: warmup, then `lr`.
    """
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    if schedule == "cosine":
        span = max(1, total - warmup - 1)
        t = min(1.0, (step - warmup) / span)
        return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * t))
    if schedule == "wsd":
        n_decay = max(1, int(round(decay_frac * total)))
        start = max(warmup, total - n_decay)
        if step < start:
            return lr
        t = min(1.0, (step - start + 1) / max(1, total - start))
        return lr + (min_lr - lr) * t
    raise ConfigError(f"unknown lr schedule {schedule!r} (cosine | wsd | constant)")
