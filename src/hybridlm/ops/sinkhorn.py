"""Sinkhorn-Knopp projection onto doubly stochastic matrices (for manifold-constrained hyper-connections).

mHC (the Transformer tutorial section 5) mixes n residual streams with H_res. Products of doubly
stochastic matrices stay doubly stochastic (rows and columns sum to 1, spectral norm exactly 1), so
the residual path through many layers can neither blow up nor vanish. Sinkhorn-Knopp gets there from
any positive matrix by alternately normalising rows and columns; a fixed number of iterations keeps it
differentiable by plain autograd. Columns are normalised last, so columns are exact and rows are off
only by the (fast-shrinking) convergence error.

Two equivalent forms:
* ``sinkhorn_knopp``: explicit exp + divisions, with ``eps`` in the denominators as in DeepSeek's mHC
  code (guards an all-zero row/column); cheap, what a layer would use.
* ``sinkhorn_knopp_log``: the same iterations in the log domain with logsumexp; no eps needed and
  no underflow even for very peaked logits; the reference the explicit form is tested against.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["sinkhorn_knopp", "sinkhorn_knopp_log"]


def sinkhorn_knopp(logits: Tensor, iters: int = 20, eps: float = 1e-6) -> Tensor:
    """Doubly stochastic matrix from logits by alternating row / column normalisation.

    Args:
        logits: [..., n, n] real scores (any batch dims).
        iters: number of (row, column) normalisation rounds.
        eps: added to every row/column sum before dividing; sums are ~1, so it only biases by ~eps.

    Returns:
        [..., n, n] non-negative matrix with columns summing to 1 and rows to 1 up to convergence.
    """
    # Subtracting the per-row max leaves the result unchanged (the first row normalisation absorbs
    # any per-row factor) but keeps exp() from overflowing and gives every row an entry equal to 1.
    p = torch.exp(logits - logits.amax(dim=-1, keepdim=True).detach())
    for _ in range(iters):
        p = p / (p.sum(dim=-1, keepdim=True) + eps)  # rows
        p = p / (p.sum(dim=-2, keepdim=True) + eps)  # columns
    return p


def sinkhorn_knopp_log(logits: Tensor, iters: int = 20) -> Tensor:
    """Same iterations as ``sinkhorn_knopp`` in the log domain; returns the matrix (not its log).

    Args:
        logits: [..., n, n] real scores.
        iters: number of (row, column) normalisation rounds.

    Returns:
        [..., n, n] doubly stochastic matrix exp(log_p).
    """
    log_p = logits
    for _ in range(iters):
        log_p = log_p - torch.logsumexp(log_p, dim=-1, keepdim=True)  # rows
        log_p = log_p - torch.logsumexp(log_p, dim=-2, keepdim=True)  # columns
    return torch.exp(log_p)
