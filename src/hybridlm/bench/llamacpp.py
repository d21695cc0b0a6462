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
import subprocess
import sys
import time

import torch

from . import measure as ms

MODELS = {"llama": dict(preset="llama", d_model=2048, n_layers=30, n_heads=32, n_kv_heads=4, mlp_hidden=5632,
                        vocab_size=32000),
          "mamba2": dict(preset="mamba2", d_model=2048, n_layers=48, vocab_size=50288)}
QUICK = {"llama": dict(preset="llama", d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=256,
                       vocab_size=512),
         "mamba2": dict(preset="mamba2", d_model=128, n_layers=2, vocab_size=512)}
# llama.cpp's weights -> hybridlm's at the same width
PAIRS = {"f32": "float32", "bf16": "bfloat16", "q8_0": "int8", "q4_0": "int4"}
LLAMA_FTYPES = {"q8_0": 7, "q4_0": 2}     # llama_ftype: LLAMA_FTYPE_MOSTLY_Q8_0, LLAMA_FTYPE_MOSTLY_Q4_0
INT4_GROUP = 32                            # Q4_0 quantizes blocks of 32


def llama_cpp_sources(src: str) -> str:
    """`src` if it is a llama.cpp source tree with convert_hf_to_gguf.py; one clear error otherwise."""
    from ..errors import ConfigError
    if not os.path.isfile(os.path.join(src, "convert_hf_to_gguf.py")):
        raise ConfigError("the llamacpp suite converts with llama.cpp's own convert_hf_to_gguf.py: give "
                          "--llamacpp-src, the llama.cpp tree llama-cpp-python was built from (its sdist's "
                          f"vendor/llama.cpp){'; got ' + repr(src) if src else ''}")
    return src


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


# the converter knows real tokenizers by a hash of how they split a test text; ours is a small BPE trained here,
# so it is named the default pre-tokenizer (llama.cpp never tokenizes text in this bench: it gets token ids)
_CONVERT = """
import sys
sys.path.insert(0, {gguf_py!r}); sys.path.insert(0, {src!r})
import convert_hf_to_gguf as c
try:
    from conversion.base import ModelBase, TextModel      # llama.cpp of 2026: the model classes live in conversion/
except ImportError:
    ModelBase, TextModel = c.ModelBase, c.TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
def or_bpe(set_vocab):              # a family that wants a SentencePiece / Llama vocabulary takes ours as BPE
    def run(self, *a, **kw):
        try:
            return set_vocab(self, *a, **kw)
        except (FileNotFoundError, ImportError):
            return self._set_vocab_gpt2()
    return run
TextModel._set_vocab_sentencepiece = or_bpe(TextModel._set_vocab_sentencepiece)
TextModel._set_vocab_llama_hf = or_bpe(TextModel._set_vocab_llama_hf)
if {raw_config!r}:                  # config.json as written, not as transformers re-derives it
    import json
    ModelBase.load_hparams = staticmethod(lambda d, *a, **kw: json.load(open(d / "config.json")))
sys.argv = ["convert_hf_to_gguf.py", {hf!r}, "--outfile", {out!r}, "--outtype", {outtype!r}, *{extra!r}]
c.main()
"""


def convert_to_gguf(hf: str, out: str, outtype: str, src: str, extra: list[str] = (), raw_config: bool = False):
    """llama.cpp's convert_hf_to_gguf.py (from the sources `src`) on a transformers directory -> one GGUF file
    (written atomically); `extra`: more of its flags; `raw_config`: the converter reads config.json as written
    (else through transformers)."""
    from ..errors import HybridLMError
    src = llama_cpp_sources(src)
    tmp = out + ".tmp"
    code = _CONVERT.format(gguf_py=os.path.join(src, "gguf-py"), src=src, hf=hf, out=tmp, outtype=outtype,
                        extra=list(extra), raw_config=raw_config)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        raise HybridLMError(f"llama.cpp's converter failed on {hf}: "
                            f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    os.replace(tmp, out)


def quantize_gguf(src: str, out: str, ftype: int):
    """llama.cpp's own quantizer (llama_model_quantize) src GGUF -> out GGUF of `ftype`."""
    import llama_cpp
    from ..errors import HybridLMError
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = torch.get_num_threads()
    tmp = out + ".tmp"
    if llama_cpp.llama_model_quantize(src.encode(), tmp.encode(), params) != 0:
        raise HybridLMError(f"llama.cpp could not quantize {src} to ftype {ftype}")
    os.replace(tmp, out)


# --- the runs (each in a fresh process) ---------------------------------------------------------------------
def _prompt(vocab: int, n: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(1)).tolist()


def llamacpp_job(gguf: str, vocab: int, prompt: int, new: int, threads: int) -> dict:
    """llama.cpp: prefill `prompt` ids (once to warm up, then timed), then `new` greedy tokens, timed."""
    import numpy as np
    import llama_cpp
    ids = _prompt(vocab, prompt)
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=prompt + new + 8, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    llm.eval(ids)                                   # warm-up (first-touch of the weights, repacking)
    llm.reset()
    llama_cpp.llama_perf_context_reset(llm.ctx)
    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    n_vocab = llm.n_vocab()

    def logits():          # the last position's (llama-cpp-python keeps them only with logits_all)
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
    last = logits().copy()
    tok, out = int(last.argmax()), []
    t2 = time.perf_counter()
    for _ in range(new):
        out.append(tok)
        llm.eval([tok])
        tok = int(logits().argmax())
    t3 = time.perf_counter()
    perf = llama_cpp.llama_perf_context(llm.ctx)
    return {"prefill_tokens_per_s": prompt / (t1 - t0), "decode_tokens_per_s": new / (t3 - t2),
            "counters": {"prefill_tokens_per_s": 1e3 * perf.n_p_eval / max(perf.t_p_eval_ms, 1e-9),
                         "decode_tokens_per_s": 1e3 * perf.n_eval / max(perf.t_eval_ms, 1e-9)},
            "tokens": out, "last_logits": last[:vocab].tolist()}


def hybridlm_job(checkpoint: str, weights: str, vocab: int, prompt: int, new: int) -> dict:
    """hybridlm: the same ids and greedy loop (`decode_step`, the CPU kernels of ops/cpu_kernels.py)."""
    from ..checkpoint import load_checkpoint
    from ..models.quantize import quantize_, use_cpu_kernels_
    model = load_checkpoint(checkpoint)[0].eval()
    if weights in ("int8", "int4"):
        quantize_(model, weights, INT4_GROUP)
    elif weights == "bfloat16":
        model = model.to(torch.bfloat16)
    use_cpu_kernels_(model)
    ids = torch.tensor([_prompt(vocab, prompt)])
    with torch.inference_mode():
        model(ids, cache=model.make_cache(1, max_tokens=prompt + 1), logits_to_keep=1)   # warm-up
        cache = model.make_cache(1, max_tokens=prompt + new + 1)
        t0 = time.perf_counter()
        last = model(ids, cache=cache, logits_to_keep=1).logits[0, -1].float()
        t1 = time.perf_counter()
        tok, out = last.argmax().view(1, 1), []
        t2 = time.perf_counter()
        for _ in range(new):
            out.append(tok)
            tok = model.decode_step(tok, cache).argmax(-1, keepdim=True)
        t3 = time.perf_counter()
    return {"prefill_tokens_per_s": prompt / (t1 - t0), "decode_tokens_per_s": new / (t3 - t2),
            "tokens": [int(t) for t in out], "last_logits": last[:vocab].tolist()}


def llamacpp_suite(s: dict, log=print) -> dict:
    """Settings (registry.py): models, families, prompt, new, rounds, runtimes, dir, llamacpp_src, quick; with
    `families`, the hybrid families of llamacpp_families.py instead of `models`."""
    from ..dtypes import cpu_flags
    from ..runtime import cpu_model
    from ..errors import ConfigError
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise ConfigError('the llamacpp suite needs llama-cpp-python, built for this CPU: '
                          'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install --no-binary llama-cpp-python llama-cpp-python') from None
    llama_cpp_sources(s["llamacpp_src"])
    if s["families"]:
        from .llamacpp_families import families_suite
        return families_suite(s, log)
    threads = torch.get_num_threads()
    sizes = QUICK if s["quick"] else MODELS
    runtimes = s["runtimes"].split(",")
    out = {"settings": s, "threads": threads, "cpu": cpu_model(),
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
    return out



if __name__ == "__main__":
    from .registry import main
    sys.exit(main("llamacpp"))
