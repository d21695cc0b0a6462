"""Next-token cross-entropy: on given logits with a fused backward, and fused with the LM head in token chunks."""
import torch
import torch.nn.functional as F
from torch import Tensor


class _CrossEntropy(torch.autograd.Function):
    """Mean cross-entropy over the targets that are not `ignore_index`.

    Forward keeps e = exp(logits - max) (the memory log_softmax would keep for its output anyway) and the row
    sums s, so the backward is one pass, grad = e · (g / n / s) minus the scaled one-hot: no log_softmax
    output, no zero-filled [N, V] gradient from nll_loss and no second exp over the logits."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, ignore_index: int) -> Tensor:
        valid = target != ignore_index
        tgt = torch.where(valid, target, 0)
        e = logits - logits.amax(-1, keepdim=True)
        picked = e.gather(1, tgt[:, None]).squeeze(1)            # shifted logit of each target
        e.exp_()
        s = e.sum(-1)
        n = valid.sum().clamp(min=1)
        ctx.save_for_backward(e, s, tgt, valid, n)
        return torch.where(valid, s.log() - picked, 0).sum() / n

    @staticmethod
    def backward(ctx, g: Tensor):
        e, s, tgt, valid, n = ctx.saved_tensors
        scale = torch.where(valid, g / n, 0)                      # [N]
        grad = e * (scale / s)[:, None]                           # softmax · scale
        grad.scatter_add_(1, tgt[:, None], -scale[:, None])       # minus the one-hot
        return grad, None, None


def cross_entropy(logits: Tensor, target: Tensor, ignore_index: int = -100) -> Tensor:
    """logits [N, V] float, target [N] long -> mean loss over targets != ignore_index (0 when there are none;
    F.cross_entropy gives nan there). Same value and gradient as `cross_entropy_ref`, computed faster."""
    return _CrossEntropy.apply(logits, target, ignore_index)


def cross_entropy_ref(logits: Tensor, target: Tensor, ignore_index: int = -100) -> Tensor:
    """Reference: torch's log_softmax + nll_loss."""
    return F.cross_entropy(logits, target, ignore_index=ignore_index)


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of `x @ weight.T` without a [N, V] tensor: tokens go through in chunks of
    `chunk` rows. While a chunk's logits are at hand its gradient is formed too (softmax minus one-hot, then
    two matmuls into grad_x and grad_weight), so backward only scales the stored gradients: three matmuls per
    chunk, as the unchunked head needs, and no recompute (the scheme of Liger's fused linear cross-entropy).
    Memory: one [chunk, V] float32 block plus grad_x [N, d] and grad_weight [V, d]."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, target: Tensor, ignore_index: int, chunk: int,
                cdtype: torch.dtype, grad_enabled: bool) -> Tensor:
        valid = target != ignore_index
        n = valid.sum().clamp(min=1)
        # needs_input_grad ignores no_grad/inference mode, hence the caller's grad_enabled
        gx = torch.empty_like(x) if grad_enabled and ctx.needs_input_grad[0] else None
        gw = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32), device=weight.device) \
            if grad_enabled and ctx.needs_input_grad[1] else None
        need_grad = gx is not None or gw is not None
        w = weight.to(cdtype)
        acc = torch.promote_types(cdtype, torch.float32)           # softmax in float32 (float64 stays)
        total = torch.zeros((), dtype=acc, device=x.device)
        for i in range(0, x.shape[0], chunk):
            xc, tc, vc = x[i: i + chunk].to(cdtype), target[i: i + chunk], valid[i: i + chunk]
            tgt = torch.where(vc, tc, 0)
            e = (xc @ w.T).to(acc)                                # [c, V] logits
            e -= e.amax(-1, keepdim=True)
            picked = e.gather(1, tgt[:, None]).squeeze(1)
            e.exp_()
            s = e.sum(-1)
            total += torch.where(vc, s.log() - picked, 0).sum()
            if need_grad:                                         # d(sum of losses)/d logits, unscaled by n
                e *= (vc / s)[:, None]
                e.scatter_add_(1, tgt[:, None], -vc[:, None].to(acc))
                g = e.to(cdtype)
                if gx is not None:
                    gx[i: i + chunk] = g @ w
                if gw is not None:
                    gw += g.T @ xc
        ctx.save_for_backward(gx, gw, n)
        ctx.weight_dtype = weight.dtype
        return total / n

    @staticmethod
    def backward(ctx, g: Tensor):
        gx, gw, n = ctx.saved_tensors
        scale = g / n
        return (gx * scale.to(gx.dtype) if gx is not None else None,
                (gw * scale).to(ctx.weight_dtype) if gw is not None else None, None, None, None, None, None)


def linear_cross_entropy(x: Tensor, weight: Tensor, target: Tensor, ignore_index: int = -100,
                         chunk: int | None = None, max_block_bytes: int = 64 << 20) -> Tensor:
    """Mean next-token cross-entropy of the logits `x @ weight.T` (x [N, d], weight [V, d], target [N]),
    computed `chunk` rows at a time (default: as many rows as fit a `max_block_bytes` float32 block). Equal to
    `cross_entropy(x @ weight.T, target)` in value and gradients. Under autocast the matmuls run in the
    autocast dtype and the softmax in float32, as the unfused head does."""
    V = weight.shape[0]
    if chunk is None:
        chunk = max(1, max_block_bytes // (4 * V))
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    dev = x.device.type
    if dev == "cpu":  # sparse targets (MQAR answers, masked prompts): only their rows meet the head. On CPU the
        valid = (target != ignore_index).nonzero().squeeze(1)    # count costs no device sync
        if 2 * len(valid) <= len(target):
            x, target = x.index_select(0, valid), target.index_select(0, valid)
    cdtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    with torch.autocast(dev, enabled=False):
        return _LinearCrossEntropy.apply(x, weight, target, ignore_index, chunk, cdtype, torch.is_grad_enabled())
