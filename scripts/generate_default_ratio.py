"""A library user's `model.generate()` against the path `hybridlm generate` takes (`use_cpu_kernels_` called on the
model first), and transformers' `generate` on the same directory, each in a fresh process, interleaved round by
round; plus `model.generate()` with HYBRIDLM_CPU_KERNELS=0 (what a library user got before the kernels were on by
default). Prints the CPU, the best time of each generate call (prefill + greedy decode), its speed as a ratio to the
command's path, and whether the tokens agree.

    python scripts/generate_default_ratio.py [--preset llama] [--d-model 2048] [--layers 22] [--heads 32]
        [--kv-heads 4] [--mlp 5632] [--vocab 32000] [--dtype bfloat16] [--prompt 128] [--new 64] [--rounds 2]
        [--threads 2] [--dir runs/generate-ratio]
Defaults: TinyLlama's shape (1.1B) in bfloat16 (`hybridlm generate`'s dtype on a CPU with bf16 units).
"""
import argparse
import json
import os
import subprocess
import sys

RUN = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")
import torch
mode, path, prompt, new, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads)
ids = torch.randint(0, 1000, (1, prompt), generator=torch.Generator().manual_seed(0))
if mode == "transformers":
    import hybridlm  # noqa: F401  (registers model_type "hybridlm")
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(path).eval()
    run = lambda: m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
else:
    from hybridlm.checkpoint import load_checkpoint
    m = load_checkpoint(path)[0].eval()
    if mode == "command":                       # what commands/generate.py does to the model before decoding
        from hybridlm.models.quantize import use_cpu_kernels_
        use_cpu_kernels_(m)
    run = lambda: m.generate(ids, new, temperature=0)
t = time.perf_counter()
out = run()
dt = time.perf_counter() - t
print(json.dumps({"s": dt, "tokens": out[0, prompt:].tolist()}))
"""


def main():
    p = argparse.ArgumentParser()
    for name, default in (("preset", "llama"), ("dtype", "bfloat16"), ("dir", os.path.join("runs", "generate-ratio"))):
        p.add_argument(f"--{name}", default=default)
    for name, default in (("d-model", 2048), ("layers", 22), ("heads", 32), ("kv-heads", 4), ("mlp", 5632),
                          ("vocab", 32000), ("prompt", 128), ("new", 64), ("rounds", 2), ("threads", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    a = p.parse_args()
    import torch

    from hybridlm import presets
    from hybridlm.checkpoint import save_checkpoint
    from hybridlm.dtypes import cpu_flags
    from hybridlm.models.causal_lm import CausalLM
    path = os.path.join(a.dir, "checkpoint")
    if not os.path.isdir(path):
        torch.manual_seed(0)
        cfg = presets.get(a.preset, n_layers=a.layers, d_model=a.d_model, n_heads=a.heads, n_kv_heads=a.kv_heads,
                          mlp_hidden=a.mlp, vocab_size=a.vocab, max_seq_len=max(2048, a.prompt + a.new))
        save_checkpoint(a.dir, CausalLM(cfg).to(getattr(torch, a.dtype)))
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 "?") if os.path.exists("/proc/cpuinfo") else "?"
    print(f"CPU: {model}, {a.threads} threads, avx512_bf16 {'yes' if 'avx512_bf16' in cpu_flags() else 'no'}; "
          f"{a.preset} d {a.d_model} x {a.layers} layers, vocab {a.vocab}, {a.dtype}; prompt {a.prompt}, {a.new} "
          f"greedy tokens, best of {a.rounds} fresh processes each, interleaved")
    modes = {"command": {}, "library": {}, "transformers": {}, "library-kernels-off": {"HYBRIDLM_CPU_KERNELS": "0"}}
    best, toks = {}, {}
    for _ in range(a.rounds):
        for mode, env in modes.items():
            done = subprocess.run([sys.executable, "-c", RUN, mode.split("-")[0], path, str(a.prompt), str(a.new),
                                   str(a.threads)], capture_output=True, text=True, env={**os.environ, **env})
            if done.returncode != 0:
                sys.exit(f"{mode} failed:\n{done.stderr[-2000:]}")
            r = json.loads(done.stdout.strip().splitlines()[-1])
            best[mode] = min(best.get(mode, float("inf")), r["s"])
            toks[mode] = r["tokens"]
    for mode in modes:
        print(f"{mode:20s} {best[mode]:7.2f} s   speed {best['command'] / best[mode]:.3f}x the command's path   "
              f"same tokens: {toks[mode] == toks['command']}")


if __name__ == "__main__":
    main()
