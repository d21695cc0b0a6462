"""Online-softmax ("flash") attention in pure PyTorch, forward and backward.

The algorithm follows the Transformer tutorial section 4 (online softmax -> online attention): one
pass over key blocks keeps a running row max ``m``, a running denominator ``l`` and an unnormalised
accumulator ``acc``; whenever the max grows, the old ``l`` and ``acc`` are rescaled by
``exp(m_old - m_new)``. Two deliberate differences from the tutorial's final loop (Eq. 87):

* the rescale factor is ``exp(m_old - m_new)`` (<= 1). Eq. 86/87 print ``exp(m_i) / exp(m_{i-1})``,
  which is the inverse and would blow up; the derivation above it (Eq. 79) has the right sign.
* like FlashAttention-2 we divide by ``l`` once at the end instead of every step.

Nothing of size T x S is ever materialised (unless the caller passes a T x S ``bias``): we tile over
query blocks and key blocks, so the working set is O(block^2) per head on top of the O(T*D) inputs,
outputs and accumulators. Key blocks that causality or the sliding window hide entirely are skipped.

The backward is the FlashAttention-2 one: save (q, k, v, out, logsumexp), recompute each score tile,
P = exp(S - lse), and use dS = P * (dP - rowsum(dO * O)) -- again tile by tile.

This is a readable reference, not a fast kernel: each tile is a few PyTorch ops, so for short
sequences torch's own scaled_dot_product_attention is faster. Its point is exact semantics
(bottom-right causal, GQA, padding, window, bias) with bounded memory on any device.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from hybridlm.errors import InputError

__all__ = ["flash_attention"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Accumulate bf16/fp16 in fp32 like the real kernels; keep fp64 for gradcheck.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _key_range(t0: int, t1: int, T: int, S: int, causal: bool, window: int | None) -> tuple[int, int]:
    """Keys [lo, hi) that any query in the block [t0, t1) can see (queries sit at key index S - T + t)."""
    p0, p1 = S - T + t0, S - T + t1 - 1  # key positions of the first and last query in the block
    hi = min(S, p1 + 1) if causal else S
    lo = max(0, p0 - window + 1) if window is not None else 0
    return lo, hi


def _tile_mask(
    t0: int, t1: int, s0: int, s1: int, T: int, S: int, causal: bool, window: int | None,
    key_mask: Tensor | None, device: torch.device,
) -> Tensor | None:
    """Bool visibility of keys [s0, s1) for queries [t0, t1), broadcastable to [B, Hk, G, bq, bk].

    Returns None when every key in the tile is visible, so full tiles pay nothing for masking.
    """
    p0, p1 = S - T + t0, S - T + t1 - 1
    need_causal = causal and s1 - 1 > p0  # some key is in the future of the first query
    need_window = window is not None and s0 <= p1 - window  # some key is too old for the last query
    mask = None
    if need_causal or need_window:
        pos_q = torch.arange(p0, p1 + 1, device=device)[:, None]
        pos_k = torch.arange(s0, s1, device=device)[None, :]
        mask = torch.ones(t1 - t0, s1 - s0, dtype=torch.bool, device=device)
        if need_causal:
            mask &= pos_k <= pos_q
        if need_window:
            mask &= pos_k > pos_q - window
        mask = mask[None, None, None]  # [1, 1, 1, bq, bk]
    if key_mask is not None:
        km = key_mask[:, None, None, None, s0:s1]  # [B, 1, 1, 1, bk]
        mask = km if mask is None else mask & km
    return mask


def _bias_tile(bias: Tensor | None, t0: int, t1: int, s0: int, s1: int, dtype: torch.dtype) -> Tensor | None:
    return None if bias is None else bias[..., t0:t1, s0:s1].to(dtype)


def _score_tile(q_blk: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, key_mask: Tensor | None,
                t0: int, t1: int, s0: int, s1: int, T: int, causal: bool, window: int | None
                ) -> tuple[Tensor, Tensor, Tensor]:
    """Masked, biased scores of queries [t0, t1) of T (q_blk: scaled, in the compute dtype) against keys
    [s0, s1) of k, v [B, Hk, S, D]: (s [B, Hk, G, bq, bk], k_blk, v_blk [B, Hk, 1, bk, D], broadcast over the
    G query heads). The forward and the backward's recompute share it, so both see exactly the same tile."""
    k_blk = k[:, :, None, s0:s1].to(q_blk.dtype)
    v_blk = v[:, :, None, s0:s1].to(q_blk.dtype)
    s = q_blk @ k_blk.transpose(-1, -2)
    b = _bias_tile(bias, t0, t1, s0, s1, q_blk.dtype)
    if b is not None:
        s = s + b
    mask = _tile_mask(t0, t1, s0, s1, T, k.shape[2], causal, window, key_mask, q_blk.device)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    return s, k_blk, v_blk


class _FlashAttention(torch.autograd.Function):
    """Inputs are pre-arranged by flash_attention():

    q: [B, Hk, G, T, D], k: [B, Hk, S, D], v: [B, Hk, S, Dv],
    bias: [Bb, Hk or 1, G or 1, T, S] or None, key_mask: [B, S] bool or None.
    Returns out [B, Hk, G, T, Dv] in q's dtype.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, key_mask, causal, window, scale, block_size):
        B, Hk, G, T, _ = q.shape
        S, Dv = k.shape[2], v.shape[-1]
        cdt = _compute_dtype(q.dtype)
        out = q.new_empty(B, Hk, G, T, Dv)
        lse = torch.empty(B, Hk, G, T, dtype=cdt, device=q.device)

        for t0 in range(0, T, block_size):
            t1 = min(T, t0 + block_size)
            q_blk = q[:, :, :, t0:t1].to(cdt) * scale  # scale after the upcast: no extra bf16 rounding
            m = torch.full((B, Hk, G, t1 - t0), -math.inf, dtype=cdt, device=q.device)  # running max
            l = torch.zeros_like(m)  # running sum of exp(s - m)
            acc = torch.zeros(B, Hk, G, t1 - t0, Dv, dtype=cdt, device=q.device)  # running sum of p @ v
            lo, hi = _key_range(t0, t1, T, S, causal, window)
            for s0 in range(lo, hi, block_size):
                s1 = min(hi, s0 + block_size)
                s, k_blk, v_blk = _score_tile(q_blk, k, v, bias, key_mask, t0, t1, s0, s1, T, causal, window)
                m_new = torch.maximum(m, s.amax(dim=-1))
                # A row that has seen no visible key yet keeps m = -inf; shift by 0 there so that
                # exp(-inf - (-inf)) never produces NaN (p and alpha come out as 0 instead).
                m_safe = torch.where(m_new == -math.inf, 0.0, m_new)
                p = torch.exp(s - m_safe[..., None])
                alpha = torch.exp(m - m_safe)  # rescales the old partial sums to the new max, <= 1
                l = l * alpha + p.sum(dim=-1)
                acc = acc * alpha[..., None] + p @ v_blk
                m = m_new
            empty = l == 0  # no visible key at all (padding, window, -inf bias): output 0, not NaN
            out[:, :, :, t0:t1] = (acc / torch.where(empty, 1.0, l)[..., None]).to(out.dtype)
            # lse = +inf for empty rows makes exp(s - lse) = 0 in the backward without special cases.
            lse[:, :, :, t0:t1] = torch.where(empty, math.inf, m + torch.log(l))

        ctx.save_for_backward(q, k, v, bias, key_mask, out, lse)
        ctx.causal, ctx.window, ctx.scale, ctx.block_size = causal, window, scale, block_size
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, bias, key_mask, out, lse = ctx.saved_tensors
        causal, window, scale, block_size = ctx.causal, ctx.window, ctx.scale, ctx.block_size
        B, Hk, G, T, _ = q.shape
        S = k.shape[2]
        cdt = _compute_dtype(q.dtype)
        want_bias = bias is not None and ctx.needs_input_grad[3]

        dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
        dk = torch.zeros(k.shape, dtype=cdt, device=q.device)
        dv = torch.zeros(v.shape, dtype=cdt, device=q.device)
        # The bias gradient is as large as the bias itself ([.., T, S]); only this output is that big.
        dbias = torch.zeros(bias.shape, dtype=cdt, device=q.device) if want_bias else None
        # delta_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij: the softmax-Jacobian term, O(T) to keep.
        delta = (dout.to(cdt) * out.to(cdt)).sum(dim=-1)  # [B, Hk, G, T]

        for t0 in range(0, T, block_size):
            t1 = min(T, t0 + block_size)
            q_blk = q[:, :, :, t0:t1].to(cdt) * scale
            do_blk = dout[:, :, :, t0:t1].to(cdt)
            lse_blk = lse[:, :, :, t0:t1, None]
            delta_blk = delta[:, :, :, t0:t1, None]
            dq_blk = torch.zeros_like(q_blk)
            lo, hi = _key_range(t0, t1, T, S, causal, window)
            for s0 in range(lo, hi, block_size):
                s1 = min(hi, s0 + block_size)
                s, k_blk, v_blk = _score_tile(q_blk, k, v, bias, key_mask, t0, t1, s0, s1, T, causal, window)
                p = torch.exp(s - lse_blk)  # the exact softmax probabilities of this tile
                dp = do_blk @ v_blk.transpose(-1, -2)
                ds = p * (dp - delta_blk)  # gradient wrt the (scaled, biased) scores
                dq_blk += ds @ k_blk
                # Sum over the G query heads that share this kv head.
                dv[:, :, s0:s1] += torch.einsum("bhgts,bhgtd->bhsd", p, do_blk)
                dk[:, :, s0:s1] += torch.einsum("bhgts,bhgtd->bhsd", ds, q_blk)
                if want_bias:
                    # Reduce over whatever dims the bias broadcast along (batch, heads).
                    g = ds
                    for dim in range(3):
                        if dbias.shape[dim] == 1 and g.shape[dim] != 1:
                            g = g.sum(dim=dim, keepdim=True)
                    dbias[..., t0:t1, s0:s1] += g
            dq[:, :, :, t0:t1] = dq_blk * scale  # chain rule through the scale applied to q

        return (
            dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
            dbias.to(bias.dtype) if want_bias else None,
            None, None, None, None, None,
        )


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    key_mask: Tensor | None = None,
    window: int | None = None,
    bias: Tensor | None = None,
    scale: float | None = None,
    block_size: int = 128,
) -> Tensor:
    """Exact softmax attention computed block by block with an online softmax.

    Args:
        q: [B, T, Hq, D] queries. They are the LAST T positions of the key sequence: query i sits at
            key index S - T + i (bottom-right aligned causal mask, so a KV cache prefix just works).
        k: [B, S, Hk, D] keys, S >= T, Hq % Hk == 0 (query head h reads kv head h // (Hq // Hk)).
        v: [B, S, Hk, Dv] values.
        causal: a query at key index p sees keys s <= p.
        key_mask: [B, S] bool, True = real key; False keys (padding) are never attended to.
        window: sliding window; a query at key index p sees keys s with p - window < s <= p.
            Requires causal=True.
        bias: additive float scores [B or 1, Hq or 1, T, S] (e.g. ALiBi); differentiable.
        scale: softmax scale, default D ** -0.5.
        block_size: tile size for both queries and keys; any positive int (need not divide T or S).

    Returns:
        [B, T, Hq, Dv] in q's dtype. Rows with no visible key (e.g. all-padding) are 0, not NaN.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise InputError(
            f"q, k, v must be [batch, time, heads, dim]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, T, Hq, D = q.shape
    _, S, Hk, _ = k.shape
    if k.shape[0] != B or k.shape[3] != D or v.shape[:3] != k.shape[:3]:
        raise InputError(f"incompatible q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if Hk == 0 or Hq % Hk != 0:
        raise InputError(f"query heads ({Hq}) must be a multiple of kv heads ({Hk})")
    if S < T:
        raise InputError(f"need at least as many keys as queries (S={S} < T={T})")
    if block_size < 1:
        raise InputError(f"block_size must be positive, got {block_size}")
    if window is not None:
        if not causal:
            raise InputError("window is a causal sliding window; pass causal=True with it")
        if window < 1:
            raise InputError(f"window must be >= 1, got {window}")
    if key_mask is not None:
        if key_mask.shape != (B, S):
            raise InputError(f"key_mask must be [B, S] = {(B, S)}, got {tuple(key_mask.shape)}")
        key_mask = key_mask.to(device=q.device, dtype=torch.bool)
    G = Hq // Hk
    if bias is not None:
        if bias.dim() != 4 or bias.shape[0] not in (1, B) or bias.shape[1] not in (1, Hq) or bias.shape[2:] != (T, S):
            raise InputError(
                f"bias must be [B or 1, Hq or 1, T, S] = [{B}|1, {Hq}|1, {T}, {S}], got {tuple(bias.shape)}"
            )
        # Split heads into (kv head, group) like q below; a head-broadcast bias stays [.., 1, 1, ..].
        bias = bias.unflatten(1, (Hk, G)) if bias.shape[1] == Hq else bias.unsqueeze(2)
    scale = D ** -0.5 if scale is None else scale

    # [B, T, Hq, D] -> [B, Hk, G, T, D]: head h = kv_head * G + g, so GQA is a broadcast over G.
    qh = q.unflatten(2, (Hk, G)).permute(0, 2, 3, 1, 4)
    kh = k.transpose(1, 2)  # [B, Hk, S, D]
    vh = v.transpose(1, 2)
    out = _FlashAttention.apply(qh, kh, vh, bias, key_mask, causal, window, scale, block_size)
    return out.permute(0, 3, 1, 2, 4).reshape(B, T, Hq, v.shape[-1])
