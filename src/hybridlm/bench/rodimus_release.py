"""A released-size Rodimus+ checkpoint on this CPU (issue 17): write a random-weight directory in the codefuse-ai
format at the largest Rodimus+ size of the paper's tables (Rodimus++-1.6B: d 2048, 24 blocks, their 126,340-token
vocabulary, bfloat16 shards), convert it (time, peak RSS), then decode it and a Transformer++ of about the same
parameter count at two context lengths (tokens/s, inference-cache bytes, peak RSS), with float, int8 and int4 weights
(models/quantize.py, `--weights`), through the project's CPU kernels (ops/cpu_kernels.py). Each measurement runs
in a process of its own (measure.fresh), so each peak RSS is its own (measure.peak_memory).

    hybridlm bench --suite release [--dir runs/rodimus-release] [--quick] [--out runs/bench/release.json]
    hybridlm generate --checkpoint runs/rodimus-release/run --chat --prompt hi --max-new-tokens 8 [--dtype float32]
"""
import json
import os
import sys

import torch

from ..runtime import machine_meta
from . import measure as ms

SIZES = {"full": dict(d_model=2048, n_layer=24, vocab_size=126340, window_size=2048),
         "quick": dict(d_model=256, n_layer=2, vocab_size=4096, window_size=64)}


def release_config(d_model: int, n_layer: int, vocab_size: int, window_size: int) -> dict:
    """config.json of a Rodimus+ release (their defaults: n = 64, expand 2, heads of 128 with one key head)."""
    return dict(model_type="rodimus", architectures=["RodimusForCausalLM"], block_type="rodimus_plus", d_model=d_model,
                n_layer=n_layer, vocab_size=vocab_size, norm_epsilon=1e-5, tie_word_embeddings=False,
                max_position_embeddings=8192, use_scale_embedding=False, use_norm_embedding=False,
                mixer_cfg=dict(mem_size=64, expand_ratio=2, d_conv=4, input_gate_low_rank="auto"),
                attn_cfg=dict(num_heads=max(1, d_model // 128), num_heads_k=1, num_heads_v=max(1, d_model // 128),
                              window_size=window_size, rotary_emb_dim=-1, rotary_emb_base=10000.0),
                torch_dtype="bfloat16")


def write_release(directory: str, size: dict, shards: int = 4) -> str:
    """Random bf16 weights (N(0, 0.02), norms 1) under their names, in `shards` files with an index."""
    from safetensors.torch import save_file
    from ..hf.rodimus_format import release_shapes
    os.makedirs(directory, exist_ok=True)
    hf = release_config(**size)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf, f)
    names, wmap, g = list(release_shapes(hf).items()), {}, torch.Generator().manual_seed(0)
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: (torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=g) * 0.02).bfloat16()
                for k, shape in names[s::shards]}
        save_file(part, os.path.join(directory, fname))
        wmap.update(dict.fromkeys(part, fname))
        del part
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wmap}, f)
    _write_tokenizer(directory)
    return directory


def _write_tokenizer(directory: str):
    """A small BPE in transformers' layout (tokenizer.json + tokenizer_config.json with eos and a chat template), so
    `hybridlm generate --chat` runs on the converted model."""
    from ..data.tokenizer import BPETokenizer
    with open(__file__) as f:
        tok = BPETokenizer.train([f.read()], 1024)
    tok.tok.save(os.path.join(directory, "tokenizer.json"))
    template = "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}{% endfor %}" \
               "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": tok.eos_token, "chat_template": template}, f)


def _measured(fn) -> dict:
    """fn() -> dict, with the process's peak RSS and the peak of its anonymous memory (measure.peak_memory)."""
    out = {}
    mem = ms.peak_memory(lambda: out.update(fn()), what="resident+anon")
    return dict(out, peak_rss_mib=mem["process_peak_bytes"] / 2 ** 20, peak_anon_mib=mem["anon_peak_bytes"] / 2 ** 20)


def convert_job(src: str, out: str) -> dict:
    from ..hf.rodimus_format import convert_rodimus_dir
    return _measured(lambda: {"seconds": ms.clock({"c": lambda: convert_rodimus_dir(src, out)}, 1, 0)["c"][0]})


def _transformer_like(params: int, size: dict, dtype: torch.dtype):
    """Transformer++ (heads of 128, SwiGLU 8/3·d) with the depth that comes closest to `params`, random."""
    from ..models import presets
    from ..models import CausalLM
    d, V = size["d_model"], size["vocab_size"]
    with torch.device("meta"):  # sizes only: no memory until to_empty
        per = CausalLM(presets.get("transformer++", n_layers=2, d_model=d, vocab_size=V, n_heads=d // 128))
        one = (per.num_parameters() - CausalLM(presets.get("transformer++", n_layers=1, d_model=d, vocab_size=V,
                                                           n_heads=d // 128)).num_parameters())
        n = max(1, round((params - (per.num_parameters() - 2 * one)) / one))
        model = CausalLM(presets.get("transformer++", n_layers=n, d_model=d, vocab_size=V, n_heads=d // 128,
                                     max_seq_len=8192))
    model = model.to(dtype).to_empty(device="cpu")   # the dtype set while still on meta: no second copy
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.ones_like(p) if p.dim() == 1 else torch.randn(p.shape, generator=g) * 0.02)
    return model.eval()


def decode_job(which: str, ckpt: str, context: int, steps: int, size: dict, weights: str = "float",
               dtype: str = "bfloat16") -> dict:
    """Prefill `context` random tokens (chunks of 512), then time `steps` greedy one-token decode steps."""
    return _measured(lambda: _decode(which, ckpt, context, steps, size, weights, dtype))


def _decode(which: str, ckpt: str, context: int, steps: int, size: dict, weights: str, dtype: str) -> dict:
    from ..models import CausalLM
    from ..checkpoint import load_checkpoint, load_config
    from ..models.quantize import quantize_, use_cpu_kernels_
    if which == "transformer++":
        with torch.device("meta"):
            params = CausalLM(load_config(ckpt)).num_parameters()
        model = _transformer_like(params, size, getattr(torch, dtype))
    else:
        model = load_checkpoint(ckpt)[0].to(getattr(torch, dtype)).eval()
    params = model.num_parameters()               # before quantization (buffers are no parameters)
    if weights != "float":
        quantize_(model, weights, 64)
    use_cpu_kernels_(model)
    model.config.max_seq_len = max(model.config.max_seq_len, context + steps + 1)
    built = {}
    prefill = ms.clock({"prefill": lambda: built.update(d=ms.prefilled(
        model, context, chunk=512, max_tokens=context + steps + 1, step_fn=model.decode_step))}, 1, 0)["prefill"][0]
    step, cache = built["d"]
    dt = sum(ms.clock({"decode": step}, steps, warmup=1)["decode"])
    return {"model": which, "weights": weights, "dtype": dtype, "layout": model.config.layout,
            "parameters": params, "context": context,
            "prefill_s": prefill, "decode_tokens_per_s": steps / dt, "cache_mib": cache.nbytes / 2 ** 20}


def release_suite(s: dict, log=print) -> dict:
    """The bench suite: settings dir, contexts, steps, skip_write, weights ("float,int8,int4"), dtype, quick."""
    from ..dtypes import resolve_dtype
    from ..errors import ConfigError
    weights = [w.strip() for w in s["weights"].split(",") if w.strip()]
    bad = [w for w in weights if w not in ("float", "int8", "int4")]
    if bad or s["dtype"] not in ("auto", "bfloat16", "float32"):
        raise ConfigError(f"--weights takes float,int8,int4 and --dtype auto, bfloat16 or float32 "
                          f"(got {s['weights']!r}, {s['dtype']!r})")
    dtype, why = resolve_dtype(s["dtype"], "cpu")
    log(f"dtype {why}; CPU {machine_meta()['cpu_model']}")
    size = SIZES["quick" if s["quick"] else "full"]
    src, run = os.path.join(s["dir"], "release"), os.path.join(s["dir"], "run")
    if not s["skip_write"]:
        t = ms.clock({"write": lambda: write_release(src, size)}, 1, 0)["write"][0]
        log(f"wrote {src} in {t:.0f} s")
    conv = ms.fresh(convert_job, src=src, out=run)
    log(f"convert: {conv['seconds']:.1f} s, peak RSS {conv['peak_rss_mib']:.0f} MiB (of which anonymous "
        f"{conv.get('peak_anon_mib', 0):.0f} MiB; the rest are mapped source pages)")
    rows = []
    for ctx in s["contexts"]:
        for which, w in [(m, q) for m in ("rodimus+", "transformer++") for q in weights]:
            rows.append(ms.fresh(decode_job, which=which, ckpt=os.path.join(run, "checkpoint"), context=ctx,
                                 steps=s["steps"], size=size, weights=w, dtype=dtype))
            r = rows[-1]
            log(f"{r['model']:<14} {w:<5} {r['layout']:<10} {r['parameters'] / 1e9:.2f}B  context {ctx:>5}: "
                f"{r['decode_tokens_per_s']:6.2f} tok/s, cache {r['cache_mib']:7.1f} MiB, peak RSS "
                f"{r['peak_rss_mib']:6.0f} MiB, anonymous {r.get('peak_anon_mib', 0):6.0f} MiB (prefill "
                f"{r['prefill_s']:.0f} s)")
    return {"convert": conv, "decode": rows}


def main(argv: list[str] | None = None) -> int:
    """`python -m hybridlm.bench.rodimus_release`: `hybridlm bench --suite release` under its old name."""
    from .registry import main as suite_main
    return suite_main("release", argv)


if __name__ == "__main__":
    sys.exit(main())
