"""Framework overhead of one decode step per mixer kind (issue 43, item 3): the time a layer spends outside the
matrix-vector kernels, at batch 1 on a ~1B-shaped layer (d_model 2048), bf16 weights, the project's CPU kernels on.

For each letter X (A attention, S SSD, R Rodimus, G Gated DeltaNet, K KDA, C short conv, M gated MLP, O routed
experts) a model of
`layers` X layers (layout "X*layers", the other fields from the family's preset) is prefilled with 64 tokens, then:
  step    time of one `decode_step` (best of N; the thread's CPU time, or wall time with --wall);
  kernel  time of the same matrix-vector kernel calls replayed alone (recorded during one step: the same
          pointers, so the same bytes read);
  fused   time inside the fused one-token C++ ops (ops/cpu_decode.py: state updates, attention over the cache,
          norms), timed call by call during a step (best of 5 steps): work on the state, not overhead;
  other   (step - kernel - fused) / layers: the framework overhead of a layer (small ops, Python, dispatch);
  before  the same step with the fused one-token ops off, their PyTorch references instead, alternated with the
          fused step call by call: (step - kernel) / layers (its state updates are PyTorch ops, counted in).
With --small, the per-layer time where the kernels have next to nothing to do (d_model 256): the slope of step
time over 1 and 9 layers, in two modes alternated: PyTorch's small ops, the whole-mixer steps (layers/cpu_steps.py)
(the cleaner figure of the framework's cost).
With --profile, torch.profiler's top ops by self CPU time for each letter (the kernels show as `cpu_kernels`).

    python scripts/decode_overhead.py [--letters ASRGKCMO] [--layers 4] [--repeats 20] [--threads 1] [--profile] [--small]
"""
import argparse
import time

import torch

from hybridlm.models import presets
from hybridlm.models.causal_lm import CausalLM
from hybridlm.models.quantize import use_cpu_kernels_
from hybridlm.layers import cpu_steps
from hybridlm.ops import cpu_decode, cpu_kernels

from cpu_kernel_speed import best as best_of          # scripts/ is on the path of a script run from it

# letter -> (preset it takes its fields from, layout for n layers)
KINDS = {"A": ("llama", "A*{n}"), "S": ("mamba2", "S*{n}"), "R": ("rodimus", "R*{n}"),
         "G": ("qwen3-next", "G*{n}"), "K": ("kimi-linear", "K*{n}"), "C": ("lfm2", "C*{n}"),
         "M": ("llama", "M*{n}"), "O": ("qwen3-next", "O*{n}")}
# the calling thread's CPU time: with one thread (the default) the kernels run on it, and time spent descheduled by
# other processes on a shared machine is not counted (wall time is, with --wall)
clock = time.thread_time
SIZE = dict(d_model=2048, n_heads=32, n_kv_heads=4, head_dim=64, vocab_size=512, mlp_hidden=5632)


def build(letter: str, n: int) -> CausalLM:
    preset, layout = KINDS[letter]
    cfg = presets.get(preset, layout=layout.format(n=n), n_layers=n, **SIZE)
    torch.manual_seed(0)
    m = CausalLM(cfg).to(torch.bfloat16).eval()         # initialised when built
    return use_cpu_kernels_(m)


def best(fn, repeats: int) -> float:
    return best_of(fn, repeats, clock)


class Recorder:
    """Wraps the ctypes kernels of cpu_kernels._lib: records each call's arguments while on. Pointers to the model's
    tensors are kept; those to a call's temporaries (x, its rounded copies, y: freed after the call) are replaced by
    scratch buffers, the last argument (y) by an output one."""

    def __init__(self, model):
        self.lib, self.calls, self.on, self.fused_s = cpu_kernels._lib, [], False, 0.0
        self.keep = {t.data_ptr() for t in (*model.parameters(), *model.buffers())}
        self.scratch, self.out = torch.full((8 << 20,), 0.01), torch.empty(8 << 20)

    def __getattr__(self, name):
        fn = getattr(self.lib, name)

        def call(*args):
            if self.on and name.startswith("dec_"):         # a fused op: its time, measured in place
                t = clock()
                fn(*args)
                self.fused_s += clock() - t
                return None
            if self.on and name.startswith("mv_"):          # the matrix-vector kernels, replayed alone later
                a = [v if not isinstance(v, int) or v < 1 << 32 or v in self.keep else self.scratch.data_ptr()
                     for v in args[:-1]]
                self.calls.append((fn, (*a, self.out.data_ptr())))
            return fn(*args)
        return call


def measure(letter: str, n: int, repeats: int, profile: bool) -> dict:
    m = build(letter, n)
    ids = torch.randint(0, 512, (1, 64))
    cache = m.make_cache(1)
    with torch.no_grad():
        m(ids, cache=cache)
        tok = ids[:, -1:]

        # every step appends to the cache: measure on a copy-free rolling cache by resetting positions is not
        # possible for all kinds, so steps simply keep going (64 + a few hundred tokens: attention's read grows
        # by < 1 MB, far below the layer's weights)
        def step():
            return m.decode_step(tok, cache)
        rec = Recorder(m)
        real = cpu_kernels._lib
        cpu_kernels._lib = rec
        fused = float("inf")
        try:
            step()
            for _ in range(5):            # the fused ops' time: the best of 5 steps
                rec.calls, rec.fused_s, rec.on = [], 0.0, True
                step()
                rec.on = False
                fused = min(fused, rec.fused_s)
        finally:
            cpu_kernels._lib = real
        calls = rec.calls

        def kernels():
            for fn, args in calls:
                fn(*args)
        def reference_step():            # the same step on the PyTorch references of the fused ops (before)
            serves = cpu_decode.serves
            cpu_decode.serves = lambda *a: False
            try:
                return step()
            finally:
                cpu_decode.serves = serves
        t = {"step": float("inf"), "kernel": float("inf"), "reference": float("inf")}
        reference_step()
        for _ in range(repeats):
            for k, f in (("step", step), ("kernel", kernels), ("reference", reference_step)):
                s = clock()
                f()
                t[k] = min(t[k], clock() - s)
        out = {"letter": letter, "step_ms": 1e3 * t["step"], "kernel_ms": 1e3 * t["kernel"],
               "fused_ms": 1e3 * fused, "ref_step_ms": 1e3 * t["reference"], "kernel_calls": len(calls),
               "other_ms_per_layer": 1e3 * (t["step"] - t["kernel"] - fused) / n,
               "ref_other_ms_per_layer": 1e3 * (t["reference"] - t["kernel"]) / n}
        if profile:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as prof
            with prof(activities=[ProfilerActivity.CPU]) as p:
                for _ in range(5):
                    step()
            out["table"] = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    return out


MODES = ("pytorch", "mixer")     # the layer's PyTorch ops; its whole-mixer step


def slope(letter: str, repeats: int, layers: int = 9) -> dict:
    """Framework time per layer where the kernels have almost nothing to do (d_model 256, vocab 64): (step of
    `layers` layers - step of 1) / (layers - 1), in each of MODES (PyTorch's ops; the whole-mixer steps of
    layers/cpu_steps.py), alternated."""
    preset = KINDS[letter][0]
    steps = {}
    for n in (1, layers):
        cfg = presets.get(preset, layout=KINDS[letter][1].format(n=n), n_layers=n, d_model=256, vocab_size=64)
        torch.manual_seed(0)
        m = use_cpu_kernels_(CausalLM(cfg).to(torch.bfloat16).eval())
        ids = torch.randint(0, 64, (1, 16))
        cache = m.make_cache(1)
        with torch.no_grad():
            m(ids, cache=cache)
            steps[n] = (m, ids[:, -1:], cache)
    t = {}
    serves = cpu_decode.serves
    with torch.no_grad():
        for _ in range(repeats):
            for n, (m, tok, cache) in steps.items():
                for mode in MODES:
                    cpu_decode.serves = serves if mode != "pytorch" else (lambda *a: False)
                    cpu_steps.enabled = mode == "mixer"
                    try:
                        s = clock()
                        m.decode_step(tok, cache)
                        dt = clock() - s
                    finally:
                        cpu_decode.serves, cpu_steps.enabled = serves, True
                    t[n, mode] = min(t.get((n, mode), float("inf")), dt)
    return {f: 1e3 * (t[layers, f] - t[1, f]) / (layers - 1) for f in MODES}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--letters", default="ASRGKCMO")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--small", action="store_true", help="per-layer time at d_model 256 instead (see slope)")
    ap.add_argument("--wall", action="store_true", help="wall-clock time instead of the thread's CPU time")
    a = ap.parse_args()
    global clock
    if a.wall or a.threads > 1:        # other threads' work is not on this thread's clock
        clock = time.perf_counter
    torch.set_num_threads(a.threads)
    assert cpu_kernels.available()
    from cpu_kernel_speed import FLAGS, cpu_model

    from hybridlm.dtypes import cpu_flags
    print(f"CPU: {cpu_model()}, flags {' '.join(sorted(set(FLAGS) & cpu_flags()))}; {a.threads} threads; "
          f"bf16 weights, batch 1, d_model 2048, {a.layers} layers a kind; "
          f"{'wall' if clock is time.perf_counter else 'thread CPU'} time, best of {a.repeats}")
    if a.small:
        print("per layer at d_model 256 (the kernels' work negligible): (step of 9 layers - step of 1) / 8\n"
              "| kind | ms / layer, PyTorch small ops | whole-mixer step |\n|---|---|---|")
        for letter in a.letters:
            r = slope(letter, a.repeats)
            print(f"| {letter} | {r['pytorch']:.3f} | {r['mixer']:.3f} |", flush=True)
        return
    print("| kind | matvec kernels ms | step ms, PyTorch small ops | step ms, fused ops | of it in fused ops ms | "
          "other ms / layer, before | after |\n|---|---|---|---|---|---|---|")
    for letter in a.letters:
        r = measure(letter, a.layers, a.repeats, a.profile)
        print(f"| {letter} | {r['kernel_ms']:.2f} | {r['ref_step_ms']:.2f} | {r['step_ms']:.2f} | {r['fused_ms']:.2f} | "
              f"{r['ref_other_ms_per_layer']:.3f} | {r['other_ms_per_layer']:.3f} |", flush=True)
        if a.profile:
            print(r["table"])


if __name__ == "__main__":
    main()
