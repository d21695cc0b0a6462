"""Normalisations as pure functions (computed in float32, returned in the input dtype)."""
import torch
import torch.nn.functional as F
from torch import Tensor


def l2_norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(Σx² + eps) over the last dim, in float32 or wider (flash-linear-attention's l2norm, used by Gated
    DeltaNet and KDA: eps added, not F.normalize's max(‖x‖, eps))."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last dim. x [..., d], weight [d] or None."""
    if weight is not None and hasattr(F, "rms_norm") and x.dtype == weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def gated_rms_norm(x: Tensor, gate: Tensor | None, weight: Tensor, *, group_size: int | None = None,
                   eps: float = 1e-6, norm_before_gate: bool = False) -> Tensor:
    """Grouped gated RMSNorm of Mamba-2: RMSNorm(x * silu(gate)) with the mean taken per group of
    `group_size` channels (one group per SSD group; normalising over all channels when ngroups > 1 is a
    known bug of some ports). x, gate [..., d]; weight [d]."""
    xf = x.float()
    if gate is not None and not norm_before_gate:
        xf = xf * F.silu(gate.float())
    d = xf.shape[-1]
    g = group_size or d
    if hasattr(F, "rms_norm"):  # fused kernel (forward and backward); same formula as below
        if g == d:
            y = F.rms_norm(xf, (d,), weight.float(), eps)
        else:
            y = F.rms_norm(xf.unflatten(-1, (d // g, g)), (g,), None, eps).flatten(-2) * weight.float()
    else:
        xg = xf.unflatten(-1, (d // g, g))
        xg = xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + eps)
        y = xg.flatten(-2) * weight.float()
    if gate is not None and norm_before_gate:
        y = y * F.silu(gate.float())
    return y.to(x.dtype)
