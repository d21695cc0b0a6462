"""`hybridlm bench --suite llamacpp`: llama.cpp, the CPU runtime people measure against, beside hybridlm on the same
weights, the same prompt and the same threads, interleaved in one run.

Two models with random weights (hybridlm's own init): a Llama (`(AM)*30`, d 2048, 32 heads / 4 KV heads, SwiGLU 5632,
vocabulary 32000: 1.45B) and a Mamba-2 (`S*48`, d 2048, state 128, vocabulary 50288: the 1.3B shape; llama.cpp
pads Mamba vocabularies to 16). Each is saved as a hybridlm checkpoint, exported as transformers' own class (`convert --to-hf --as-native`), turned into a float32
GGUF by llama.cpp's own converter (`convert_hf_to_gguf.py` from the llama.cpp sources the package was built from)
and quantized by llama.cpp to Q8_0 and Q4_0. Then, round by round, each runtime in a fresh process: prefill the same
128 random token ids, then 64 greedy tokens; llama.cpp at f32 / bf16 / Q8_0 / Q4_0 against hybridlm at float32 /
bfloat16 / int8 / int4 (groups of 32, Q4_0's block). Wall-clock time around the calls on both sides (llama.cpp's own
counters are recorded too), and the two float32 runs' logits after the prompt compared: the same model, read twice.

Needs `llama-cpp-python` built from source for this CPU and its sources for the converter:
    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install --no-binary llama-cpp-python llama-cpp-python
    pip download --no-deps --no-binary :all: llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    hybridlm bench --suite llamacpp --llamacpp-src llama_cpp_python-<version>/vendor/llama.cpp --out F.json
Settings (flags; registry.py): --models llama,mamba2 --prompt 128 --new 64 --rounds 2 --runtimes f32,bf16,q8_0,q4_0
--dir runs/llamacpp; --quick runs tiny models. On a CPU without bf16 units (no AVX512-BF16 / AMX) bf16 is emulated
on both sides: float32 is the comparison that counts there.
"""
import os
import sys
import time

import torch

from . import measure as ms
from .llamacpp_families import families_suite
from .llamacpp_jobs import LLAMA_FTYPES, PAIRS, convert_to_gguf, hybridlm_job, llama_cpp_sources, llamacpp_job, \
    quantize_gguf
from .registry import cpu_host, host_line

MODELS = {"llama": dict(preset="llama", d_model=2048, n_layers=30, n_heads=32, n_kv_heads=4, mlp_hidden=5632,
                        vocab_size=32000),
          "mamba2": dict(preset="mamba2", d_model=2048, n_layers=48, vocab_size=50288)}
QUICK = {"llama": dict(preset="llama", d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=256,
                       vocab_size=512),
         "mamba2": dict(preset="mamba2", d_model=128, n_layers=2, vocab_size=512)}


# --- the weights, in both formats ----------------------------------------------------------------------------
def build(name: str, size: dict, root: str, src: str) -> dict:
    """A random model as a hybridlm checkpoint, its native transformers export and llama.cpp's GGUFs (made once;
    reused when present; `src`: llama.cpp's sources). -> {"checkpoint", "hf", "gguf": {runtime: path}, "parameters"}."""
    from ..checkpoint import save_checkpoint
    from ..data.tokenizer import BPETokenizer
    from ..hf.directory import export_to_hf
    from ..models import CausalLM, presets
    d = os.path.join(root, name)
    run, hf = os.path.join(d, "run"), os.path.join(d, "hf")
    over = {k: v for k, v in size.items() if k != "preset"}
    cfg = presets.get(size["preset"], **over)
    if not os.path.isdir(os.path.join(run, "checkpoint")):
        torch.manual_seed(0)
        model = CausalLM(cfg).eval()
        with open(__file__) as f:
            tok = BPETokenizer.train([f.read()], 512)
        save_checkpoint(run, model, tokenizer=tok)
        del model
    if not os.path.isfile(os.path.join(hf, "config.json")):
        export_to_hf(os.path.join(run, "checkpoint"), hf, native=True)
    ggufs = {"f32": os.path.join(d, "f32.gguf"), "bf16": os.path.join(d, "bf16.gguf")}
    for rt, path in ggufs.items():
        if not os.path.isfile(path):
            convert_to_gguf(hf, path, rt, src)
    for rt, ftype in LLAMA_FTYPES.items():
        ggufs[rt] = os.path.join(d, f"{rt}.gguf")
        if not os.path.isfile(ggufs[rt]):
            quantize_gguf(ggufs["f32"], ggufs[rt], ftype)
    with torch.device("meta"):
        params = CausalLM(cfg).num_parameters()
    return {"checkpoint": os.path.join(run, "checkpoint"), "hf": hf, "gguf": ggufs, "parameters": params}


def llamacpp_suite(s: dict, log=print) -> dict:
    """Settings (registry.py): models, families, prompt, new, rounds, runtimes, dir, llamacpp_src, quick; with
    `families`, the hybrid families of llamacpp_families.py instead of `models`."""
    from ..dtypes import cpu_flags
    from ..errors import ConfigError
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise ConfigError('the llamacpp suite needs llama-cpp-python, built for this CPU: '
                          'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install --no-binary llama-cpp-python llama-cpp-python') from None
    llama_cpp_sources(s["llamacpp_src"])
    if s["families"]:
        return families_suite(s, log)
    threads = torch.get_num_threads()
    sizes = QUICK if s["quick"] else MODELS
    runtimes = s["runtimes"].split(",")
    out = {"settings": s, "threads": threads, **cpu_host(),
           "cpu_bf16": sorted({"amx_bf16", "avx512_bf16"} & cpu_flags()), "models": {}, "rows": []}
    for name in s["models"].split(","):
        t = time.perf_counter()
        made = build(name, sizes[name], s["dir"], s["llamacpp_src"])
        log(f"{name}: {made['parameters'] / 1e9:.2f}B parameters, GGUFs {', '.join(made['gguf'])} "
            f"({time.perf_counter() - t:.0f} s)")
        vocab = sizes[name]["vocab_size"]
        runs = {rt: [] for rt in runtimes} | {PAIRS[rt]: [] for rt in runtimes}
        for _ in range(s["rounds"]):                 # interleaved: every configuration once per round
            for rt in runtimes:
                runs[rt].append(ms.fresh(llamacpp_job, gguf=made["gguf"][rt], vocab=vocab, prompt=s["prompt"],
                                         new=s["new"], threads=threads))
                runs[PAIRS[rt]].append(ms.fresh(hybridlm_job, checkpoint=made["checkpoint"], weights=PAIRS[rt],
                                                vocab=vocab, prompt=s["prompt"], new=s["new"]))
        a, b = torch.tensor(runs["f32"][0]["last_logits"]), torch.tensor(runs["float32"][0]["last_logits"])
        agree = {"max_abs_logit_diff": float((a - b).abs().max()), "logit_scale": float(a.abs().max()),
                 "same_first_token": int(a.argmax()) == int(b.argmax())}
        out["models"][name] = dict(parameters=made["parameters"], float32_agreement=agree)
        log(f"  float32 logits after the prompt, llama.cpp vs hybridlm: max |diff| {agree['max_abs_logit_diff']:.2e}"
            f" (largest logit {agree['logit_scale']:.2f})")
        for rt in runtimes:
            for runtime, key in (("llama.cpp", rt), ("hybridlm", PAIRS[rt])):
                rs = runs[key]
                row = {"model": name, "runtime": runtime, "weights": key, "parameters": made["parameters"],
                       "prefill_tokens_per_s": [r["prefill_tokens_per_s"] for r in rs],
                       "decode_tokens_per_s": [r["decode_tokens_per_s"] for r in rs]}
                if "counters" in rs[0]:
                    row["counters"] = [r["counters"] for r in rs]
                if "kernels" in rs[0]:                   # the path the hybridlm run took (its own process)
                    out["cpu_kernels"] = row["kernels"] = rs[0]["kernels"]
                out["rows"].append(row)
            ref, us = out["rows"][-2], out["rows"][-1]
            ratio = ms.median(us["decode_tokens_per_s"]) / ms.median(ref["decode_tokens_per_s"])
            us["decode_vs_llamacpp"] = ratio
            us["prefill_vs_llamacpp"] = ms.median(us["prefill_tokens_per_s"]) / ms.median(ref["prefill_tokens_per_s"])
            log(f"  {rt:>5} / {PAIRS[rt]:<8} decode tok/s llama.cpp "
                + " ".join(f"{v:6.2f}" for v in ref["decode_tokens_per_s"]) + "  hybridlm "
                + " ".join(f"{v:6.2f}" for v in us["decode_tokens_per_s"]) + f"  ({ratio:.2f}x);  prefill "
                f"{ms.median(ref['prefill_tokens_per_s']):6.1f} vs {ms.median(us['prefill_tokens_per_s']):6.1f} "
                f"tok/s ({us['prefill_vs_llamacpp']:.2f}x)")
    out["markdown"] = models_table(out)
    return out


def models_table(res: dict) -> str:
    """The suite's result as markdown: the host (CPU, flags, kernel path), then one row per model and weights."""
    from ..markdown import markdown_table
    med = ms.median
    theirs = {(r["model"], r["weights"]): r for r in res["rows"] if r["runtime"] == "llama.cpp"}
    rows = [[r["model"], f"{r['parameters'] / 1e9:.2f}B", f"{rt} / {r['weights']}",
             f"{med(theirs[r['model'], rt]['decode_tokens_per_s']):.1f}", f"{med(r['decode_tokens_per_s']):.1f}",
             f"{r['decode_vs_llamacpp']:.2f}x", f"{med(theirs[r['model'], rt]['prefill_tokens_per_s']):.0f} / "
             f"{med(r['prefill_tokens_per_s']):.0f}", f"{r['prefill_vs_llamacpp']:.2f}x"]
            for r in res["rows"] if r["runtime"] == "hybridlm" for rt in [k for k, v in PAIRS.items()
                                                                        if v == r["weights"]]]
    return host_line(res) + "\n" + "\n".join(markdown_table(
        ["model", "params", "llama.cpp / hybridlm", "decode llama.cpp", "decode hybridlm", "decode ratio",
         "prefill tok/s", "prefill ratio"], rows)) + "\n"


if __name__ == "__main__":
    from .registry import main
    sys.exit(main("llamacpp"))
