"""Decode kernels (ops/cpu_kernels.py) against the read limit, at a ~1B model's matrix shapes (TinyLlama: d 2048,
MLP 5632, 4 KV heads of 64): four layers' matrices in turn (352 MB in bf16, ten times the L3 cache, as decode
reads them), old and new kernel alternated in one process, best of N each; the read limit is a float32 sum of a
512 MB tensor in the same process (the same threads; the faster of torch's and a plain streaming loop). Prints the CPU model and its vector flags with the figures.

    python scripts/cpu_kernel_speed.py [--repeats 15] [--threads 2] [--layers 4]
"""
import argparse
import time

import torch

from hybridlm.bench import decode_profile
from hybridlm.dtypes import cpu_flags
from hybridlm.ops import cpu_kernels, quant
from hybridlm.runtime import cpu_model

SHAPES = [(2048, 2048), (256, 2048), (256, 2048), (2048, 2048), (5632, 2048), (5632, 2048), (2048, 5632)]   # [N, K]
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")



# one thread: the thread's CPU time (the kernels run on it; time descheduled on a shared machine is not counted);
# more threads: wall time
clock = time.perf_counter


def best(fn, repeats: int, timer=None) -> float:
    """The fastest of `repeats` calls of fn (after one warm-up), on `timer` (default: this script's clock)."""
    timer = timer or clock
    fn()
    out = float("inf")
    for _ in range(repeats):
        t = timer()
        fn()
        out = min(out, timer() - t)
    return out


def read_bandwidth(repeats: int) -> float:
    """GB/s of a float32 sum over 512 MB on this script's clock (bench/decode_profile.py's read limit)."""
    return decode_profile.read_bandwidth(repeats, clock=clock)


def interleaved(fns: dict, repeats: int) -> dict:
    """Best time of each fn, the fns alternated call by call (drift on a shared machine hits all alike)."""
    t = {k: float("inf") for k in fns}
    for f in fns.values():
        f()
    for _ in range(repeats):
        for k, f in fns.items():
            s = clock()
            f()
            t[k] = min(t[k], clock() - s)
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    global clock
    clock = time.thread_time if a.threads == 1 else time.perf_counter
    assert cpu_kernels.available(), "the kernels did not build"
    lib = cpu_kernels._lib
    flags = sorted(set(FLAGS) & cpu_flags())
    print(f"CPU: {cpu_model()}, flags {' '.join(flags)}; {a.threads} threads; torch {torch.__version__}; "
          f"{'thread CPU' if clock is time.thread_time else 'wall'} time, best of {a.repeats}")
    torch.manual_seed(0)
    ws = [torch.randn(n, k).bfloat16() for _ in range(a.layers) for n, k in SHAPES]
    xs = {k: torch.randn(1, k) for k in {k for _, k in SHAPES}}
    ys = [torch.empty(1, w.shape[0]) for w in ws]
    nbytes = sum(w.numel() * 2 for w in ws)

    def layer(fn):
        def run():
            for w, y in zip(ws, ys):
                x = xs[w.shape[1]]
                fn(x.data_ptr(), 1, w.shape[1], w.data_ptr(), w.shape[0], y.data_ptr())
        return run

    def torch_linear():
        for w in ws:
            torch.nn.functional.linear(xs[w.shape[1]].bfloat16(), w)

    bw = read_bandwidth(a.repeats)
    fns = {"bf16 -> f32 convert (old)": layer(lib.mv_bf16_f32), "bf16 kernel (now)": layer(lib.mv_bf16),
           "torch F.linear bf16": torch_linear}
    t = interleaved(fns, a.repeats)
    print(f"read limit (f32 sum of 512 MB): {bw:.1f} GB/s; {a.layers} layers' matrices: {nbytes / 1e6:.0f} MB bf16; "
          f"kernel uses bf16 dot products: {cpu_kernels.bf16_dot()}")
    for k, v in t.items():
        gbs = nbytes / v / 1e9
        print(f"  {k:28s} {v * 1e3:7.2f} ms  {gbs:6.1f} GB/s  {gbs / bw:5.2f} of the read limit")
    base = t["bf16 -> f32 convert (old)"]
    print(f"  speed-up now/old: {base / t['bf16 kernel (now)']:.2f}x")

    # int4 (g32) and int8 at the same shapes
    qs4 = [quant.quantize(w.float(), "int4", 32) for w in ws]
    qs8 = [quant.quantize(w.float(), "int8") for w in ws]
    b4 = sum(q.numel() + s.numel() * 4 + z.numel() * 4 for q, s, z in qs4)
    b8 = sum(q.numel() + s.numel() * 4 for q, s in qs8)
    packed = [(cpu_kernels.int4_pack(*q), q[0].shape[0], q[0].shape[1] * 2, q[1].shape[1]) for q in qs4]
    b4 = sum(p[0].numel() for p in packed)                   # what the kernel reads: the repacked form
    fns = {"int4 g32": lambda: [cpu_kernels.int4_linear(xs[w.shape[1]], *p) for w, p in zip(ws, packed)],
           "int8": lambda: [cpu_kernels.int8_linear(xs[w.shape[1]], *q) for w, q in zip(ws, qs8)]}
    t = interleaved(fns, a.repeats)
    for k, v in t.items():
        gbs = (b4 if k.startswith("int4") else b8) / v / 1e9
        print(f"  {k:28s} {v * 1e3:7.2f} ms  {gbs:6.1f} GB/s  {gbs / bw:5.2f} of the read limit")


if __name__ == "__main__":
    main()
