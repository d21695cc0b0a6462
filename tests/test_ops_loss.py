"""The fused cross-entropy equals torch's log_softmax + nll_loss, forward and backward."""
import pytest
import torch

from conftest import assert_close
from hybridlm.ops.loss import cross_entropy, cross_entropy_ref


@pytest.mark.parametrize("scale", [1.0, 30.0])      # 30: logits far from 0, exp would overflow unshifted
@pytest.mark.parametrize("ignored", [0.0, 0.3])
def test_cross_entropy_matches_reference(scale, ignored):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 101, generator=g) * scale).requires_grad_()
    target = torch.randint(0, 101, (37,), generator=g)
    target[torch.rand(37, generator=g) < ignored] = -100
    ours = cross_entropy(logits, target)
    (g1,) = torch.autograd.grad(ours * 1.7, logits)
    ref = cross_entropy_ref(logits, target)
    (g2,) = torch.autograd.grad(ref * 1.7, logits)
    assert_close(ours, ref, atol=1e-5, rtol=1e-6)
    assert_close(g1, g2, atol=1e-7, rtol=1e-5)


def test_cross_entropy_gradcheck():
    logits = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([1, -100, 6, 0, 3])
    assert torch.autograd.gradcheck(lambda x: cross_entropy(x, target), (logits,))


def test_cross_entropy_all_ignored_is_zero_with_zero_grad():
    logits = torch.randn(4, 9, requires_grad=True)
    loss = cross_entropy(logits, torch.full((4,), -100))
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(logits.grad) == 0
