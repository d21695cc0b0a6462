"""Decode speed of routed experts, batched (every expert's weights, one matmul) against selected (only the chosen
experts, through the CPU kernels), interleaved in one process on one random Qwen3-Next-shaped model, so the ratio
holds on a noisy machine. Prints the CPU, tok/s best of the rounds per form and dtype, the ratio, and whether the
greedy tokens agree.

    python scripts/moe_decode_ratio.py [--d-model 1024] [--layers 8] [--experts 32] [--topk 4] [--hidden 512]
                                       [--dtypes bfloat16,float32,int8,int4] [--rounds 3] [--new 16] [--threads 2]
int8 / int4 quantize the linears and, in the selected form, the experts per expert (the batched form has only float
experts: what quantize_ left before experts were quantized).
"""
import argparse
import copy
import platform
import time

import torch

from hybridlm import presets
from hybridlm.dtypes import cpu_flags
from hybridlm.layers.routed_moe import RoutedMoE
from hybridlm.models.causal_lm import CausalLM
from hybridlm.models.quantize import eligible, quantize_, use_cpu_kernels_


def _cpu() -> str:
    name = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {torch.get_num_threads()} threads, avx512_bf16 {'yes' if 'avx512_bf16' in cpu_flags() else 'no'}"


@torch.inference_mode()
def _decode(m, ids, new: int) -> tuple[float, list[int]]:
    """Greedy: prefill ids, then `new` one-token steps; returns (decode tok/s, tokens)."""
    cache = m.make_cache(1, max_tokens=ids.shape[1] + new + 1)
    nxt = m(ids, cache=cache, logits_to_keep=1).logits[:, -1].argmax(-1)
    out = [int(nxt)]
    t = time.perf_counter()
    for _ in range(new):
        nxt = m.decode_step(nxt[:, None], cache).argmax(-1)
        out.append(int(nxt))
    return new / (time.perf_counter() - t), out


@torch.inference_mode()
def _step_gap(models: dict, ids) -> float:
    """Largest difference between the two forms' logits at the first decode step (the same prefill and token)."""
    out = {}
    for form, m in models.items():
        _batched(m, form == "batched")
        cache = m.make_cache(1, max_tokens=ids.shape[1] + 2)
        nxt = m(ids, cache=cache, logits_to_keep=1).logits[:, -1].argmax(-1)
        out[form] = m.decode_step(nxt[:, None], cache).float()
    _batched(models["batched"], False)
    _step_gap.scale = out["batched"].abs().max().item()
    return (out["batched"] - out["selected"]).abs().max().item()


def _batched(m, on: bool):
    """The form before: every RoutedMoE runs the batched matmul on its weights as trained (or, on=False, back to the
    selected experts on the kernels' layout)."""
    for x in m.modules():
        if isinstance(x, RoutedMoE):
            x._selected = (lambda _x: False) if on else RoutedMoE._selected.__get__(x)
            x.kernel_layout_(not on)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = presets.get("qwen3-next", n_layers=a.layers, d_model=a.d_model, moe_experts=a.experts, moe_topk=a.topk,
                      moe_hidden=a.hidden, moe_shared_hidden=a.hidden, vocab_size=a.vocab)
    base = CausalLM(cfg).eval()
    print(f"CPU: {_cpu()}")
    print(f"model: qwen3-next layout {cfg.layout}, d {a.d_model}, {a.experts} experts top {a.topk} of hidden "
          f"{a.hidden}, vocab {a.vocab}: {base.num_parameters() / 1e6:.0f}M parameters; prompt {a.prompt}, "
          f"{a.new} greedy tokens, best of {a.rounds} rounds, forms interleaved")
    ids = torch.randint(0, a.vocab, (1, a.prompt))
    for dt in a.dtypes.split(","):
        if dt in ("int8", "int4"):
            after = quantize_(copy.deepcopy(base), dt, 32)
            before = copy.deepcopy(base)              # experts stay float (bf16 where the CPU has bf16 units)
            names = [n for n in eligible(before) if not n.endswith(RoutedMoE.EXPERT_WEIGHTS)]
            quantize_(before, dt, 32, names)
            fdt = torch.bfloat16 if "avx512_bf16" in cpu_flags() else torch.float32
            models = {"batched": use_cpu_kernels_(before.to(fdt)), "selected": use_cpu_kernels_(after.to(fdt))}
        else:
            m = use_cpu_kernels_(copy.deepcopy(base).to(getattr(torch, dt)))
            models = {"batched": m, "selected": m}
        best, toks = {}, {}
        for _ in range(a.rounds):
            for form in ("batched", "selected"):
                m = models[form]
                _batched(m, form == "batched")
                _decode(m, ids, 2)                    # warm: layout copied, kernels loaded
                rate, toks[form] = _decode(m, ids, a.new)
                best[form] = max(best.get(form, 0.0), rate)
            _batched(models["batched"], False)
        agree = next((i for i, (u, v) in enumerate(zip(toks["batched"], toks["selected"])) if u != v),
                     len(toks["batched"]))
        print(f"{dt:9s} batched {best['batched']:6.2f} tok/s   selected {best['selected']:6.2f} tok/s   "
              f"ratio {best['selected'] / best['batched']:.2f}x   greedy tokens agree: {agree} of "
              f"{len(toks['batched'])}   first step's logits differ by {_step_gap(models, ids):.2g} (max |logit| "
              f"{_step_gap.scale:.2g})")
        del models


if __name__ == "__main__":
    main()
