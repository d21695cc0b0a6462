"""Rotary position embeddings from position ids, in both pairing conventions.

`half` (GPT-NeoX / Llama): channel i is paired with i + d/2.
`interleaved` (GPT-J / DeepSeek / the Transformer tutorial): channel 2i with 2i+1.
"""
import torch
from torch import Tensor


def rope_frequencies(dim: int, base: float = 10000.0, device=None) -> Tensor:
    """Inverse frequencies [dim/2] for a rotary dim `dim` (must be even)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))


def rope_cos_sin(positions: Tensor, dim: int, base: float = 10000.0) -> tuple[Tensor, Tensor]:
    """positions [B, T] (int) -> cos, sin [B, T, dim/2] in float32."""
    angles = positions.float().unsqueeze(-1) * rope_frequencies(dim, base, positions.device)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False) -> Tensor:
    """Rotate the first 2*cos.shape[-1] channels of x [B, T, H, D] by cos/sin [B, T, R/2].
    Channels past the rotary dim pass through unchanged (partial rotary)."""
    r, D = 2 * cos.shape[-1], x.shape[-1]
    # split/chunk/unbind, not slicing: their backward concatenates the grads, slicing's zero-fills a full copy each
    xr, xp = x.split((r, D - r), dim=-1) if r < D else (x, None)
    xr = xr.float()
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    if interleaved:
        x1, x2 = xr.unflatten(-1, (r // 2, 2)).unbind(-1)
        out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr.chunk(2, dim=-1)
        out = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    out = out.to(x.dtype)
    return out if xp is None else torch.cat((out, xp), dim=-1)


def apply_rope_ref(x: Tensor, positions: Tensor, dim: int, base: float = 10000.0, *,
                   interleaved: bool = False) -> Tensor:
    """Reference: multiply every pair by an explicit 2x2 rotation matrix R(pos * theta_i)."""
    theta = rope_frequencies(dim, base, x.device)
    ang = positions.double().unsqueeze(-1) * theta.double()               # [B, T, R/2]
    rot = torch.stack((torch.stack((ang.cos(), -ang.sin()), -1),
                       torch.stack((ang.sin(), ang.cos()), -1)), -2)     # [B, T, R/2, 2, 2]
    xr = x[..., :dim].double()
    if interleaved:
        pairs = xr.unflatten(-1, (dim // 2, 2))                           # [B, T, H, R/2, 2]
    else:
        pairs = torch.stack((xr[..., : dim // 2], xr[..., dim // 2:]), -1)
    out = torch.einsum("btrij,bthrj->bthri", rot, pairs)
    out = out.flatten(-2) if interleaved else torch.cat((out[..., 0], out[..., 1]), -1)
    return torch.cat((out.to(x.dtype), x[..., dim:]), -1)
