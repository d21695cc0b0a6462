"""A released-size Rodimus+ checkpoint on this CPU (issue 17): write a random-weight directory in the codefuse-ai
format at the largest Rodimus+ size of the paper's tables (Rodimus++-1.6B: d 2048, 24 blocks, their 126,340-token
vocabulary, bfloat16 shards), convert it (time, peak RSS), then decode it and a Transformer++ of about the same
parameter count at two context lengths (tokens/s, inference-cache bytes, peak RSS). Each measurement runs in a
process of its own, so each peak RSS is its own.

    python -m hybridlm.bench.rodimus_release --dir /tmp/rodimus-release [--quick]
    hybridlm generate --checkpoint /tmp/rodimus-release/run --chat --prompt hi --max-new-tokens 8 [--dtype float32]
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time

import torch

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


def _peak_rss_mib() -> float:
    """Peak resident set: anonymous memory plus the touched pages of memory-mapped files (clean, reclaimable)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _AnonPeak(threading.Thread):
    """Samples /proc/self/status RssAnon (memory the process owns, without file-backed mmap pages) every 20 ms."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak_kib = 0

    def run(self):
        while True:
            with open("/proc/self/status") as f:
                kib = next((int(line.split()[1]) for line in f if line.startswith("RssAnon:")), 0)
            self.peak_kib = max(self.peak_kib, kib)
            time.sleep(0.02)


def _convert(src: str, out: str) -> dict:
    from ..hf.rodimus_format import convert_rodimus_dir
    t0 = time.perf_counter()
    convert_rodimus_dir(src, out)
    return {"seconds": time.perf_counter() - t0, "peak_rss_mib": _peak_rss_mib()}


def _transformer_like(params: int, size: dict):
    """Transformer++ (heads of 128, SwiGLU 8/3·d) with the depth that comes closest to `params`, bf16, random."""
    from .. import presets
    from ..models import CausalLM
    d, V = size["d_model"], size["vocab_size"]
    with torch.device("meta"):  # sizes only: no memory until to_empty
        per = CausalLM(presets.get("transformer++", n_layers=2, d_model=d, vocab_size=V, n_heads=d // 128))
        one = (per.num_parameters() - CausalLM(presets.get("transformer++", n_layers=1, d_model=d, vocab_size=V,
                                                           n_heads=d // 128)).num_parameters())
        n = max(1, round((params - (per.num_parameters() - 2 * one)) / one))
        model = CausalLM(presets.get("transformer++", n_layers=n, d_model=d, vocab_size=V, n_heads=d // 128,
                                     max_seq_len=8192))
    model = model.to(torch.bfloat16).to_empty(device="cpu")   # bf16 while still on meta: no float32 copy
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.ones_like(p) if p.dim() == 1 else torch.randn(p.shape, generator=g) * 0.02)
    return model.eval()


def _decode(which: str, ckpt: str, context: int, steps: int, size: dict) -> dict:
    """Prefill `context` random tokens (chunks of 512), then time `steps` greedy one-token decode steps."""
    from ..models import CausalLM
    from ..checkpoint import load_checkpoint, load_config
    if which == "transformer++":
        with torch.device("meta"):
            params = CausalLM(load_config(ckpt)).num_parameters()
        model = _transformer_like(params, size)
    else:
        model = load_checkpoint(ckpt)[0].eval()
    model.config.max_seq_len = max(model.config.max_seq_len, context + steps)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=g)
    cache = model.make_cache(1, max_tokens=context + steps)
    with torch.inference_mode():
        t0 = time.perf_counter()
        for i in range(0, context, 512):
            logits = model(ids[:, i:i + 512], cache=cache, logits_to_keep=1).logits[:, -1]
        prefill = time.perf_counter() - t0
        nxt = logits.argmax(-1, keepdim=True)
        model._decode_step(nxt, cache)                      # warm-up step
        t0 = time.perf_counter()
        for _ in range(steps):
            nxt = model._decode_step(nxt, cache).argmax(-1, keepdim=True)
        dt = time.perf_counter() - t0
    return {"model": which, "layout": model.config.layout, "parameters": model.num_parameters(), "context": context,
            "prefill_s": prefill, "decode_tokens_per_s": steps / dt, "cache_mib": cache.nbytes / 2 ** 20,
            "peak_rss_mib": _peak_rss_mib()}


def _child(args: list[str]) -> dict:
    """Run one measurement in a fresh interpreter; it prints one JSON line."""
    res = subprocess.run([sys.executable, "-m", "hybridlm.bench.rodimus_release", "--child", *args],
                         capture_output=True, text=True, check=False)
    if res.returncode:
        raise RuntimeError(res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "child failed")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp/rodimus-release", help="scratch directory (several GB for the full size)")
    p.add_argument("--quick", action="store_true", help="a small model (checks the pipeline in seconds)")
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 4096])
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per measurement")
    p.add_argument("--skip-write", action="store_true", help="reuse the release directory already in --dir")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    size = SIZES["quick" if a.quick else "full"]
    if a.child:
        kind, *rest = a.child
        anon = _AnonPeak()
        anon.start()
        out = _convert(*rest) if kind == "convert" else _decode(kind, rest[0], int(rest[1]), a.steps, size)
        print(json.dumps(dict(out, peak_anon_mib=anon.peak_kib / 1024)))
        return 0
    src, run = os.path.join(a.dir, "release"), os.path.join(a.dir, "run")
    if not a.skip_write:
        t0 = time.perf_counter()
        write_release(src, size)
        print(f"wrote {src} in {time.perf_counter() - t0:.0f} s", flush=True)
    conv = _child(["convert", src, run] + (["--quick"] if a.quick else []))
    print(f"convert: {conv['seconds']:.1f} s, peak RSS {conv['peak_rss_mib']:.0f} MiB (of which anonymous "
          f"{conv.get('peak_anon_mib', 0):.0f} MiB; the rest are mapped source pages)", flush=True)
    rows = []
    for ctx in a.contexts:
        for which in ("rodimus+", "transformer++"):
            rows.append(_child([which, os.path.join(run, "checkpoint"), str(ctx)] + (["--quick"] if a.quick else [])))
            r = rows[-1]
            print(f"{r['model']:<14} {r['layout']:<10} {r['parameters'] / 1e9:.2f}B  context {ctx:>5}: "
                  f"{r['decode_tokens_per_s']:6.2f} tok/s, cache {r['cache_mib']:7.1f} MiB, peak RSS "
                  f"{r['peak_rss_mib']:6.0f} MiB, anonymous {r.get('peak_anon_mib', 0):6.0f} MiB (prefill "
                  f"{r['prefill_s']:.0f} s)", flush=True)
    print(json.dumps({"convert": conv, "decode": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
