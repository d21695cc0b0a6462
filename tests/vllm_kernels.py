"""Torch reference kernels for vLLM's KDA and Mamba-1 layers, swapped in where vLLM's CPU build has none (test only).

vLLM's KimiGatedDeltaNetAttention calls Triton kernels (chunk_kda_with_fused_gate for prefills,
fused_recurrent_kda_packed_decode for decodes, gather_initial_states for the carried states) and MambaMixer a CUDA op
(selective_scan_fn, its prefill); its CPU build's Mamba decode step (selective_state_update) takes Mamba-2's
[slots, heads, dim, state] states only (IndexError on Mamba-1's [slots, dim, state]). The convolutions have CPU
implementations in vLLM and stay vLLM's. `patch()` replaces the names the layers' modules look up with the forms below,
each written to the kernel's contract (shapes, state layout [slot, H, V, K] for KDA and [slot, d, n] for Mamba-1,
in-place state updates at the slots given, null slot 0 skipped) from hybridlm's own references (ops/delta_rule.py,
ops/selective_scan.py), and lets vLLM's layers past their refusal on the CPU platform, so vLLM's layer code (its
projections, cuts, convolutions, norms, state slots and metadata) runs for real and only its GPU kernels are stood in
for. `CALLS` counts each kernel's calls: a run that never reached vLLM's layers shows zeros.
"""
from collections import Counter

import torch
import torch.nn.functional as F

from hybridlm.ops.delta_rule import delta_rule, delta_rule_step
from hybridlm.ops.norm import l2_norm
from hybridlm.ops.selective_scan import selective_scan_chunked, selective_scan_step

CALLS: Counter = Counter()


def _kda_gate(raw_g, A_log, bias, lower_bound):
    """log α = -exp(A_log[h]) · softplus(raw_g + bias) [..., H, K] (float32): the gate vLLM's KDA kernels fuse."""
    assert lower_bound is None, "the safe gate (lower_bound) is not ours"
    H, K = raw_g.shape[-2:]
    g = raw_g.float() + bias.float().view(H, K)
    return -torch.exp(A_log.float().view(H, 1)) * F.softplus(g)


def chunk_kda_with_fused_gate(q, k, v, raw_g, raw_beta, A_log, g_bias, scale=None, initial_state=None,
                              output_final_state=False, lower_bound=None, use_qk_l2norm_in_kernel=False,
                              cu_seqlens=None, out=None, **kwargs):
    """q, k, v, raw_g [1, N, H, D]; raw_beta [1, N, H]; initial_state [S, H, V, K] for the S sequences of cu_seqlens
    -> (o [1, N, H, D], final states [S, H, V, K] float32)."""
    CALLS["chunk_kda_with_fused_gate"] += 1
    if use_qk_l2norm_in_kernel:
        q, k = l2_norm(q), l2_norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    log_a, beta = _kda_gate(raw_g, A_log, g_bias, lower_bound), torch.sigmoid(raw_beta.float())
    bounds = cu_seqlens.tolist()
    o, finals = torch.empty_like(v) if out is None else out, []
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        h0 = initial_state[i: i + 1].transpose(-1, -2) if initial_state is not None else None   # ours: [K, V]
        y, h = delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], beta[:, a:b], log_a[:, a:b], scale=scale,
                          initial_state=h0)
        o[:, a:b] = y.to(o.dtype)
        finals.append(h.transpose(-1, -2))
    return o, (torch.cat(finals) if output_final_state else None)


def fused_recurrent_kda_packed_decode(mixed_qkv, raw_g, raw_beta, A_log, dt_bias, lower_bound, initial_state,
                                      state_indices, scale=None, out=None):
    """One token per request: mixed_qkv [B, 3·H·D] after the conv; raw_g [1, B, H, D]; raw_beta [1, B, H]; the
    states [slots, H, V, K] read and written in place at state_indices [B] (slot 0, the null block: output 0)."""
    CALLS["fused_recurrent_kda_packed_decode"] += 1
    _, H, V, K = initial_state.shape
    B = mixed_qkv.shape[0]
    q, k, v = mixed_qkv.view(B, 3, H, K).unbind(1)
    q, k = l2_norm(q), l2_norm(k)
    log_a, beta = _kda_gate(raw_g[0], A_log, dt_bias, lower_bound), torch.sigmoid(raw_beta[0].float())
    out = torch.zeros(1, B, H, V, dtype=mixed_qkv.dtype) if out is None else out
    slots = state_indices.long()
    live = slots > 0
    if live.any():
        s = slots[live]
        y, h = delta_rule_step(q[live], k[live], v[live], beta[live], log_a[live],
                               initial_state[s].transpose(-1, -2), scale=scale)
        out[0, live] = y.to(out.dtype)
        initial_state[s] = h.transpose(-1, -2).to(initial_state.dtype)
    return out, initial_state


def gather_initial_states(state, indices, has_initial_state):
    """state[indices], zero where a request carries no state."""
    CALLS["gather_initial_states"] += 1
    rows = state[indices.long()].clone()
    rows[~has_initial_state] = 0
    return rows


def selective_scan_fn(u, ssm_states, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      query_start_loc=None, cache_indices=None, has_initial_state=None, null_block_id=0,
                      block_size=1024, block_idx_first_scheduled_token=None, block_idx_last_scheduled_token=None,
                      initial_state_idx=None, cu_chunk_seqlen=None, last_chunk_indices=None):
    """Varlen Mamba-1 scan (prefix caching off): u, delta, z [d, N]; A [d, n]; B, C [n, N]; the sequences of
    query_start_loc, each from ssm_states[cache_indices[i]] [d, n] when has_initial_state[i], its final state written
    back there. Returns y · silu(z) [d, N] (in z's place, as the kernel)."""
    CALLS["selective_scan_fn"] += 1
    assert block_idx_first_scheduled_token is None, "prefix caching's block states are not written here"
    dt = delta.float() + (delta_bias.float()[:, None] if delta_bias is not None else 0)
    dt = F.softplus(dt) if delta_softplus else dt
    out = z if z is not None else delta
    bounds = query_start_loc.tolist()
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        slot = int(cache_indices[i])
        h0 = ssm_states[slot: slot + 1].float() if bool(has_initial_state[i]) else None
        y, h = selective_scan_chunked(u[None, :, a:b].mT, dt[None, :, a:b].mT, A.float(), B[None, :, a:b].mT,
                                      C[None, :, a:b].mT, D, initial_state=h0)
        y = y[0].mT
        if z is not None:
            y = y * F.silu(z[:, a:b].float())
        out[:, a:b] = y.to(out.dtype)
        ssm_states[slot] = h[0].to(ssm_states.dtype)
    return out


def selective_state_update(state, x, dt, A, B, C, D, dt_bias, z=None, dt_softplus=False, state_batch_indices=None,
                           dst_state_batch_indices=None, null_block_id=0, out=None, **kwargs):
    """Mamba-1's decode step: x, dt, z [b, d]; B, C [b, n]; states [slots, d, n] read at state_batch_indices and
    written at dst_state_batch_indices (null slots skipped); y · silu(z) into out [b, d]."""
    CALLS["selective_state_update"] += 1
    dt = dt.float() + (dt_bias.float() if dt_bias is not None else 0)
    dt = F.softplus(dt) if dt_softplus else dt
    src, dst = state_batch_indices.long().view(-1), dst_state_batch_indices.long().view(-1)
    live = src != null_block_id
    y, h = selective_scan_step(x[live], dt[live], A, B[live], C[live], state[src[live]].float(), D)
    if z is not None:
        y = y * F.silu(z[live].float())
    out[live] = y.to(out.dtype)
    state[dst[live]] = h.to(state.dtype)


def patch() -> None:
    """Swap the kernels above into vLLM's KDA and Mamba-1 layer modules, and let vLLM's layers past their refusal on
    the CPU platform (their other checks stand)."""
    from vllm.platforms import current_platform
    # the in-process engine's worker start scans every loaded module for Triton kernels to override with CPU ones,
    # and an object of llvmlite's (pulled in by vLLM's kimi_k3 package, where its KDA kernels live) breaks the scan
    # (`vars()` of it is no dict): scan once, now, before anything imports it
    current_platform.register_triton_kernel_overrides()
    type(current_platform).register_triton_kernel_overrides = classmethod(lambda cls: None)

    from vllm.model_executor.layers.mamba import mamba_mixer
    from vllm.model_executor.layers.mamba.gdn import kimi_gdn_linear_attn
    from vllm.models.kimi_k3.nvidia.ops.third_party import kda

    from hybridlm.vllm import layers
    kda.chunk_kda_with_fused_gate = chunk_kda_with_fused_gate          # imported by name inside the layer's _forward
    kda.fused_recurrent_kda_packed_decode = fused_recurrent_kda_packed_decode
    kimi_gdn_linear_attn.gather_initial_states = gather_initial_states
    mamba_mixer.selective_scan_fn = selective_scan_fn
    mamba_mixer.selective_state_update = selective_state_update

    for cls in (layers.KimiDeltaLayer, layers.Mamba1Layer):
        refuse = cls.refuse.__func__

        def past_the_platform(c, cfg, letter, dtype=None, refuse=refuse):
            with _not_cpu(layers):
                return refuse(c, cfg, letter, dtype)
        cls.refuse = classmethod(past_the_platform)


class _not_cpu:
    """layers.current_platform reads as a non-CPU platform while in the block (the classes' refuse only)."""

    def __init__(self, layers):
        self.layers = layers

    def __enter__(self):
        real = self.real = self.layers.current_platform

        class NotCpu:
            def __getattr__(self, name):
                return getattr(real, name)

            def is_cpu(self):
                return False
        self.layers.current_platform = NotCpu()

    def __exit__(self, *exc):
        self.layers.current_platform = self.real
