"""CPU timing of the gated delta rule: token-loop reference vs the chunked WY form, forward + backward, for the
scalar (Gated DeltaNet) and per-channel (KDA) gates.

    python -m hybridlm.bench.delta_speed [T] [H] [K] [V]      or      hybridlm bench --suite delta
"""
import statistics
import sys

import torch
import torch.nn.functional as F

from hybridlm.bench.gla_speed import op_fwd_bwd_seconds
from hybridlm.ops.delta_rule import delta_rule_chunked, delta_rule_recurrent


def _inputs(T: int, B: int, H: int, K: int, V: int, per_channel: bool, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g)
    k = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    v = torch.randn(B, T, H, V, generator=g)
    beta = torch.rand(B, T, H, generator=g)
    log_decay = -F.softplus(torch.randn(B, T, H, *([K] if per_channel else []), generator=g) - 2.0)
    return [x.requires_grad_() for x in (q, k, v, beta, log_decay)]


def bench_delta(T: int = 2048, B: int = 1, H: int = 4, K: int = 64, V: int = 64, repeats: int = 3,
                per_channel: bool = False) -> dict:
    """Median over `repeats` interleaved runs of forward + backward. Returns {"recurrent_s", "chunked_s", "speedup"}."""
    inputs = _inputs(T, B, H, K, V, per_channel)
    op_fwd_bwd_seconds(delta_rule_chunked, inputs)                          # warm-up
    rec, chk = [], []
    for _ in range(repeats):
        rec.append(op_fwd_bwd_seconds(delta_rule_recurrent, inputs))
        chk.append(op_fwd_bwd_seconds(delta_rule_chunked, inputs))
    r, c = statistics.median(rec), statistics.median(chk)
    return {"recurrent_s": r, "chunked_s": c, "speedup": r / c}


def run_suite(quick: bool = False, log=print) -> dict:
    """`hybridlm bench --suite delta`: both gate shapes at T = 2048 (512 with --quick), B 1, H 4, K = V = 64."""
    T, reps = (512, 1) if quick else (2048, 3)
    out = {"threads": torch.get_num_threads(), "T": T, "B": 1, "H": 4, "K": 64, "V": 64}
    for name, pc in (("scalar_gate", False), ("per_channel_gate", True)):
        out[name] = bench_delta(T=T, repeats=reps, per_channel=pc)
        log(f"delta rule {name} T={T}: {out[name]}")
    return out


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    T, H, K, V = args + [2048, 4, 64, 64][len(args):]
    for pc in (False, True):
        print(f"T={T} H={H} K={K} V={V} per_channel={pc} threads={torch.get_num_threads()}:",
              bench_delta(T=T, H=H, K=K, V=V, per_channel=pc))
