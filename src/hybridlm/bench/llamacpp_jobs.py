"""What the two llama.cpp suites share (bench/llamacpp.py: a Llama and a Mamba-2; bench/llamacpp_families.py: the
hybrid families): llama.cpp's converter and quantizer on a transformers directory, the two timed runs (llama.cpp
through llama-cpp-python, hybridlm through its decode step), each in a fresh process, and the host they ran on
(CPU model, flags, the kernel path hybridlm took), which both suites write into their JSON and markdown.
"""
import os
import subprocess
import sys
import time

import torch

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
    from .registry import cpu_kernel_path
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
            "tokens": [int(t) for t in out], "last_logits": last[:vocab].tolist(), "kernels": cpu_kernel_path()}
