"""Next-token cross-entropy with a fused backward."""
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
