"""flash-linear-attention (FLA, `pip install fla-core`, brought by the gpu extra) as the CUDA path of the linear-time
mixers' ops: one adapter per op maps our tensors and parameters to FLA's chunk kernel and its results back.

    ssd_fla         S  SSD as scalar-decay GLA: chunk_simple_gla(q=C, k=B, v=dt·x, g=dt·A, scale=1)
    ssd_mamba       S  mamba_ssm's mamba_chunk_scan_combined (only when mamba_ssm is installed)
    gla_fla         R  Rodimus' gated linear attention: chunk_gla (per-key-channel log-decay)
    delta_rule_fla  G  chunk_gated_delta_rule (scalar gate per head); K chunk_kda (per-channel gate)

Each adapter is "map inputs -> kernel(...) -> map outputs" with the kernel injectable: by default FLA's Triton op
(it needs a GPU), and tests/test_ops_fla.py passes FLA's pure-PyTorch naive forms to check every mapping on a CPU.
The mappings: our layout is already FLA's [batch, time, heads, dim]; our states [B, H, K, V] are FLA's (SSD's
[b, h, p, n] is FLA's [V, K], transposed here); resets (packed documents) become FLA's varlen form, exact: the
batch flattened to one row, cu_seqlens at every row start and document start, each row's initial state given to
its first segment (zero where the row itself starts with a reset), the final state read from each row's last
segment (a -inf decay at a document start would be exact in our references but meets -inf - -inf = NaN in
FLA's in-chunk cumulative sums). Groups: SSD's B/C groups are repeated over their heads (chunk_simple_gla has
no head sharing); the gated delta rule's key heads go to FLA as they are (its GVA: value head j reads key head
j // (H / Hk), as our repeat_interleave).

Dispatch (`enabled`): on CUDA tensors, when fla imports, HYBRIDLM_FLA and HYBRIDLM_TRITON are not 0, the key dim
is one FLA takes (<= 256), and FLA trusts the Triton in use (Triton 3.4-3.7.0 miscompiles its gated backward on
Hopper, fla-org/flash-linear-attention #640: there our own kernels run, unless HYBRIDLM_FLA=force, for timing).
Otherwise our Triton kernels (ops/triton)
and the PyTorch forms run as before. The adapters are opaque to torch.compile (a graph break per call), as ours.
"""
import functools
import importlib
import os
import re

import torch
from torch import Tensor

from .precision import matmul_dtype, no_autocast

MAX_KEY_DIM = 256          # FLA's chunk kernels hold a whole key row in a block


@functools.cache
def available() -> bool:
    """True when FLA's ops import (importing them needs triton; on a machine without a GPU they import but their
    kernels cannot run)."""
    try:
        importlib.import_module("fla.ops")
    except Exception:      # noqa: BLE001 - ImportError, or a triton that fla cannot use
        return False
    return True


@functools.cache
def mamba_available() -> bool:
    """True when mamba_ssm's SSD kernel imports (a compiled CUDA package, never a dependency)."""
    try:
        importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
    except Exception:      # noqa: BLE001
        return False
    return True


def _triton_version() -> tuple[int, ...]:
    import triton
    return tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:3])


@functools.cache
def trusted(device_index: int) -> bool:
    """False where FLA refuses its gated backward: Hopper (capability 9.x) with Triton >= 3.4 and < 3.7.1."""
    major, _ = torch.cuda.get_device_capability(device_index)
    return not (major == 9 and (3, 4) <= _triton_version() < (3, 7, 1))


def _on(var: str) -> bool:
    return os.environ.get(var, "1") != "0"


def _cuda(*tensors: Tensor) -> bool:
    return all(t.is_cuda and t.dtype in (torch.float32, torch.bfloat16, torch.float16) for t in tensors)


def enabled(*tensors: Tensor, key_dim: int) -> bool:
    """Dispatch test: every tensor on CUDA in float32/bf16/fp16, key_dim <= 256, fla importable and trusted on this
    GPU (HYBRIDLM_FLA=force skips that test: timing only, FLA's gated backward is wrong where it is not trusted),
    neither HYBRIDLM_FLA nor HYBRIDLM_TRITON set to 0."""
    if not (_on("HYBRIDLM_FLA") and _on("HYBRIDLM_TRITON") and _cuda(*tensors) and key_dim <= MAX_KEY_DIM):
        return False
    return available() and (os.environ.get("HYBRIDLM_FLA") == "force" or trusted(tensors[0].device.index or 0))


def mamba_enabled(*tensors: Tensor) -> bool:
    """mamba_ssm's SSD for CUDA tensors when it is installed (HYBRIDLM_TRITON=0 turns it off with the rest)."""
    return _on("HYBRIDLM_TRITON") and _cuda(*tensors) and mamba_available()


def fla_op(name: str):
    """FLA's chunk op `name` from fla.ops (its Triton kernels)."""
    return getattr(importlib.import_module("fla.ops"), name)


def varlen(resets: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """resets [B, T] bool -> (cu_seqlens [N+1] long on resets' device, the same on the CPU, first [B] and last [B]:
    the index of each row's first and last segment). A segment starts at every row start and every reset."""
    B, T = resets.shape
    starts = resets.detach().cpu().clone()          # one host sync: FLA wants the segment table on the CPU too
    starts[:, 0] = True
    flat = starts.flatten()
    cu_cpu = torch.cat([flat.nonzero().squeeze(-1), torch.tensor([B * T])])
    seg = flat.long().cumsum(0) - 1                 # segment index of every token
    first, last = seg[::T], seg[T - 1::T]
    dev = resets.device
    return cu_cpu.to(dev, non_blocking=True), cu_cpu, first.to(dev), last.to(dev)


def run(kernel, inputs: tuple, initial_state: Tensor | None, resets: Tensor | None, **kw) -> tuple[Tensor, Tensor]:
    """kernel(*inputs, initial_state=, output_final_state=True, **kw) on [B, T, ...] inputs, resets mapped to FLA's
    varlen form (see the module docstring). Returns (o [B, T, ...], final state [B, ...])."""
    if resets is None:
        return kernel(*inputs, initial_state=initial_state, output_final_state=True, **kw)
    B, T = resets.shape
    cu, cu_cpu, first, last = varlen(resets)
    flat = [t.reshape(1, B * T, *t.shape[2:]) for t in inputs]
    h0 = None
    if initial_state is not None:   # the row's state enters its first segment, unless the row starts a document
        keep = ~resets[:, 0].view(B, *[1] * (initial_state.dim() - 1))
        h0 = initial_state.new_zeros(len(cu_cpu) - 1, *initial_state.shape[1:]).index_copy(
            0, first, initial_state * keep)
    o, ht = kernel(*flat, initial_state=h0, output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, **kw)
    return o.reshape(B, T, *o.shape[2:]), ht[last]


def _dtype(*xs: Tensor) -> torch.dtype:
    """The dtype FLA's kernels read: bf16/fp16 when an input is, or autocast to it is on (ops/precision.py), else
    the inputs' common float dtype."""
    for x in xs:
        if (d := matmul_dtype(x)) is not None:
            return d
    return functools.reduce(torch.promote_types, (x.dtype for x in xs))


@torch.compiler.disable
def ssd_fla(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *, initial_state: Tensor | None = None,
            resets: Tensor | None = None, kernel=None) -> tuple[Tensor, Tensor]:
    """ops.ssd.ssd_chunked on FLA's chunk_simple_gla. x [b, t, h, p]; dt [b, t, h] (softplus'd); A [h]; B, C
    [b, t, g, n]; initial_state [b, h, p, n]. Returns (y [b, t, h, p] in x's dtype, final state [b, h, p, n] fp32)."""
    kernel = kernel or fla_op("chunk_simple_gla")
    h = x.shape[2]
    dtype = _dtype(x, B, C)
    with no_autocast(x):
        q, k = (t.repeat_interleave(h // t.shape[2], 2).to(dtype) for t in (C, B))
        v = (x.float() * dt.float().unsqueeze(-1)).to(dtype)                # dt folded into the values
        g = dt.float() * A.float()                                          # the per-head log-decay
        h0 = initial_state.float().transpose(-1, -2) if initial_state is not None else None
        y, ht = run(kernel, (q, k, v, g), h0, resets, scale=1.0)
    return y.to(x.dtype), ht.float().transpose(-1, -2)


@torch.compiler.disable
def ssd_mamba(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *, initial_state: Tensor | None = None,
              resets: Tensor | None = None, chunk_size: int = 256, kernel=None) -> tuple[Tensor, Tensor]:
    """ops.ssd.ssd_chunked on mamba_ssm's mamba_chunk_scan_combined: the same arguments (its dt is ours, softplus
    already applied, no dt_bias, no D); resets become its seq_idx (document index per token; state passing stops
    where it changes), and a row that starts with a reset gets no initial state. Shapes as ssd_fla."""
    if kernel is None:
        kernel = importlib.import_module("mamba_ssm.ops.triton.ssd_combined").mamba_chunk_scan_combined
    seq_idx = None
    if resets is not None:
        seq_idx = resets.int().cumsum(1).int()
        if initial_state is not None:
            initial_state = initial_state * ~resets[:, :1, None, None]
    dtype = _dtype(x, B, C)
    with no_autocast(x):
        y, ht = kernel(x.to(dtype), dt.float(), A.float(), B.to(dtype), C.to(dtype), chunk_size=chunk_size,
                       initial_states=initial_state.float() if initial_state is not None else None,
                       seq_idx=seq_idx, return_final_states=True)
    return y.to(x.dtype), ht.float()


@torch.compiler.disable
def gla_fla(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, *, scale: float | None = None,
            initial_state: Tensor | None = None, resets: Tensor | None = None, kernel=None) -> tuple[Tensor, Tensor]:
    """ops.gla.gla_chunked on FLA's chunk_gla. q, k, log_decay [B, T, H, K]; v [B, T, H, V]; initial_state
    [B, H, K, V]. Returns (o [B, T, H, V] in q's dtype, final state [B, H, K, V] float32)."""
    kernel = kernel or fla_op("chunk_gla")
    dtype = _dtype(q, v)
    with no_autocast(q):
        ins = (q.to(dtype), k.to(dtype), v.to(dtype), log_decay.float())
        o, ht = run(kernel, ins, initial_state.float() if initial_state is not None else None, resets,
                    scale=q.shape[-1] ** -0.5 if scale is None else scale)
    return o.to(q.dtype), ht.float()


@torch.compiler.disable
def delta_rule_fla(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_decay: Tensor, *, scale: float | None = None,
                   initial_state: Tensor | None = None, resets: Tensor | None = None,
                   kernel=None) -> tuple[Tensor, Tensor]:
    """ops.delta_rule.delta_rule_chunked on FLA's chunk_gated_delta_rule (log_decay [B, T, H], Gated DeltaNet) or
    chunk_kda (log_decay [B, T, H, K], KDA). q, k [B, T, Hk, K] with Hk dividing H; v [B, T, H, V]; beta [B, T, H];
    initial_state [B, H, K, V]. Returns (o [B, T, H, V] in q's dtype, final state [B, H, K, V] float32)."""
    kernel = kernel or fla_op("chunk_kda" if log_decay.dim() == 4 else "chunk_gated_delta_rule")
    dtype = _dtype(q, v)
    with no_autocast(q):
        ins = (q.to(dtype), k.to(dtype), v.to(dtype), log_decay.float(), beta.float())
        o, ht = run(kernel, ins, initial_state.float() if initial_state is not None else None, resets,
                    scale=q.shape[-1] ** -0.5 if scale is None else scale)
    return o.to(q.dtype), ht.float()
