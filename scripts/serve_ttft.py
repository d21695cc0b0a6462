"""Time to first token of 16 requests arriving together with prompts of mixed length (64 to 2,048 tokens,
geometric, shuffled), on the serving engine without HTTP (issue 49: batched, fair prefill), and the engine's
memory figures beside the process's RSS. Random weights at the given size; greedy, 16 new tokens each.

    python scripts/serve_ttft.py [--preset transformer++] [--d-model 768] [--layers 12] [--threads 2]

TTFT p50 / p99 are nearest-rank over the 16 requests. `state_bytes` (peak) is the engine's count of allocated
inference state (`Engine.memory()`, absent before issue 49), `budget` the memory the engine's admission rule
reserves for these 16 requests (`Engine.peak_bytes`), RSS growth what the process gained during the run.
"""
import argparse
import math
import random
import resource
import time

import torch

from hybridlm import CausalLM, presets
from hybridlm.serve import Engine, Request, SamplingParams, Scheduler


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="transformer++")
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = CausalLM(presets.get(args.preset, d_model=args.d_model, n_layers=args.layers, max_seq_len=4096,
                                 vocab_size=32000)).eval()
    lens = [round(64 * 32 ** (i / 15)) for i in range(16)]
    random.Random(0).shuffle(lens)
    g = torch.Generator().manual_seed(0)
    reqs = [Request(torch.randint(0, 32000, (n,), generator=g).tolist(), SamplingParams(max_tokens=16, temperature=0))
            for n in lens]
    eng = Engine(model, block=256, max_slots=16)
    sch = Scheduler(eng)
    rss0, peak = rss_bytes(), 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for r in reqs:
            sch.submit(r)
        while sch.busy():
            sch.step()
            if hasattr(eng, "memory"):
                peak = max(peak, eng.memory()["state_bytes"])
    wall = time.perf_counter() - t0
    ttft = sorted(r.first_token_at - r.arrival for r in reqs)
    rank = lambda q: ttft[max(0, math.ceil(q * len(ttft)) - 1)]      # noqa: E731
    print(f"{args.preset} d_model {args.d_model} x {args.layers} layers, {torch.get_num_threads()} threads: "
          f"TTFT p50 {rank(0.5):.2f} s, p99 {rank(0.99):.2f} s, all done in {wall:.2f} s")
    if hasattr(eng, "peak_bytes"):
        budget = eng.peak_bytes([len(r.prompt) + 16 for r in reqs], 16)
        print(f"state_bytes peak {peak / 2**20:.1f} MiB, budget for the 16 {budget / 2**20:.1f} MiB, "
              f"RSS growth {(rss_bytes() - rss0) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
