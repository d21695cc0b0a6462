"""Autograd wrapper of the Triton CDMoE expert kernels (cdmoe_kernels.py): ops.moe.expert_neurons' contract."""
import torch
import torch.nn.functional as F
from torch import Tensor

import triton

from ...errors import InputError
from . import CDMOE_ACTS as ACTS
from ._common import launch
from .cdmoe_kernels import cdmoe_bwd_kernel, cdmoe_fwd_kernel

_BD = 64    # d is walked in blocks of this many columns ([k, 64] tiles: ptxas spilled [64, 128] at 4 warps)
NUM_WARPS = 4


class _Experts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, down, up, ids, gates, scale, act):
        N, D = x.shape
        k = ids.shape[1]
        x, down, up = x.contiguous(), down.contiguous(), up.contiguous()
        ids = ids.contiguous()
        gates = gates.contiguous() if gates is not None else None
        scale = scale.contiguous() if scale is not None else None
        y = torch.empty_like(x)
        h = x.new_empty(N, k, dtype=torch.float32)                     # pre-activations before `scale`
        if N and k:
            launch(cdmoe_fwd_kernel, (N,), x, down, up, ids, gates if gates is not None else x,
                   scale if scale is not None else x, y, h, D, k,
                   BKE=max(16, triton.next_power_of_2(k)), BD=min(_BD, triton.next_power_of_2(D)),
                   ACT=act, HAS_GATE=gates is not None, HAS_SCALE=scale is not None,
                   num_warps=NUM_WARPS)
        else:
            y.zero_()
        ctx.save_for_backward(x, down, up, ids, gates, scale, h)
        ctx.act = act
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, down, up, ids, gates, scale, h = ctx.saved_tensors
        N, D = x.shape
        k = ids.shape[1]
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        ddown = torch.zeros(down.shape, dtype=torch.float32, device=x.device)
        dup = torch.zeros(up.shape, dtype=torch.float32, device=x.device)
        dgate = torch.empty(N, k, dtype=torch.float32, device=x.device) if gates is not None else None
        dscale = torch.empty(N, k, dtype=torch.float32, device=x.device) if scale is not None else None
        if N and k:
            launch(cdmoe_bwd_kernel, (N,), x, down, up, ids, gates if gates is not None else x,
                   scale if scale is not None else x, h, dy, dx, ddown, dup,
                   dgate if dgate is not None else h, dscale if dscale is not None else h, D, k,
                   BKE=max(16, triton.next_power_of_2(k)), BD=min(_BD, triton.next_power_of_2(D)),
                   ACT=ctx.act, HAS_GATE=gates is not None, HAS_SCALE=scale is not None,
                   num_warps=NUM_WARPS)
        else:
            dx.zero_()
        return (dx, ddown.to(down.dtype), dup.to(up.dtype), None,
                dgate.to(gates.dtype) if gates is not None else None,
                dscale.to(scale.dtype) if scale is not None else None, None)


def expert_neurons_triton(x: Tensor, down_weight: Tensor, up_weight: Tensor, expert_ids: Tensor,
                          gates: Tensor | None = None, act=F.silu, scale: Tensor | None = None) -> Tensor:
    """ops.moe.expert_neurons on Triton kernels: y[n] = Σ_i act(<down[id_ni], x[n]> · scale_ni) · gate_ni ·
    up[id_ni]. x [N, d]; down_weight, up_weight [E, d]; expert_ids [N, k] long; gates, scale [N, k] or None.
    act: F.silu, F.relu / torch.relu or F.gelu. Returns [N, d]; gradients reach x, both tables, gates, scale.
    CUDA tensors, or CPU tensors under TRITON_INTERPRET=1."""
    if act not in ACTS:
        raise InputError(f"expert_neurons_triton: act must be one of silu, relu, gelu, got {act!r}")
    if x.dim() != 2 or down_weight.dim() != 2 or down_weight.shape != up_weight.shape \
            or down_weight.shape[1] != x.shape[1]:
        raise InputError(f"expert_neurons: x [N, d] and down/up tables [E, d] expected, got {tuple(x.shape)}, "
                         f"{tuple(down_weight.shape)}, {tuple(up_weight.shape)}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise InputError(f"expert_neurons: expert_ids must be [N, k] with N = {x.shape[0]}, got "
                         f"{tuple(expert_ids.shape)}")
    for name, t in (("gates", gates), ("scale", scale)):
        if t is not None and t.shape != expert_ids.shape:
            raise InputError(f"expert_neurons: {name} must be [N, k] = {tuple(expert_ids.shape)}, got {tuple(t.shape)}")
    return _Experts.apply(x, down_weight, up_weight, expert_ids, gates, scale, ACTS[act])
