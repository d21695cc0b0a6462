"""CPU timing of the CDMoE layer (layers/cdmoe.py, Doge form) vs a gated MLP with the same active parameter
count, forward + backward, with a breakdown of the CDMoE time into its parts.

    python -m hybridlm.bench.moe_speed [d_model] [experts] [k] [shared_hidden] [tokens] [threads]

Defaults: d_model 256, 16384 experts, 64 per token, shared hidden 2·d_model (Doge's intermediate size), 2048
tokens, torch's current thread count. The measurement is `wm_speed.bench_cdmoe_layer` (same accounting:
active parameters 3·d·shared_hidden + 2·d·k for CDMoE without its router, + 2·√E·d with it; 3·d·hidden for
the MLP); `ratio` = CDMoE tokens/s / MLP tokens/s, target >= 0.5. The layer runs ~100 small ops to the MLP's
~15, so on a machine shared with other jobs multi-threaded runs understate its ratio: compare on a quiet one.
"""
import sys

import torch

from .wm_speed import bench_cdmoe_layer


def main(argv: list[str]) -> dict:
    args = [int(a) for a in argv]
    d, E, k, sh, T, th = args + [256, 16384, 64, 0, 2048, 0][len(args):]
    saved = torch.get_num_threads()
    if th:
        torch.set_num_threads(th)
    try:
        res = bench_cdmoe_layer(d, E, k, sh or None, T, repeats=7, breakdown=True)
    finally:
        torch.set_num_threads(saved)
    print(f"d={d} E={E} k={k} tokens={T}:")
    for key, val in res.items():
        print(f"  {key}: {val:.3f}" if isinstance(val, float) else f"  {key}: {val}")
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
