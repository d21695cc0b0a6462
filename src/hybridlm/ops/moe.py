"""Mixture-of-experts ops: product-key retrieval, CDMoE expert neurons, routed top-k experts.

Pure functions on flattened tokens x [N, d]. Two families:

* CDMoE (Wonderful Matrices, section 3.3 / eq. 5 / appendix B.4): a huge table of single-neuron
  "private experts" (a down row and an up row each), retrieved per token with product keys, on
  top of a shared MLP. ``product_key_topk`` does the retrieval, ``expert_neurons`` the gathered
  computation.
* Routed top-k MoE (Switch / Mixtral style): a router picks k of E gated-MLP experts per token;
  ``route_topk``, ``routed_experts`` (dropless, grouped by expert), ``routed_experts_selected`` (decode: only the
  chosen experts, one at a time) and ``load_balancing_loss``.

Every op has a ``*_ref`` twin written the obvious, dense way; tests check one against the other.
No Python loop runs over experts or tokens, except in ``routed_experts_selected``, whose loop is over the few experts
a decode step chose: everything else is gathers, sorts and batched matmuls.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from . import cpu_kernels
from .triton import CDMOE_ACTS
from .triton import enabled as triton_enabled

__all__ = [
    "product_key_topk",
    "product_key_topk_ref",
    "expert_neurons",
    "expert_neurons_ref",
    "route_topk",
    "routed_experts",
    "routed_experts_ref",
    "routed_experts_selected",
    "float_experts",
    "load_balancing_loss",
]

# embedding_bag's mode code for "sum"
_SUM = 0


# ---------------------------------------------------------------------------------------------
# Product-key retrieval
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _candidate_pairs(kk: int, k: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Rank pairs (a, b) (0-based) of two descending-sorted lists that can reach a top-k sum.

    If the pair at ranks (a, b) is in the top-k, every pair (a' <= a, b' <= b) scores at least as
    much, and there are (a+1)(b+1) of them; so (a+1)(b+1) <= k. That keeps ~k·ln(k) candidates
    (280 for k=64) instead of the full kk×kk grid (4096), and the result is still exact.
    Built from Python ints (not a data-dependent `nonzero`), so under torch.compile it is a constant.
    """
    pairs = [(a, b) for a in range(kk) for b in range(min(kk, k // (a + 1)))]
    return torch.tensor(pairs, device=device).unbind(1)


_POOL: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, workers, pool) for _argsort_rows


def _argsort_rows(a: np.ndarray) -> np.ndarray:
    """np.argsort(a, axis=-1), with the rows split across torch's intra-op thread count."""
    global _POOL
    parts = min(torch.get_num_threads(), a.shape[0] // 512)
    if parts <= 1:
        return np.argsort(a, axis=-1)
    if _POOL is None or _POOL[0] != os.getpid() or _POOL[1] < parts - 1:
        _POOL = (os.getpid(), parts - 1, ThreadPoolExecutor(parts - 1))  # new after a fork: threads don't survive it
    chunks = np.array_split(a, parts)
    rest = [_POOL[2].submit(np.argsort, c, axis=-1) for c in chunks[1:]]  # numpy sorts without the GIL
    return np.concatenate([np.argsort(chunks[0], axis=-1)] + [f.result() for f in rest])


def _ranked_keys(s: Tensor, k: int) -> Tensor:
    """Indices of the k largest entries of each row, largest first. s: [R, n] -> [R, k] long.

    On CPU, numpy's argsort of short rows (a vectorised sorting network, x86-simd-sort) is ~3x faster
    than torch.topk, which selects and sorts each row in scalar code; elsewhere (and under torch.compile,
    which cannot trace the thread pool) torch.topk.
    """
    if s.device.type != "cpu" or s.shape[-1] > 256 or torch.compiler.is_compiling():
        return s.topk(k, dim=-1).indices
    order = _argsort_rows(np.negative(s.float().numpy()))[:, :k]  # descending = ascending of the negation
    return torch.from_numpy(np.ascontiguousarray(order))


def product_key_topk(scores_x: Tensor, scores_y: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Exact top-k over all n_keys² sums scores_x[..., i] + scores_y[..., j], computed cheaply.

    scores_x, scores_y: [N, H, n_keys] (any leading dims). Expert (i, j) has id i * n_keys + j.
    Returns (scores [N, H, k], expert_ids [N, H, k] long), in no particular order along k.
    Differentiable w.r.t. both score tensors (gradients flow to the selected entries).

    Top-k' of each side first (k' = min(k, n_keys)): any top-k pair uses only top-k' entries of
    each side. Then, of the k'×k' candidate sums, only rank pairs with (a+1)(b+1) <= k are formed
    (see ``_candidate_pairs``) before the final top-k.
    """
    n_keys = scores_x.shape[-1]
    assert scores_y.shape == scores_x.shape, (scores_x.shape, scores_y.shape)
    assert 1 <= k <= n_keys * n_keys, f"k={k} must be in [1, n_keys²={n_keys * n_keys}]"
    kk = min(k, n_keys)
    # Selection is integer work: run it without autograd, then re-gather the winning scores from the
    # inputs so the backward is two cheap scatters instead of a chain of topk/index backwards.
    lead = scores_x.shape[:-1]
    with torch.no_grad():
        both = torch.stack((scores_x.reshape(-1, n_keys), scores_y.reshape(-1, n_keys)))  # [2, R, n_keys]
        order = _ranked_keys(both.view(-1, n_keys), kk).view(2, -1, kk)  # [2, R, kk]
        # rank-major [2, kk, R]: forming the candidates then copies whole rows instead of scattered floats
        ranked = both.gather(2, order).transpose(1, 2).contiguous()
        # traced by torch.compile, the uncached function is a constant; dynamo warns on lru_cache wrappers
        pairs_of = _candidate_pairs.__wrapped__ if torch.compiler.is_compiling() else _candidate_pairs
        a, b = pairs_of(kk, k, scores_x.device)  # [C] rank pairs
        cand = ranked[0].index_select(0, a) + ranked[1].index_select(0, b)  # [C, R]
        pos = cand.t().topk(k, dim=-1, sorted=False).indices  # [R, k]; sorting would cost ~2x
        i = order[0].gather(1, a[pos]).view(*lead, k)  # key index on each side
        j = order[1].gather(1, b[pos]).view(*lead, k)
    # same float additions as in cand, so these equal the selected candidate sums exactly
    scores = scores_x.gather(-1, i) + scores_y.gather(-1, j)
    ids = i * n_keys + j
    return scores, ids


def product_key_topk_ref(scores_x: Tensor, scores_y: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Reference: materialise all n_keys² sums [N, H, n_keys²] and take top-k."""
    all_scores = (scores_x[..., :, None] + scores_y[..., None, :]).flatten(-2)
    return all_scores.topk(k, dim=-1)


# ---------------------------------------------------------------------------------------------
# CDMoE private experts: gathered single-neuron experts
# ---------------------------------------------------------------------------------------------
#
# With (token, slot) pairs p and expert e = ids[p], every product here is a partial derivative of
#   F(table, rows, c) = Σ_p c[p] · <table[e_p], rows[token(p)]>
#   ∂F/∂c     (a "dot"):           h[p]   = <table[e_p], rows[token(p)]>     [P]
#   ∂F/∂rows  (a per-token sum):   out[n] = Σ_{p of n} c[p] · table[e_p]     [N, d]
#   ∂F/∂table (a per-expert sum):  out[e] = Σ_{p: e_p=e} c[p] · rows[token(p)]   [E, d]
# The expert neurons are h = ∂F(down, x, ·)/∂c, then y = ∂F(up, ·, s)/∂rows, and each backward is
# made of the other two partials. Materialising the gathered rows [P, d] costs 128 MB per tensor
# at N=2048, k=64, d=256 and is memory-bound on CPU (~30 ms per gather). Instead every partial is
# an embedding_bag (weighted row sums, never materialised) or its per-sample-weight backward
# kernel (a batch of row dots).
#
# Pairs are sorted by expert once ("expert-major" order). Every product that can be written with
# one bag per expert runs in that order: each table row is then read or written once, while the
# per-token rows it meets (x or dy, N×d, a few MB) stay in cache. That covers both dots and both
# table gradients. Only the per-token sums need one bag per token and read table rows in token
# order. The small per-pair vectors (h, s, gates: [P]) stay token-major; only they are permuted.
# (Per-token sums over (expert block, token) bags, with cache-sized blocks of table rows, were
# ~30% faster in isolation but slower inside the layer, once the second sort and the partial sums
# were paid for.)


def _sort_key(v: Tensor, bound: int) -> Tensor:
    """v (values in [0, bound)) in the narrowest integer dtype that holds them: CPU sort time grows
    with the key width (int16 keys sort ~2x faster than int32, ~4x faster than int64)."""
    for dtype in (torch.uint8, torch.int16, torch.int32):
        if bound <= torch.iinfo(dtype).max + 1:
            return v.to(dtype)
    return v


class _Pairs:
    """(token, slot) pairs sorted by expert. ids: [N, k] -> all fields [P] except starts [E].

    The products run inside the autograd Function, which supplies gradients itself: inputs are
    detached so embedding_bag takes its inference path (no bookkeeping).
    """

    def __init__(self, ids: Tensor, num_experts: int):
        N, k = ids.shape
        flat = ids.reshape(-1)
        self.ids = flat  # token-major expert ids
        self.offsets = torch.arange(0, N * k, k, device=ids.device)  # token bags
        # stable: tokens stay ascending within each expert
        e_sorted, self.perm = torch.sort(_sort_key(flat, num_experts), stable=True)
        self.expert = e_sorted.long()  # expert of each sorted pair (its bag)
        self.tok = self.perm // k  # token of each sorted pair
        # index_add, not bincount: a fixed [E] shape, so torch.compile keeps the layer in one graph
        counts = flat.new_zeros(num_experts).index_add_(0, flat, flat.new_ones(1).expand_as(flat))
        self.starts = counts.cumsum(0) - counts  # [E] expert bags (empty bags allowed)

    def dot(self, table: Tensor, rows: Tensor) -> Tensor:
        """∂F/∂c: out[p] = <table[ids[p]], rows[token(p)]>: [P] token-major, computed expert-major."""
        out = torch.ops.aten._embedding_bag_per_sample_weights_backward(
            table, rows, self.tok, self.starts, self.expert, _SUM, -1
        )
        return torch.empty_like(out).index_put_((self.perm,), out)

    def per_token_sum(self, table: Tensor, coef: Tensor) -> Tensor:
        """∂F/∂rows: out[n] = Σ_i coef[n*k+i] · table[ids[n, i]]: [N, d]."""
        return F.embedding_bag(
            self.ids, table.detach(), self.offsets, mode="sum", per_sample_weights=coef.detach()
        )

    def per_expert_sum(self, rows: Tensor, coef: Tensor) -> Tensor:
        """∂F/∂table: out[e] = Σ_{p: ids[p]=e} coef[p] · rows[token(p)]: [E, d]."""
        return F.embedding_bag(
            self.tok, rows.detach(), self.starts, mode="sum",
            per_sample_weights=coef.detach()[self.perm],
        )


class _PairProduct(torch.autograd.Function):
    """One partial of F(table, rows, c) = Σ_p c[p]·<table[e_p], rows[tok_p]> (see above).

    wrt="c":    other = rows [N, d] -> h [P]      (a dot per pair)
    wrt="rows": other = c [P]       -> y [N, d]   (a weighted sum of table rows per token)
    The backward is the two remaining partials, with the incoming gradient in the output's slot.
    """

    @staticmethod
    def forward(ctx, table, other, pairs, wrt):
        ctx.save_for_backward(table, other)
        ctx.pairs, ctx.wrt = pairs, wrt
        return pairs.dot(table, other) if wrt == "c" else pairs.per_token_sum(table, other)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        table, other = ctx.saved_tensors
        pairs = ctx.pairs
        grad = grad.contiguous()
        rows, c = (other, grad) if ctx.wrt == "c" else (grad, other)
        g_table = pairs.per_expert_sum(rows, c) if ctx.needs_input_grad[0] else None
        g_other = None
        if ctx.needs_input_grad[1]:
            g_other = pairs.per_token_sum(table, c) if ctx.wrt == "c" else pairs.dot(table, rows)
        return g_table, g_other, None, None


def expert_neurons(
    x: Tensor,
    down_weight: Tensor,
    up_weight: Tensor,
    expert_ids: Tensor,
    gates: Tensor | None = None,
    act: Callable[[Tensor], Tensor] = F.silu,
    scale: Tensor | None = None,
) -> Tensor:
    """CDMoE private experts: y[n] = Σ_i act(<down[id_ni], x[n]> · scale_ni) · gate_ni · up[id_ni].

    x: [N, d]; down_weight, up_weight: [E, d] (embedding tables); expert_ids: [N, k] long;
    gates, scale: [N, k] or None (= 1). Doge weights the neurons after the activation (gates);
    the paper's listing 8 scales the pre-activation by the retrieval scores (scale). Returns [N, d].

    Gradients reach x, gates, scale and both tables; the table grads are dense [E, d] tensors that
    are zero outside the selected rows. Never builds an [N, k, d] tensor (see the comment above).
    CUDA tensors go to our Triton kernel (ops/triton) for silu / relu / gelu when triton imports and
    HYBRIDLM_TRITON is not 0.
    """
    if act in CDMOE_ACTS and triton_enabled(x, down_weight, up_weight):
        from .triton import expert_neurons_triton
        return expert_neurons_triton(x, down_weight, up_weight, expert_ids, gates, act=act, scale=scale)
    pairs = _Pairs(expert_ids, down_weight.shape[0])
    # under autocast x arrives in bf16/fp16 next to float32 tables; embedding_bag needs one dtype: the tables'
    h = _PairProduct.apply(down_weight, x.to(down_weight.dtype).contiguous(), pairs, "c")  # [P]
    if scale is not None:
        h = h * scale.reshape(-1).to(h.dtype)
    s = act(h)  # small [P] ops: plain autograd handles them
    if gates is not None:
        s = s * gates.reshape(-1).to(h.dtype)
    return _PairProduct.apply(up_weight, s, pairs, "rows")


def expert_neurons_ref(
    x: Tensor,
    down_weight: Tensor,
    up_weight: Tensor,
    expert_ids: Tensor,
    gates: Tensor | None = None,
    act: Callable[[Tensor], Tensor] = F.silu,
    scale: Tensor | None = None,
) -> Tensor:
    """Reference: gather the [N, k, d] rows and compute the formula as written."""
    down, up = down_weight[expert_ids], up_weight[expert_ids]  # [N, k, d]
    h = torch.einsum("nd,nkd->nk", x, down)
    if scale is not None:
        h = h * scale
    s = act(h) if gates is None else act(h) * gates
    return torch.einsum("nk,nkd->nd", s, up)


# ---------------------------------------------------------------------------------------------
# Routed top-k MoE (gated-MLP experts)
# ---------------------------------------------------------------------------------------------


def route_topk(logits: Tensor, k: int, *, norm_topk: bool = True, score: str = "softmax",
               bias: Tensor | None = None, n_group: int = 1, topk_group: int = 1,
               scale: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """Top-k router. logits [N, E] -> (weights [N, k], ids [N, k], probs [N, E]), all scoring in float32.

    score "softmax" (Switch / Mixtral / Qwen) or "sigmoid" (DeepSeek-V3, Kimi, Nemotron-H: independent expert
    scores). `bias` [E] (DeepSeek's e_score_correction_bias) shifts the scores only to *choose* experts; with
    `n_group` > 1 experts come only from the `topk_group` groups whose two best (biased) scores sum highest.
    weights are the chosen experts' unbiased scores, renormalised to sum to 1 when `norm_topk`, times `scale`.
    probs (for the load-balancing loss) are the scores normalised per token.
    """
    scores = logits.float().softmax(dim=-1) if score == "softmax" else logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1:
        N, E = choice.shape
        grouped = choice.view(N, n_group, E // n_group)
        best = grouped.topk(min(2, E // n_group), dim=-1).values.sum(-1)             # [N, n_group]
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(N, E)
    ids = choice.topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if score == "sigmoid" else 0.0))
    if scale != 1.0:
        weights = weights * scale
    probs = scores if score == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids, probs


ExpertProduct = Callable[[int, Tensor], Tensor]   # (expert, rows [n, d_in]) -> [n, d_out]


def _expert_hidden(h_up: Tensor, h_gate: Tensor | None, act) -> Tensor:
    return act(h_up) if h_gate is None else act(h_gate) * h_up


def routed_experts(
    x: Tensor, w_gate: Tensor | None, w_up: Tensor, w_down: Tensor, ids: Tensor, weights: Tensor, act=F.silu
) -> Tensor:
    """Dropless routed experts: y[n] = Σ_i weights[n,i] · expert_{ids[n,i]}(x[n]), each expert a gated MLP
    down(act(x·gate) * x·up), or down(act(x·up)) when `w_gate` is None.

    x: [N, d]; w_gate, w_up: [E, d, f]; w_down: [E, f, d]; ids, weights: [N, k]. Returns [N, d].

    (token, slot) pairs are sorted by expert and scattered into a zero-padded [E, C, d] buffer with
    C = the largest expert load, so all experts run as one batched matmul (padding rows stay 0 and
    are never read back). The cost is E·C rows, so a badly balanced router pays for its padding.
    """
    N, d = x.shape
    E = w_up.shape[0]
    k = ids.shape[1]
    flat = ids.reshape(-1)  # [P], pair p = n*k + i
    order = torch.argsort(_sort_key(flat, E), stable=True)  # pairs grouped by expert
    counts = torch.bincount(flat, minlength=E)
    C = int(counts.max())  # host sync; dropless capacity
    e_sorted = flat[order]
    rank = torch.arange(flat.numel(), device=x.device) - (counts.cumsum(0) - counts)[e_sorted]
    slot = e_sorted * C + rank  # [P], row of each sorted pair in the flattened [E*C] buffer
    tok = order // k  # [P], token of each sorted pair

    buf = x.new_zeros(E * C, d).index_copy(0, slot, x[tok]).view(E, C, d)
    h = _expert_hidden(torch.bmm(buf, w_up), None if w_gate is None else torch.bmm(buf, w_gate), act)  # [E, C, f]
    out = torch.bmm(h, w_down).view(E * C, d)  # [E*C, d]
    y_pairs = out.index_select(0, slot) * weights.reshape(-1)[order, None].to(out.dtype)  # [P, d]
    # summed in float32 and returned in the experts' dtype (bf16 under autocast, as a linear layer's output)
    acc = torch.promote_types(out.dtype, torch.float32)
    return y_pairs.new_zeros(N, d, dtype=acc).index_add(0, tok, y_pairs.to(acc)).to(out.dtype)


def routed_experts_selected(
    x: Tensor, ids: Tensor, weights: Tensor, up: ExpertProduct, down: ExpertProduct, gate: ExpertProduct | None = None,
    act=F.silu,
) -> Tensor:
    """`routed_experts` computing only the experts some token chose, one at a time: each expert's weights are read
    once, by its own matrix products, and the others not at all (a decode step with k of E experts reads k/E of the
    bytes the batched form reads). Forward only in spirit (autograd flows through, but training keeps the batched
    form: one matmul, not a Python loop).

    x: [N, d]; ids, weights: [N, k]; up, gate, down: an expert's products, f(e, rows [n, d_in]) -> [n, d_out]
    (up, gate: d -> f; down: f -> d; `float_experts` makes them from [E, d_in, d_out] weights). Returns [N, d].
    """
    N, d = x.shape
    k = ids.shape[1]
    acc = torch.promote_types(x.dtype, torch.float32)

    def expert(e: int, rows: Tensor) -> Tensor:
        h = _expert_hidden(up(e, rows), None if gate is None else gate(e, rows), act)
        return down(e, h)

    if N == 1:      # decode: the k experts are distinct, every one sees the token (no sort, no gather)
        out = None
        for e, w in zip(ids[0].tolist(), weights[0].to(acc).unbind()):
            y = expert(e, x).to(acc) * w
            out = y if out is None else out + y
        return out.to(x.dtype)
    flat = ids.reshape(-1)  # pair p = n*k + i
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    tok, w = order // k, weights.reshape(-1)[order].to(acc)
    out = x.new_zeros(N, d, dtype=acc)
    start = 0
    for e, c in zip(experts.tolist(), counts.tolist()):
        t = tok[start:start + c]
        out.index_add_(0, t, expert(e, x.index_select(0, t)).to(acc) * w[start:start + c, None])
        start += c
    return out.to(x.dtype)


def float_experts(w: Tensor) -> ExpertProduct:
    """The expert product of float weights w [E, d_in, d_out]: f(e, rows [n, d_in]) = rows @ w[e], through the
    project's CPU GEMM (ops/cpu_kernels.py, the row counts it takes) when w[e] is stored transposed
    ([d_out, d_in] contiguous, the kernel's layout: see layers.routed_moe.RoutedMoE.kernel_layout_)."""
    def product(e: int, rows: Tensor) -> Tensor:
        we = w[e]
        if (we.dtype in (torch.float32, torch.bfloat16) and we.mT.is_contiguous()
                and not (torch.is_grad_enabled() and we.requires_grad)
                and cpu_kernels.serves(rows, we.dtype)):
            return cpu_kernels.linear(rows, we.mT)
        return rows @ we
    return product


def routed_experts_ref(
    x: Tensor, w_gate: Tensor | None, w_up: Tensor, w_down: Tensor, ids: Tensor, weights: Tensor, act=F.silu
) -> Tensor:
    """Reference: run every expert on every token ([E, N, d]), then pick and weight."""
    h = _expert_hidden(torch.einsum("nd,edf->enf", x, w_up),
                       None if w_gate is None else torch.einsum("nd,edf->enf", x, w_gate), act)
    out = torch.einsum("enf,efd->end", h, w_down)  # [E, N, d]
    picked = out[ids, torch.arange(x.shape[0], device=x.device)[:, None]]  # [N, k, d]
    return (picked * weights[..., None].to(out.dtype)).sum(dim=1)


def load_balancing_loss(probs: Tensor, ids: Tensor, num_experts: int) -> Tensor:
    """Switch-Transformer auxiliary loss, shifted to 0 at perfect balance: E · Σ_e f_e · P_e - 1.

    probs: [N, E] router softmax; ids: [N, k] chosen experts. f_e is the fraction of the N·k
    assignments that went to expert e (not differentiable), P_e the mean router probability of e.
    Exactly 0 for a uniform router with a balanced assignment; E - 1 for a fully collapsed one.
    """
    f = torch.bincount(ids.reshape(-1), minlength=num_experts).to(probs.dtype) / ids.numel()
    P = probs.mean(dim=0)
    return num_experts * (f * P).sum() - 1.0
