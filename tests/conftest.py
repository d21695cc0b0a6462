import os
import sys

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# without a GPU our Triton kernels (ops/triton, tests/test_triton_kernels.py) run under Triton's interpreter;
# triton reads the switch when it is first imported, so it is set before any test module can import it
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# `--dtype auto` (the CLI default) resolves to float32 on every machine, subprocesses included, so float32 figures
# do not change on a CPU with AMX-BF16; tests of auto itself (test_dtypes.py) unset it
os.environ["HYBRIDLM_AUTO_DTYPE"] = "float32"


def pytest_collection_finish(session):
    """transformers' hybrid models call FLA's (or mamba_ssm's) kernels on CPU tensors too once that package is
    installed (the gpu extra): route those calls to transformers' own PyTorch fallback (hybridlm/hf/kernels.py).
    After collection, so a session that never imports transformers does not pay for it."""
    if "transformers" in sys.modules:
        from hybridlm.hf.kernels import torch_fallback_on_cpu
        torch_fallback_on_cpu()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def assert_close(a, b, rtol=1e-5, atol=1e-5, msg=""):
    """Max-abs comparison with a readable failure message."""
    a, b = a.detach().double(), b.detach().double()
    err = (a - b).abs().max().item() if a.numel() else 0.0
    tol = atol + rtol * b.abs().max().item() if b.numel() else atol
    assert err <= tol, f"{msg} max abs diff {err:.3g} > {tol:.3g}"


def decode_logits(m, ids, *prefill_ends, cache=None):
    """Logits [B, T, V] of `ids` [B, T] run through one cache (a fresh one unless given): prefill chunks ending at
    `prefill_ends`, then one token at a time. Every model must match its full forward here."""
    cache = m.make_cache(ids.shape[0]) if cache is None else cache
    starts = (0, *prefill_ends)
    parts = [m(ids[:, a:b], cache=cache).logits for a, b in zip(starts, prefill_ends)]
    parts += [m(ids[:, t:t + 1], cache=cache).logits for t in range(starts[-1], ids.shape[1])]
    return torch.cat(parts, 1)


def padded_logits(m, ids, pad, side="left"):
    """Logits [B, T, V] at the real positions of `ids` [B, T] with `pad` [B, P] masked-out tokens on `side`; padding
    must leave them unchanged (left padding restarts the positions at the first real token)."""
    real, masked = torch.ones(ids.shape), torch.zeros(pad.shape)
    x, mask = ((pad, ids), (masked, real)) if side == "left" else ((ids, pad), (real, masked))
    logits = m(torch.cat(x, 1), attention_mask=torch.cat(mask, 1).long()).logits
    return logits[:, pad.shape[1]:] if side == "left" else logits[:, :ids.shape[1]]


def packed_logits(m, a, b):
    """Logits [1, Ta + Tb, V] of documents a [1, Ta] and b [1, Tb] packed in one row, b starting at a reset; they must
    equal a and b run alone."""
    resets = torch.zeros(1, a.shape[1] + b.shape[1], dtype=torch.bool)
    resets[0, 0] = resets[0, a.shape[1]] = True
    with torch.no_grad():
        return m(torch.cat((a, b), 1), resets=resets).logits, torch.cat((m(a).logits, m(b).logits), 1)


def assert_batch_generates_like_single(m, a, b, n_new):
    """Greedy generation for the batch of prompts `a` [1, Ta] and `b` [1, Tb] (Tb < Ta, so `b` left-padded and
    masked) must give each prompt exactly the `n_new` tokens it gets alone."""
    Ta, Tb = a.shape[1], b.shape[1]
    batch = torch.cat([a, torch.cat([torch.zeros(1, Ta - Tb, dtype=torch.long), b], 1)], 0)
    mask = torch.ones_like(batch)
    mask[1, :Ta - Tb] = 0
    out = m.generate(batch, n_new, temperature=0, attention_mask=mask)
    assert torch.equal(out[0, Ta:], m.generate(a, n_new, temperature=0)[0, Ta:])
    assert torch.equal(out[1, Ta:], m.generate(b, n_new, temperature=0)[0, Tb:])


def assert_trains(m, ids, steps, drop):
    """`steps` AdamW steps (lr 3e-3) on the next-token loss of `ids` [B, T] must lower it by more than `drop`;
    leaves `m` in train mode and returns the losses."""
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = m(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - drop, losses
    return losses
