"""bf16 compute in the chunked sequence ops (ops/precision.py): with bf16 inputs, or float32 inputs under bf16
autocast, SSD, GLA and the delta rule run their big matmuls on bf16 operands while decays, cumsums and the carried
state stay float32; the selective scan computes in float32. The error against the float32 path on the same
(bf16-representable) inputs is bounded, forward and gradients, and does not grow with length up to 16k."""
import pytest
import torch
import torch.nn.functional as F

from hybridlm.ops.delta_rule import delta_rule_chunked
from hybridlm.ops.gla import gla_chunked
from hybridlm.ops.selective_scan import selective_scan_chunked
from hybridlm.ops.ssd import ssd_chunked

# normwise relative error ‖bf16 - float32‖ / ‖float32‖; measured 1.7e-3 .. 5.1e-3 at 2k and 16k alike (bf16's unit
# roundoff is 2^-9 = 2e-3). A state carried between chunks in bf16 or a decay rounded to bf16 exceeds it at length.
BOUND = 1e-2
# dA of SSD: one number per head, a sum over every token of terms of both signs, so its relative error is that of
# the cancellation (1.5e-2 seen at 1k, 3e-4 at 16k)
LOOSE = {"dA": 5e-2}


def _inputs(op: str, T: int):
    """Float32 inputs at the scales the layers feed (post-conv activations, softplus'd steps, L2-normalised
    keys), rounded to bf16-representable values; and the names of those passed in bf16 in the bf16 mode."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)           # noqa: E731
    if op == "ssd":
        kw = dict(x=r(1, T, 4, 32), dt=F.softplus(r(1, T, 4) - 3), A=-torch.linspace(1, 8, 4),
                  B=r(1, T, 1, 32) * .5, C=r(1, T, 1, 32) * .5)
        low = ("x", "dt", "B", "C")
    elif op == "gla":
        kw = dict(q=r(1, T, 2, 32), k=F.normalize(r(1, T, 2, 32), dim=-1), v=r(1, T, 2, 64),
                  log_decay=-F.softplus(2 * r(1, T, 2, 32) - 3))
        low = ("q", "k", "v", "log_decay")
    elif op in ("delta", "kda"):
        gate = (1, T, 2, 32) if op == "kda" else (1, T, 2)
        kw = dict(q=F.normalize(r(1, T, 2, 32), dim=-1), k=F.normalize(r(1, T, 2, 32), dim=-1), v=r(1, T, 2, 32),
                  beta=torch.sigmoid(r(1, T, 2)), log_decay=-F.softplus(r(*gate) - 3))
        low = ("q", "k", "v", "beta")
    else:
        kw = dict(x=r(1, T, 64), dt=F.softplus(r(1, T, 64) - 3), A=-torch.linspace(0.5, 8, 16).repeat(64, 1),
                  B=r(1, T, 16), C=r(1, T, 16))
        low = ("x", "dt", "B", "C")
    return {k: v.bfloat16().float() if k in low else v for k, v in kw.items()}, low


OPS = {"ssd": ssd_chunked, "gla": gla_chunked, "delta": delta_rule_chunked, "kda": delta_rule_chunked,
       "scan": selective_scan_chunked}


def _run(op: str, kw: dict, low: tuple, mode: str):
    """(y float32, final state, {name: grad}) of a fixed random functional of (y, state)."""
    leaves = {k: v.clone().requires_grad_() for k, v in kw.items()}
    args = {k: v.bfloat16() if mode == "bf16" and k in low else v for k, v in leaves.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
        y, s = OPS[op](**args)
    in_dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    assert y.dtype == in_dtype and s.dtype == torch.float32
    g = torch.Generator().manual_seed(1)
    ((y.float() * torch.randn(y.shape, generator=g)).sum() + (s * torch.randn(s.shape, generator=g)).sum()).backward()
    return y.detach().float(), s.detach(), {k: v.grad for k, v in leaves.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b).norm() / b.norm()).item()


def _check(op: str, mode: str, T: int):
    kw, low = _inputs(op, T)
    y0, s0, g0 = _run(op, kw, low, "float32")
    y, s, g = _run(op, kw, low, mode)
    errs = {"y": _rel(y, y0), "state": _rel(s, s0)} | {f"d{k}": _rel(g[k], g0[k]) for k in g0}
    assert all(e < LOOSE.get(k, BOUND) for k, e in errs.items()), errs
    if op != "scan":   # the bf16 path was taken (its matmuls round): not the float32 path under another name
        assert errs["state"] > 1e-4, errs
    elif mode == "autocast":   # the scan computes in float32 whatever autocast says
        assert errs["y"] == errs["state"] == 0.0, errs


@pytest.mark.parametrize("mode", ["bf16", "autocast"])
@pytest.mark.parametrize("op", list(OPS))
def test_bf16_error_bounded(op, mode):
    _check(op, mode, 1024)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bf16", "autocast"])
@pytest.mark.parametrize("op", list(OPS))
def test_bf16_error_bounded_16k(op, mode):
    _check(op, mode, 16384)


def test_float64_ignores_autocast():
    """float64 inputs keep the exact path under autocast."""
    kw, _ = _inputs("gla", 100)
    kw = {k: v.double() for k, v in kw.items()}
    y0, s0 = gla_chunked(**kw)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, s = gla_chunked(**kw)
    assert torch.equal(y, y0) and torch.equal(s, s0)
