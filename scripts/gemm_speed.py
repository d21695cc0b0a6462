"""The project's CPU GEMM (ops/cpu_kernels.py) beside PyTorch's CPU products on the same weights, per stored format
and row count: float32 / bf16 against `F.linear` (oneDNN / MKL), int8 against `torch._weight_int8pack_mm` and the
weight dequantized once for `F.linear`, int4 against `torch._weight_int4pack_mm_for_cpu` and the same dequantize. A
~1B model's matrices (TinyLlama: [2048, 2048], [5632, 2048], [2048, 5632]), the candidates alternated call by call
in one process, best of N each; prints milliseconds for the matrices and which is the faster (what
`cpu_kernels.ROWS` routes by), and our kernel's GB/s reading the weights against the machine's read limit measured
in the same process with the same threads (bench/decode_profile.read_bandwidth): a one-row product should stream at
>= 0.9 of it. `--layers` copies of the three matrices (4: ~100-400 MB, far past the L3 cache, as decode reads them).

    python scripts/gemm_speed.py [--rows 1 4 16 64 128] [--repeats 7] [--threads 1 2] [--layers 4] [--level avx2]
"""
import argparse
import os
import time

import torch
import torch.nn.functional as F

import cpu_kernel_speed                        # scripts/ is on the path of a script run from it
from hybridlm.bench.decode_profile import read_bandwidth
from hybridlm.dtypes import cpu_flags
from hybridlm.ops import cpu_kernels, quant
from hybridlm.runtime import cpu_model

SHAPES = [(2048, 2048), (5632, 2048), (2048, 5632)]             # [N, K]
FLAGS = cpu_kernel_speed.FLAGS


def weight_bytes(fmt: str, ws: list) -> int:
    """Bytes our kernel reads for all of `ws` [N, K] stored as `fmt` (int4: packed, a float16 scale and min per
    group of 64)."""
    per = {"float32": lambda n, k: 4 * n * k, "bfloat16": lambda n, k: 2 * n * k, "int8": lambda n, k: n * k + 4 * n,
           "int4": lambda n, k: n * k // 2 + 4 * n * (k // 64)}[fmt]
    return sum(per(*w.shape) for w in ws)


def candidates(fmt: str, ws: list, xs: dict) -> dict:
    """name -> a call running x [M, K] through all of `ws` in format `fmt` (ours first)."""
    if fmt in ("float32", "bfloat16"):
        dt = getattr(torch, fmt)
        wd = [w.to(dt) for w in ws]
        x = {k: v.to(dt) for k, v in xs.items()}
        return {"ours": lambda: [cpu_kernels.linear(x[w.shape[1]], w) for w in wd],
                "F.linear": lambda: [F.linear(x[w.shape[1]], w) for w in wd]}
    if fmt == "int8":
        qs = [quant.quantize(w, "int8") for w in ws]
        xb = {k: v.bfloat16() for k, v in xs.items()}                # PyTorch's fast path takes bf16 x
        qb = [(q, s.bfloat16()) for q, s in qs]
        return {"ours": lambda: [cpu_kernels.int8_linear(xs[q.shape[1]], q, s) for q, s in qs],
                "_weight_int8pack_mm": lambda: [quant.int8_linear(xs[q.shape[1]], q, s) for q, s in qs],
                "_weight_int8pack_mm bf16": lambda: [quant.int8_linear(xb[q.shape[1]], q, s) for q, s in qb],
                "dequantize+F.linear": lambda: [F.linear(xs[q.shape[1]], cpu_kernels.dequantize("int8", (q, s),
                                                                                                torch.float32))
                                                for q, s in qs]}
    qs = [quant.quantize(w, "int4", 64) for w in ws]
    packed = [(cpu_kernels.int4_pack(*t), t[0].shape[0], t[0].shape[1] * 2, t[1].shape[1]) for t in qs]
    tq = [(quant.int4_kernel_weight(q), quant.int4_scales_and_zeros(s, z, torch.float32), q.shape[0]) for q, s, z in qs]
    tb = [(w, sz.bfloat16(), n) for w, sz, n in tq]
    xb = {k: v.bfloat16() for k, v in xs.items()}
    return {"ours": lambda: [cpu_kernels.int4_linear(xs[p[2]], *p) for p in packed],
            "_weight_int4pack_mm_for_cpu": lambda: [quant.int4_linear(xs[sz.shape[0] * 64], w, sz, 64, n)
                                                    for w, sz, n in tq],
            "_weight_int4pack_mm_for_cpu bf16": lambda: [quant.int4_linear(xb[sz.shape[0] * 64], w, sz, 64, n)
                                                         for w, sz, n in tb],
            "dequantize+F.linear": lambda: [F.linear(xs[t[0].shape[1] * 2], cpu_kernels.dequantize("int4", t,
                                                                                                    torch.float32))
                                            for t in qs]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 128])
    ap.add_argument("--formats", nargs="+", default=["float32", "bfloat16", "int8", "int4"])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, nargs="+", default=[2])
    ap.add_argument("--layers", type=int, default=4, help="copies of the three matrices (past the L3 cache)")
    ap.add_argument("--level", default=None, help="force an instruction-set level (as HYBRIDLM_CPU_ISA)")
    a = ap.parse_args()
    if a.level:
        os.environ["HYBRIDLM_CPU_ISA"] = a.level
    assert cpu_kernels.available(), "the kernels did not build"
    torch.manual_seed(0)
    ws = [torch.randn(n, k) / k ** 0.5 for _ in range(a.layers) for n, k in SHAPES]
    for threads in a.threads:
        torch.set_num_threads(threads)
        # one thread: the thread's CPU time (time descheduled on a shared machine is not counted); more: wall time
        clock = cpu_kernel_speed.clock = time.thread_time if threads == 1 else time.perf_counter
        bw = read_bandwidth(a.repeats, clock=clock)
        print(f"\nCPU: {cpu_model()}, flags {' '.join(sorted(set(FLAGS) & cpu_flags()))}; kernel level "
              f"{cpu_kernels.level()}; {threads} threads; torch {torch.__version__}; read limit {bw:.1f} GB/s; "
              f"{'thread CPU' if clock is time.thread_time else 'wall'} ms for {len(ws)} matrices, best of "
              f"{a.repeats}, candidates interleaved")
        print("| format | rows | ours ms | ours GB/s | of read limit | PyTorch's best ms | which | ours / best other |")
        print("|---|---:|---:|---:|---:|---:|---|---:|")
        with torch.inference_mode():
            for fmt in a.formats:
                for m in a.rows:
                    xs = {k: torch.randn(m, k) for k in {k for _, k in SHAPES}}
                    t = cpu_kernel_speed.interleaved(candidates(fmt, ws, xs), a.repeats)
                    other = min((k for k in t if k != "ours"), key=t.get)
                    gbs = weight_bytes(fmt, ws) / t["ours"] / 1e9
                    print(f"| {fmt} | {m} | {t['ours'] * 1e3:.2f} | {gbs:.1f} | {gbs / bw:.2f} | "
                          f"{t[other] * 1e3:.2f} | {other} | {t['ours'] / t[other]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
