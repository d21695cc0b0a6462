"""`hybridlm bench --suite decode-profile`: where one CPU decode step's time goes, for a model shape (the llama.cpp
families' ~1B shapes, bench/llamacpp_families.py) or a run, in each stored format (bf16, f32, int8, int4).

One step splits into parts, each timed by forward hooks: the embedding, each block's norm and mixer (grouped by the
mixer's class over the layers), the block's own lines (the residual add), the final norm, the lm head, and what is
left of the step (`decode_step`'s own Python); sampling is timed apart on the step's logits. Inside a part, every
call into the kernels' library (a proxy in place of `ops.cpu_kernels._lib`) is timed as native time; the rest of
the part is PyTorch ops and Python. Bytes: what the part's weights take to read once (a routed MoE: its k chosen
experts' share; an embedding: one row), and for each linear kernel call the matrix it reads (from its arguments),
so GB/s is the kernels' streaming rate against the machine's read limit, measured by the same process with the same
threads (`read_bandwidth`: a float32 sum of 512 MB, the faster of torch's and the library's plain loop).

Checked by itself at any size: the parts add up to the instrumented step (by construction), the instrumented step
is shown beside the plain one (the instrument's own cost), and `--check` times one large bf16 matrix through the
kernel beside the read limit (a single matrix-vector product should stream near it).

This module imports only what older trees have too: `python scripts/decode_profile.py` runs it against whatever
hybridlm is on PYTHONPATH (an older checkout's src: the same instrument on the old and the new code).
"""
import argparse
import ctypes
import json
import os
import statistics
import time

import torch
from torch import nn

DEFAULTS = dict(families="llama,qwen3-next,kimi-linear,lfm2", formats="bf16,int8,int4", run="", context=128,
                steps=16, group_size=32, check=False, read_mb=512)
QUICK = dict(steps=3, read_mb=64)
FORMAT_DTYPE = {"bf16": torch.bfloat16, "f32": torch.float32}


def read_bandwidth(repeats: int = 5, mb: int = 512, clock=time.perf_counter) -> float:
    """GB/s reading memory with torch's current threads: the faster of two float32 sums over `mb` MB (torch's, and
    the kernels' plain streaming `read_sum`), best of `repeats` each on `clock`."""
    from ..ops import cpu_kernels
    big = torch.ones(mb << 18)
    fns = [big.sum] + ([lambda: cpu_kernels._lib.read_sum(big.data_ptr(), big.numel())]
                       if cpu_kernels.available() else [])
    best = float("inf")
    for fn in fns:
        fn()
        for _ in range(repeats):
            t = clock()
            fn()
            best = min(best, clock() - t)
    return big.numel() * 4 / best / 1e9


def kernel_bytes(name: str, a: tuple) -> int:
    """Bytes of weight a linear kernel call reads, from its arguments (csrc/linear.h); 0 for the other calls."""
    if name in ("mv_f32", "mv_bf16", "mv_bf16_f32", "mv_bf16_io"):     # (x, M, K, w, N, ...)
        return a[2] * a[4] * (4 if name == "mv_f32" else 2)
    if name == "mv_int8":                                             # (x, M, K, q, scale, N, y)
        return a[2] * a[5] + 4 * a[5]
    if name == "q4_linear":                                           # (x, M, K, packed, N, Kp, G, y)
        N, Kp, G = a[4], a[5], a[6]
        return (N + 7) // 8 * G * (32 + Kp // G // 32 * 128)
    if name == "mv_experts":                                          # (x, M, K, lin, ids, n, ...)
        return 0                                                      # counted by the module
    return 0


def module_bytes(m: nn.Module) -> int:
    """Bytes of weight one decode step of one row reads in `m`: its matrices (>= 2-D parameters and buffers) once,
    an int4 weight as packed for the kernel (nibbles, a float16 scale and min per group), an embedding's one row, a
    stack of E experts [E, ...] by top_k / E."""
    if isinstance(m, nn.Embedding):
        return m.weight.shape[1] * m.weight.element_size()
    total = 0
    for sub in m.modules():
        share = sub.top_k / sub.num_experts if hasattr(sub, "top_k") and hasattr(sub, "num_experts") else None
        for name, t in [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]:
            if t is None or t.dim() < 2:
                continue
            n = t.numel() * t.element_size()
            if getattr(sub, "scheme", None) == "int4" and name in ("scale", "zero"):
                n = t.numel() * 2
            total += n * (share if share is not None and t.dim() == 3 else 1)
        if share is not None:           # QuantizedExperts below a RoutedMoE: its stack scaled by the same share
            for q in sub.modules():
                if q is not sub and getattr(q, "scheme", None) and q.weight_q.dim() == 3:
                    total -= module_bytes(q) * (1 - share)
    return int(total)


class _Timed:
    """A library function whose calls are timed into a Recorder."""
    __slots__ = ("fn", "name", "rec")

    def __init__(self, fn, name, rec):
        self.fn, self.name, self.rec = fn, name, rec

    def __call__(self, *a):
        t = time.perf_counter_ns()
        out = self.fn(*a)
        self.rec.native(self.name, time.perf_counter_ns() - t, a)
        return out


class _Lib:
    """Stands for the kernels' library: its functions come back timed, everything else as it is."""

    def __init__(self, lib, rec):
        object.__setattr__(self, "_real", lib)
        object.__setattr__(self, "_rec", rec)

    def __getattr__(self, name):
        fn = getattr(self._real, name)
        if isinstance(fn, ctypes._CFuncPtr):
            fn = _Timed(fn, name, self._rec)
            object.__setattr__(self, name, fn)
        return fn

    def __setattr__(self, name, value):
        setattr(self._real, name, value)


def parts_of(model: nn.Module) -> dict[nn.Module, str]:
    """The modules a step is split into -> their part's name: embed, each block's direct children (its norm(s) and
    mixer(s), by class: one row per kind over the layers), the blocks themselves (their own lines), final norm and
    lm head."""
    out = {model.embed: "embedding", model.norm: "final norm", model.lm_head: "lm head"}
    for blk in model.blocks:
        out[blk] = "block lines (residual adds)"
        for child in blk.children():
            for m in (child if isinstance(child, nn.ModuleList) else [child]):
                if any(True for _ in m.parameters()) or any(True for _ in m.buffers()):
                    kind = type(m).__name__
                    out[m] = "norm" if "norm" in kind.lower() else kind
    return out


class Recorder:
    """Times the parts of `model`'s steps and the library's calls inside them (a context manager: hooks and the
    library proxy are in place inside `with`). After n steps: `parts` name -> [calls, ns, native ns, bytes],
    `kernels` function -> [calls, ns, bytes]."""

    def __init__(self, model: nn.Module):
        self.model, self.names = model, parts_of(model)
        self.parts, self.kernels, self.stack = {}, {}, []
        self.bytes = {m: module_bytes(m) for m in self.names}
        for blk in model.blocks:      # a block's own bytes are its children's: counted there
            self.bytes[blk] = 0

    def native(self, name: str, ns: int, args: tuple):
        k = self.kernels.setdefault(name, [0, 0, 0])
        k[0] += 1
        k[1] += ns
        k[2] += kernel_bytes(name, args)
        if self.stack:
            self.stack[-1][2] += ns

    def _pre(self, m, *_):
        self.stack.append([m, time.perf_counter_ns(), 0, 0])      # module, start, native ns, children's ns

    def _post(self, m, *_):
        mod, start, nat, kids = self.stack.pop()
        wall = time.perf_counter_ns() - start
        p = self.parts.setdefault(self.names[mod], [0, 0, 0, 0])
        p[0] += 1
        p[1] += wall - kids              # a block's own lines: its wall less its children's
        p[2] += nat
        p[3] += self.bytes[mod]
        if self.stack:
            self.stack[-1][3] += wall

    def _timed(self, step):
        """A CPU decode step (layers/cpu_steps.py: the blocks call it in place of the mixer's forward, so no forward
        hook fires) timed as its mixer's part when it takes the mixer."""
        def call(m, *args):
            if m not in self.names:
                return step(m, *args)
            self._pre(m)
            y = step(m, *args)
            if y is None:
                self.stack.pop()            # declined: the mixer's own forward (hooked) follows
            else:
                self._post(m)
            return y
        return call

    def __enter__(self):
        from ..ops import cpu_kernels
        try:
            from ..layers import cpu_steps  # (a tree without the CPU decode seam has only the forward hooks)
        except ImportError:
            cpu_steps = None
        self._lib = cpu_kernels._lib
        if self._lib:
            cpu_kernels._lib = _Lib(self._lib, self)
        self._hooks = [h for m in self.names for h in (m.register_forward_pre_hook(self._pre),
                                                       m.register_forward_hook(self._post))]
        self._steps = dict(cpu_steps.STEPS) if cpu_steps is not None else None
        if self._steps is not None:
            cpu_steps.STEPS.update({cls: self._timed(fn) for cls, fn in self._steps.items()})
        return self

    def __exit__(self, *exc):
        from ..ops import cpu_kernels
        cpu_kernels._lib = self._lib
        for h in self._hooks:
            h.remove()
        if self._steps is not None:
            from ..layers import cpu_steps
            cpu_steps.STEPS.update(self._steps)


def build(name: str, fmt: str, group_size: int, quick: bool = False, run: str = "") -> nn.Module:
    """A model in stored format `fmt` (bf16, f32, int8, int4) on the CPU kernels, as `hybridlm generate` runs it:
    family `name`'s shape (random weights; its transformers config mirrored, bench/llamacpp_families.py), or the
    checkpoint `run`."""
    from ..models import CausalLM
    from ..models.quantize import quantize_, use_cpu_kernels_
    torch.manual_seed(0)
    if run:
        from ..checkpoint import load_checkpoint
        model = load_checkpoint(run)[0]
    else:
        from ..hf.convert import config_from_transformers
        from .llamacpp_families import family_config
        model = CausalLM(config_from_transformers(family_config(name, quick=quick), max_seq_len=4096))
    model = model.to(FORMAT_DTYPE.get(fmt, torch.bfloat16)).eval()
    if fmt in ("int8", "int4"):
        quantize_(model, fmt, group_size)
    return use_cpu_kernels_(model)


def profile(model: nn.Module, context: int, steps: int) -> dict:
    """The step's split after `context` prompt tokens, `steps` steps each for the plain and the instrumented clock;
    times are medians (plain) and means (parts), in ms per step."""
    from ..models.generation import sample_next
    from .measure import prefilled
    step = prefilled(model, context, max_tokens=context + 2 * steps + 8, step_fn=model.decode_step)[0]

    def clocked(fn, n):
        out = []
        for _ in range(n):
            t = time.perf_counter_ns()
            fn()
            out.append(time.perf_counter_ns() - t)
        return out
    step()                                                   # warm-up: the steps' plans built, pages touched
    plain = statistics.median(clocked(step, steps)) / 1e6
    rec = Recorder(model)
    with rec:
        walls = clocked(step, steps)
    timed = sum(walls) / steps / 1e6                          # the parts' total (a mean: they are summed)
    logits = torch.randn(1, model.config.vocab_size)        # sampling's time depends on the vocabulary only
    greedy = statistics.median(clocked(lambda: logits.argmax(-1), steps)) / 1e6
    sampled = statistics.median(clocked(lambda: sample_next(logits, temperature=0.8, top_p=0.95), steps)) / 1e6
    parts = {k: dict(calls=c / steps, ms=ns / steps / 1e6, native_ms=nat / steps / 1e6, mb=b / steps / 1e6)
             for k, (c, ns, nat, b) in rec.parts.items()}
    parts["decode_step's own lines"] = dict(calls=1, ms=timed - sum(p["ms"] for p in parts.values()), native_ms=0.0,
                                            mb=0.0)
    kernels = {k: dict(calls=c / steps, ms=ns / steps / 1e6, mb=b / steps / 1e6) for k, (c, ns, b) in
               rec.kernels.items()}
    return dict(step_ms=plain, instrumented_ms=timed, instrumented_median_ms=statistics.median(walls) / 1e6,
                greedy_ms=greedy, sample_ms=sampled,
                mb_per_step=sum(p["mb"] for p in parts.values()), parts=parts, kernels=kernels)


def check_matrix(bw: float, n: int = 8192, k: int = 8192, repeats: int = 10) -> dict:
    """The known answer: one [n, k] bf16 matrix (128 MB at the default) times a vector through the kernel, its GB/s
    beside the read limit (a lone matrix-vector product should stream near it)."""
    from ..ops import cpu_kernels
    w = torch.randn(n, k).bfloat16()
    x = torch.randn(1, k).bfloat16()
    cpu_kernels.linear(x, w)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        cpu_kernels.linear(x, w)
        best = min(best, time.perf_counter() - t)
    gbs = w.numel() * 2 / best / 1e9
    return dict(shape=[n, k], ms=best * 1e3, gb_per_s=gbs, of_limit=gbs / bw)


def decode_profile_suite(s: dict, log=print) -> dict:
    """Settings: families, formats, run (a checkpoint instead of the families), context, steps, group_size (int4),
    check (the one-matrix known answer), read_mb (the read limit's sum)."""
    from . import registry
    threads = torch.get_num_threads()
    bw = read_bandwidth(mb=s["read_mb"])
    host = registry.cpu_host()
    out = dict(settings=s, threads=threads, read_gb_per_s=bw, host=host, lscpu=_lscpu(), rows=[])
    log(f"read limit {bw:.1f} GB/s with {threads} threads; {host['cpu_kernels']}")
    if s["check"]:
        out["check"] = check_matrix(bw)
        log(f"one bf16 matrix {out['check']['shape']}: {out['check']['gb_per_s']:.1f} GB/s "
            f"({out['check']['of_limit']:.2f} of the read limit)")
    for name in ([s["run"]] if s["run"] else s["families"].split(",")):
        for fmt in s["formats"].split(","):
            model = build(name, fmt, s["group_size"], s["quick"], s["run"])
            row = dict(model=os.path.basename(name.rstrip("/")), format=fmt, context=s["context"],
                       **profile(model, s["context"], s["steps"]))
            out["rows"].append(row)
            log(f"{row['model']} {fmt}: {row['step_ms']:.2f} ms a step ({1e3 / row['step_ms']:.1f} tok/s), "
                f"{row['mb_per_step']:.0f} MB read: {row['mb_per_step'] / row['step_ms']:.1f} GB/s")
            del model
    out["markdown"] = format_tables(out)
    return out


def _lscpu() -> str:
    """lscpu's model name and flags lines (the CPU a profile ran on)."""
    import subprocess
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""
    return "\n".join(line for line in text.splitlines() if line.startswith(("Model name", "Flags")))


def format_tables(res: dict) -> str:
    """The markdown: a line on the machine, a summary row per model and format, then each one's parts and
    kernels."""
    bw = res["read_gb_per_s"]
    lines = [f"CPU: {res['host']['cpu']}; {res['threads']} threads; read limit {bw:.1f} GB/s (float32 sum of "
             f"{res['settings']['read_mb']} MB, same process and threads); {res['host']['cpu_kernels']}; "
             f"torch {torch.__version__}", "",
             "```", res["lscpu"], "```", ""]
    if "check" in res:
        c = res["check"]
        lines += [f"Known answer: one bf16 [{c['shape'][0]}, {c['shape'][1]}] matrix-vector product through the "
                  f"kernel: {c['gb_per_s']:.1f} GB/s, {c['of_limit']:.2f} of the read limit.", ""]
    lines += ["ms/step: the median plain step; instrumented: the median and the mean (what the parts add up to) of "
              "the instrumented steps.", "",
              "| model | format | ms/step | tok/s | MB/step | GB/s | of read limit | instrumented ms (median / mean) | "
              "greedy ms | top-p sample ms |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        gbs = r["mb_per_step"] / r["step_ms"]
        lines.append(f"| {r['model']} | {r['format']} | {r['step_ms']:.2f} | {1e3 / r['step_ms']:.1f} | "
                     f"{r['mb_per_step']:.0f} | {gbs:.1f} | {gbs / bw:.2f} | {r['instrumented_median_ms']:.2f} / "
                     f"{r['instrumented_ms']:.2f} | "
                     f"{r['greedy_ms']:.3f} | {r['sample_ms']:.3f} |")
    for r in res["rows"]:
        t = r["instrumented_ms"]
        lines += ["", f"**{r['model']} {r['format']}** (instrumented step {t:.2f} ms; native: time inside the "
                      f"kernels' library; other: PyTorch ops and Python)", "",
                  "| part | calls | ms | of step | native ms | other ms | MB | GB/s native | of read limit |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for k, p in sorted(r["parts"].items(), key=lambda kv: -kv[1]["ms"]):
            gbs = p["mb"] / p["native_ms"] if p["native_ms"] > 0 and p["mb"] else None
            lines.append(f"| {k} | {p['calls']:.0f} | {p['ms']:.3f} | {p['ms'] / t:.1%} | {p['native_ms']:.3f} | "
                         f"{p['ms'] - p['native_ms']:.3f} | {p['mb']:.1f} | "
                         + (f"{gbs:.1f} | {gbs / bw:.2f} |" if gbs else "| |"))
        lines += ["", "| kernel | calls | ms | MB | GB/s | of read limit |", "|---|---:|---:|---:|---:|---:|"]
        for k, p in sorted(r["kernels"].items(), key=lambda kv: -kv[1]["ms"]):
            gbs = p["mb"] / p["ms"] if p["mb"] and p["ms"] > 0 else None
            lines.append(f"| {k} | {p['calls']:.0f} | {p['ms']:.3f} | {p['mb']:.1f} | "
                         + (f"{gbs:.1f} | {gbs / bw:.2f} |" if gbs else "| |"))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """The suite with its own flags (no registry needed: an older tree's hybridlm runs it too); prints the
    markdown, writes the JSON to --out when given."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for k, v in DEFAULTS.items():
        if isinstance(v, bool):
            ap.add_argument("--" + k.replace("_", "-"), dest=k, action="store_true")
        else:
            ap.add_argument("--" + k.replace("_", "-"), dest=k, type=type(v), default=v)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, few steps: a smoke test")
    ap.add_argument("--out", default="", help="JSON results file")
    a = vars(ap.parse_args(argv))
    if a["quick"]:
        a.update({k: v for k, v in QUICK.items() if argv is None or f"--{k}" not in argv})
    res = decode_profile_suite(a, log=lambda m: print(m, flush=True))
    print("\n" + res["markdown"])
    if a["out"]:
        with open(a["out"], "w") as f:
            json.dump({k: v for k, v in res.items() if k != "markdown"}, f, indent=1)
    return 0
