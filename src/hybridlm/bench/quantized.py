"""`hybridlm bench --suite quantize`: float vs int8 vs int4 weights (models/quantize.py) of one model, interleaved in
one run: prefill tokens/s and greedy decode tokens/s at batch 1, plus a profile of one decode step per scheme
(bench/decode_profile.py: each part's ms, native and other, and bytes), which says where a step's time goes.
Default: a Llama in TinyLlama's shape (d 2048, 22 layers, 32 heads / 4 KV heads, SwiGLU 5632, vocab 32000: 1.1B)
and a Rodimus+ of the same width; the dtype of `--dtype auto` (float32 where the CPU has no bf16 units). The three
models share every float tensor the quantized ones keep.

    hybridlm bench --suite quantize [--quick] --out runs/bench/quantize.json
    hybridlm bench --suite quantize --presets llama --n-layers 4 --context 128 --steps 32
"""
import torch

from . import measure as ms
from .decode_profile import profile

SCHEMES = ("float", "int8", "int4")


def variants(model, group_size: int) -> dict:
    """{"float": model, "int8": ..., "int4": ...}: the quantized ones are new CausalLMs holding the float model's
    tensors (no copy) with their linears swapped."""
    from ..models import CausalLM
    from ..models.quantize import quantize_, use_cpu_kernels_
    out = {"float": use_cpu_kernels_(model)}
    for scheme in SCHEMES[1:]:
        with torch.device("meta"):
            m = CausalLM(model.config)
        m.load_state_dict(model.state_dict(), assign=True)
        m.tie_weights()
        out[scheme] = use_cpu_kernels_(quantize_(m.eval(), scheme, group_size))
    return out


def quantize_suite(s: dict, log=print) -> dict:
    """Settings (registry.py): presets, d_model, n_layers, n_heads, n_kv_heads, mlp_hidden, vocab_size, context,
    steps, repeats, group_size."""
    from ..dtypes import resolve_dtype
    from ..models import CausalLM, presets
    from ..dtypes import cpu_flags
    from ..runtime import cpu_model
    dtype_name, label = resolve_dtype("auto", "cpu")
    dtype = getattr(torch, dtype_name)
    out = {"settings": s, "dtype": label, "threads": torch.get_num_threads(), "cpu": cpu_model(),
           "cpu_bf16": sorted({"amx_bf16", "avx512_bf16"} & cpu_flags()),
           "rows": [], "profiles": {}}
    for name in s["presets"].split(","):
        over = dict(n_layers=s["n_layers"], d_model=s["d_model"], vocab_size=s["vocab_size"],
                    n_heads=s["n_heads"], mlp_hidden=s["mlp_hidden"], max_seq_len=max(2048, s["context"] + 256))
        if name in ("llama", "transformer++"):
            over["n_kv_heads"] = s["n_kv_heads"]
        torch.manual_seed(0)
        with torch.device("meta"):
            cfg = presets.get(name, **over)
        model = CausalLM(cfg).to(dtype).eval()
        models = variants(model, s["group_size"])
        n = s["steps"]
        ids = torch.randint(0, s["vocab_size"], (1, s["context"]), generator=torch.Generator().manual_seed(0))

        def prefill(m):
            def run():
                with torch.inference_mode():
                    m(ids, cache=m.make_cache(1, max_tokens=s["context"] + 1), logits_to_keep=1)
            return run

        def decode(m):
            def setup():
                return ms.prefilled(m, s["context"], max_tokens=s["context"] + n + 1, step_fn=m.decode_step)[0]
            return setup, lambda step: [step() for _ in range(n)]
        pre = ms.clock({k: prefill(m) for k, m in models.items()}, s["repeats"], warmup=1)
        dec = ms.clock({k: decode(m) for k, m in models.items()}, s["repeats"], warmup=1)
        base = None
        for k in SCHEMES:
            row = {"model": name, "weights": k, "parameters": model.num_parameters(), "context": s["context"],
                   "prefill_tokens_per_s": s["context"] / ms.median(pre[k]),
                   "decode_tokens_per_s": n / ms.median(dec[k]), "decode_times_s": dec[k]}
            base = base or row
            row["decode_vs_float"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
            row["prefill_vs_float"] = row["prefill_tokens_per_s"] / base["prefill_tokens_per_s"]
            out["rows"].append(row)
            log(f"{name:>10} {k:>5}: prefill {row['prefill_tokens_per_s']:8.1f} tok/s ({row['prefill_vs_float']:.2f}x)"
                f", decode {row['decode_tokens_per_s']:7.2f} tok/s ({row['decode_vs_float']:.2f}x float)")
        for k, m in models.items():
            prof = out["profiles"][f"{name} {k}"] = profile(m, s["context"], 3)
            top = sorted(prof["parts"].items(), key=lambda kv: -kv[1]["ms"])[:5]
            log(f"  one {k} decode step: " + ", ".join(f"{p} {v['ms'] / prof['instrumented_ms']:.0%}" for p, v in top))
        del models, model
    return out
