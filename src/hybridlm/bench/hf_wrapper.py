"""What transformers' `generate()` costs through our wrapper: greedy decode tokens/s of `HybridLMForCausalLM.generate`
against our own `stream` on the same CausalLM (same parameters), at the foundation benchmark config (compare_hf.FULL:
d_model 256, 4 layers, vocab 8192, context 1024, 64 new tokens), interleaved in rotating order, medians.

`hybridlm bench --suite hf [--quick]`, or `python -m hybridlm.bench.hf_wrapper [--quick]`.
"""
import torch

from ..models import CausalLM, presets
from .compare_hf import ARCHS, FULL, QUICK, decode_rows


def run_suite(quick: bool = False, log=print) -> dict:
    from ..hf.modeling import HybridLMForCausalLM
    s = QUICK if quick else FULL
    rows = []
    for arch, preset in ARCHS.items():                   # llama: transformer++, mamba2: mamba2
        torch.manual_seed(0)
        over = (s.get("overrides") or {}).get(arch, {})
        cfg = presets.get(preset, n_layers=s["n_layers"], d_model=s["d_model"], vocab_size=s["vocab_size"],
                          max_seq_len=s["context"] + s["new_tokens"] + 1, **over)
        ours = CausalLM(cfg).eval()
        wrapper = HybridLMForCausalLM.from_model(ours).eval()
        for row in decode_rows(arch, wrapper, ours, s["context"], s["new_tokens"], s["decode_repeats"], compile=False,
                               log=log):
            rows.append({("wrapper" + k[2:] if k.startswith("hf_") else k): v for k, v in row.items()})
    log("ratio = ours tokens/s / wrapper tokens/s (1.0: the wrapper costs nothing)")
    return {"settings": {k: v for k, v in s.items() if k != "overrides"}, "decode": rows}


if __name__ == "__main__":
    import sys
    torch.set_num_threads(2)
    run_suite(quick="--quick" in sys.argv)
