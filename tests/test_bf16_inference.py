"""Inference with bf16 weights reads each weight matrix as it is stored: no Linear or Embedding weight is copied to
another dtype in prefill or in a decode step, for one preset of every family. (Only O(d) vectors, norm weights and
per-head decay parameters, and Mamba-1's [d_inner, d_state] A_log are widened to float32, for float32 math.)"""
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hybridlm import CausalLM, presets

FAMILIES = ["transformer++", "gpt", "mamba2-attention", "mamba", "jamba", "rodimus++", "qwen3-next", "kimi-linear",
            "deepseek-mla-moe", "doge", "cheems", "zamba2", "falcon-h1", "lfm2"]


class _Copies(TorchDispatchMode):
    """Records the storages that a dtype-changing copy reads."""

    def __init__(self):
        super().__init__()
        self.read = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype):
            dst = kwargs.get("dtype", args[1] if func is torch.ops.aten.to.dtype else None)
            if dst is not None and dst != args[0].dtype:
                self.read.add(args[0].untyped_storage().data_ptr())
        elif func is torch.ops.aten.copy_.default and args[0].dtype != args[1].dtype:
            self.read.add(args[1].untyped_storage().data_ptr())
        return func(*args, **kwargs)


@pytest.mark.parametrize("preset", FAMILIES)
def test_bf16_prefill_and_decode_read_weights_as_stored(preset):
    torch.manual_seed(0)
    model = CausalLM(presets.get(preset, n_layers=1, d_model=64, vocab_size=300, max_seq_len=64))
    model = model.to(torch.bfloat16).eval()
    matrices = {m.weight.untyped_storage().data_ptr(): name for name, m in model.named_modules()
                if isinstance(m, (nn.Linear, nn.Embedding))}
    assert matrices
    ids = torch.randint(0, 300, (1, 20))
    with torch.inference_mode():
        cache = model.make_cache(1, max_tokens=24)
        with _Copies() as prefill:
            logits = model(ids, cache=cache, logits_to_keep=1).logits
        with _Copies() as decode:
            step = model.decode_step(ids[:, :1], cache)
    assert logits.dtype == step.dtype == torch.bfloat16
    for phase, spy in (("prefill", prefill), ("decode", decode)):
        copied = sorted(matrices[p] for p in spy.read if p in matrices)
        assert not copied, f"{preset} {phase} copies weight matrices to another dtype: {copied}"


@pytest.mark.parametrize("preset", ["mamba2", "mamba", "rodimus++", "qwen3-next", "kimi-linear", "zamba2", "lfm2"])
def test_bf16_decode_equals_forward_and_tracks_float32(preset):
    """bf16 weights: prompt prefill + one-token decode steps give the full forward's logits (the step keeps a
    float32 state, prefill uses bf16 matmuls: agreement to bf16 rounding; ≤ 2.3e-3 seen), and the bf16 model's
    logits stay near the float32 model's (≤ 7.6e-3 seen)."""
    torch.manual_seed(0)
    model = CausalLM(presets.get(preset, n_layers=1, d_model=64, vocab_size=300, max_seq_len=128)).eval()
    ids = torch.randint(0, 300, (1, 80))
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()   # noqa: E731
    with torch.inference_mode():
        ref = model(ids).logits
        model = model.to(torch.bfloat16)
        full = model(ids).logits
        cache = model.make_cache(1, max_tokens=80)
        parts = [model(ids[:, :70], cache=cache).logits]
        parts += [model.decode_step(ids[:, t:t + 1], cache).view(1, 1, -1) for t in range(70, 80)]   # [B, V] each
    assert rel(torch.cat(parts, 1), full) < 1e-2
    assert rel(full, ref) < 3e-2
