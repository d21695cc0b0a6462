"""CPU timing of gated linear attention: token-loop reference vs the chunked form, forward + backward.

    python -m hybridlm.bench.gla_speed [T] [H] [K] [V]
"""
import sys
import time

import torch
import torch.nn.functional as F

from hybridlm.ops.gla import gla_chunked, gla_recurrent


def _inputs(T: int, B: int, H: int, K: int, V: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g)
    k = torch.randn(B, T, H, K, generator=g) * K ** -0.5
    v = torch.randn(B, T, H, V, generator=g)
    log_decay = -F.softplus(torch.randn(B, T, H, K, generator=g) - 2.0)   # Rodimus-like, mostly mild
    return [x.requires_grad_() for x in (q, k, v, log_decay)]


def op_fwd_bwd_seconds(fn, inputs: list[torch.Tensor]) -> float:
    """Seconds of one forward + backward of a sequence op `fn(*inputs) -> (out, final state)`."""
    for x in inputs:
        x.grad = None
    t0 = time.perf_counter()
    o, state = fn(*inputs)
    (o.square().mean() + state.square().mean()).backward()
    return time.perf_counter() - t0


def bench_gla(T: int = 2048, B: int = 1, H: int = 4, K: int = 64, V: int = 128, repeats: int = 3) -> dict:
    """Best-of-`repeats` wall time of forward + backward for gla_recurrent and gla_chunked (runs
    interleaved so both see the same machine load). Returns {"recurrent_s", "chunked_s", "speedup"}."""
    inputs = _inputs(T, B, H, K, V)
    op_fwd_bwd_seconds(gla_chunked, inputs)                                  # warm-up (allocator, kernels)
    rec, chk = [], []
    for _ in range(repeats):
        rec.append(op_fwd_bwd_seconds(gla_recurrent, inputs))
        chk.append(op_fwd_bwd_seconds(gla_chunked, inputs))
    r, c = min(rec), min(chk)
    return {"recurrent_s": r, "chunked_s": c, "speedup": r / c}


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    T, H, K, V = args + [2048, 4, 64, 128][len(args):]
    print(f"T={T} H={H} K={K} V={V} threads={torch.get_num_threads()}:", bench_gla(T=T, H=H, K=K, V=V))
