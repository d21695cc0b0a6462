"""Initialisation rules shared by the layers. Every mixer initialises the parameters it owns in its own
`init_weights(std, out_std)`, never in its constructor, so a model can be built on the meta device and initialised
after `to_empty`, one shard at a time (models/causal_lm.py). Leaf modules (RMSNorm, ShortConv) follow torch's
convention instead: `reset_parameters()`, also called when built (free on the meta device). A mixer used on its
own, outside CausalLM, is initialised with `initialised(layer)`.

All rules work in place on the parameter, whatever its device: nothing here allocates a tensor of the full size.
"""
import math

import torch
from torch import Tensor, nn


def initialised(module: nn.Module, std: float = 0.02) -> nn.Module:
    """`module` after `module.init_weights(std, std)`: a layer built on its own, ready to run."""
    module.init_weights(std, std)
    return module


@torch.no_grad()
def normal_(std: float, *modules: nn.Module | None):
    """N(0, std) weights and zero biases for nn.Linear / nn.Embedding modules (None skipped)."""
    for m in modules:
        if m is None:
            continue
        nn.init.normal_(m.weight, 0.0, std)
        if getattr(m, "bias", None) is not None:
            nn.init.zeros_(m.bias)


@torch.no_grad()
def reset_(*modules: nn.Module | None):
    """Each module's own `reset_parameters()` (norms: weight 1, bias 0), None skipped."""
    for m in modules:
        if m is not None:
            m.reset_parameters()


@torch.no_grad()
def init_dt_bias_(p: Tensor, dt_min: float, dt_max: float, floor: float) -> Tensor:
    """softplus⁻¹ of dt drawn log-uniformly in [dt_min, dt_max] (floored), so softplus(p) = dt (Mamba-2's rule)."""
    lo, hi = math.log(dt_min), math.log(dt_max)
    p.uniform_(0.0, 1.0).mul_(hi - lo).add_(lo).exp_().clamp_(min=floor)
    return p.add_(torch.log(-torch.expm1(-p)))


@torch.no_grad()
def init_A_log_(p: Tensor, lo: float, hi: float) -> Tensor:
    """log of A ~ U(lo, hi), so that A = -exp(p) is a decay rate in [-hi, -lo] (Mamba-2's rule)."""
    return p.uniform_(lo, hi).log_()
