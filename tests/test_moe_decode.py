"""Routed experts at decode and the CPU kernels by default: the selected-experts path (ops.moe.routed_experts_selected)
equals the batched one and the reference; a decode step takes it and reads only the chosen experts; decode = forward
for every MoE preset with the kernels on; int8 / int4 experts (QuantizedExperts) near their float version and through
a checkpoint; `generate` turns the kernels on by itself with the same tokens, leaves training's gradients bit for bit,
and HYBRIDLM_CPU_KERNELS=0 keeps them off."""
import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from conftest import assert_close, decode_logits
from hybridlm import presets
from hybridlm.checkpoint import load_checkpoint, save_checkpoint
from hybridlm.layers.quantized import KernelLinear, QuantizedExperts
from hybridlm.layers.routed_moe import RoutedMoE
from hybridlm.models.quantize import cpu_kernels_by_default_, eligible, quantization_of, quantize_, use_cpu_kernels_
from hybridlm.ops import moe
from hybridlm.ops.moe import float_experts, routed_experts, routed_experts_ref, routed_experts_selected
from test_models import tiny

MOE_PRESETS = [n for n in presets.names() if "O" in presets.get(n).layout]


def _experts(E=8, d=24, f=40, gated=True, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = [torch.randn(E, d, f, generator=g) / d**0.5, torch.randn(E, d, f, generator=g) / d**0.5,
         torch.randn(E, f, d, generator=g) / f**0.5]
    return [None if t is None else t.to(dtype) for t in ([w[0]] if gated else [None]) + w[1:]]


def _routes(N, E, k, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    return ids, torch.rand(N, k, generator=g)


def test_moe_presets_are_known():
    assert {"qwen3-next", "kimi-linear", "jamba", "jamba-ssd", "deepseek-mla-moe"} <= set(MOE_PRESETS)


@pytest.mark.parametrize("N", [1, 3, 8, 20])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("layout", ["stored", "kernel"])
def test_selected_equals_batched_and_reference(N, gated, layout):
    torch.manual_seed(0)
    gate, up, down = _experts(gated=gated)
    if layout == "kernel":              # transposed in memory, as use_cpu_kernels_ lays them out: the CPU kernel
        gate, up, down = (None if w is None else w.mT.contiguous().mT for w in (gate, up, down))
    x = torch.randn(N, 24)
    ids, weights = _routes(N, 8, 3)
    with torch.no_grad():
        got = routed_experts_selected(x, ids, weights, float_experts(up), float_experts(down),
                                      None if gate is None else float_experts(gate))
        assert_close(got, routed_experts(x, gate, up, down, ids, weights), rtol=1e-5, atol=1e-5)
        assert_close(got, routed_experts_ref(x, gate, up, down, ids, weights), rtol=1e-5, atol=1e-5)


def test_selected_bfloat16():
    gate, up, down = (w.mT.contiguous().mT for w in _experts(dtype=torch.bfloat16))
    x = torch.randn(1, 24).bfloat16()
    ids, weights = _routes(1, 8, 2)
    with torch.no_grad():
        got = routed_experts_selected(x, ids, weights.bfloat16(), float_experts(up), float_experts(down),
                                      float_experts(gate))
        want = routed_experts_ref(*(t.float() for t in (x, gate, up, down)), ids, weights)
    assert got.dtype == torch.bfloat16
    assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_decode_step_reads_only_the_chosen_experts(monkeypatch):
    """A one-token step without gradient calls k experts' products and never the batched matmul; training does."""
    torch.manual_seed(0)
    layer = RoutedMoE(24, 40, num_experts=8, top_k=2, shared_expert=True)
    layer.init_weights(0.02, 0.02)
    called, batched = [], []
    real = moe.float_experts
    monkeypatch.setattr("hybridlm.layers.routed_moe.float_experts",
                        lambda w: (lambda e, rows: called.append(e) or real(w)(e, rows)))
    real_batched = routed_experts
    monkeypatch.setattr("hybridlm.layers.routed_moe.routed_experts",
                        lambda *a, **k: batched.append(1) or real_batched(*a, **k))
    x = torch.randn(1, 1, 24)
    want = layer(x)                                           # gradient on: the batched form
    assert batched and not called
    with torch.no_grad():
        got = layer(x)
    assert len(set(called)) == 2 and len(called) == 6         # 2 experts x (gate, up, down)
    assert len(batched) == 1
    assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_decode_equals_forward_with_kernels_by_default(name):
    torch.manual_seed(0)
    m = tiny(name)
    ids = torch.randint(0, 97, (2, 19))
    full = m(ids).logits
    cpu_kernels_by_default_(m)
    moes = [x for x in m.modules() if isinstance(x, RoutedMoE)]
    assert moes and all(not x.w_up.is_contiguous() and x.w_up.mT.is_contiguous() for x in moes)
    with torch.no_grad():
        assert_close(decode_logits(m, ids, 7, cache=m.make_cache(2)), full, atol=2e-5, msg=name)
        assert_close(decode_logits(m, ids[:1], 7, cache=m.make_cache(1)), full[:1], atol=2e-5, msg=name)


def _grads(m, ids):
    m.zero_grad()
    out = m(ids, labels=ids)
    out.loss.backward()
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["qwen3-next", "transformer++"])
def test_generate_uses_kernels_same_tokens_and_training_unchanged(name, monkeypatch, tmp_path):
    torch.manual_seed(0)
    m = tiny(name).train()
    ref = copy.deepcopy(m)
    ids = torch.randint(0, 97, (2, 9))
    want_grads = _grads(ref, ids)
    monkeypatch.setattr("hybridlm.models.quantize.cpu_kernels_by_default_", lambda model: model)   # as before
    before = ref.eval().generate(ids, 6, temperature=0)
    monkeypatch.undo()
    assert not any(isinstance(x, KernelLinear) for x in ref.modules())
    out = m.eval().generate(ids, 6, temperature=0)
    assert torch.equal(out, before)
    assert any(isinstance(x, KernelLinear) for x in m.modules())
    got = _grads(m.train(), ids)                 # a training step after generate: the same gradients, bit for bit
    assert got.keys() == want_grads.keys()
    assert all(torch.equal(got[k], want_grads[k]) for k in got), [k for k in got if not torch.equal(got[k],
                                                                                                   want_grads[k])]
    assert all(p.is_contiguous() for p in m.parameters())
    assert m.state_dict().keys() == ref.state_dict().keys()
    m.generate(ids, 1)
    save_file(m.state_dict(), str(tmp_path / "after.safetensors"))   # after decoding: contiguous, as it was
    use_cpu_kernels_(m, False)                    # and reversible
    assert not any(isinstance(x, KernelLinear) for x in m.modules())


def test_kernels_off_by_environment():
    code = ("import torch\nfrom hybridlm import presets, CausalLM\nfrom hybridlm.layers.quantized import KernelLinear\n"
            "m = CausalLM(presets.get('qwen3-next', n_layers=4, d_model=32, n_heads=2, vocab_size=64, moe_experts=4,"
            " moe_hidden=16)).eval()\nm.generate(torch.tensor([[1, 2]]), 2)\n"
            "print(any(isinstance(x, KernelLinear) for x in m.modules()), "
            "all(p.is_contiguous() for p in m.parameters()))")
    env = dict(os.environ, HYBRIDLM_CPU_KERNELS="0", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, env=env,
                         check=True).stdout
    assert out.split() == ["False", "True"]


@pytest.mark.parametrize("scheme,g,tol", [("int8", None, 0.05), ("int4", 32, 0.3)])
def test_quantized_experts_close_to_float(scheme, g, tol):
    torch.manual_seed(0)
    gate, up, down = _experts(d=64, f=40)
    qs = [QuantizedExperts.from_weight(w, scheme, g) for w in (gate, up, down)]
    assert qs[1].weight_q.shape[:2] == (8, 40) and qs[2].weight_q.shape[:2] == (8, 64)
    for w, q in zip((gate, up, down), qs):       # dequantized within the scheme's rounding, expert by expert
        assert (q.dequantized() - w).abs().max() < (0.01 if scheme == "int8" else 0.15) * w.abs().max()
    ids, weights = _routes(5, 8, 2)
    for N in (1, 5):                              # decode rows: the CPU kernels; 5 rows too (<= MAX_ROWS)
        x = torch.randn(N, 64)
        want = routed_experts_ref(x, gate, up, down, ids[:N], weights[:N])
        got = routed_experts_selected(x, ids[:N], weights[:N], qs[1].expert, qs[2].expert, qs[0].expert)
        deq = routed_experts_ref(x, *(q.dequantized() for q in qs), ids[:N], weights[:N])
        assert_close(got, deq, rtol=2e-2, atol=2e-2 * deq.abs().max().item())   # = its dequantized weights
        assert (got - want).abs().max() < tol * want.abs().max()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantize_swaps_experts_decode_equals_forward_and_round_trip(scheme, tmp_path):
    torch.manual_seed(0)
    m = tiny("qwen3-next")
    names = eligible(m)
    assert "blocks.1.mixer.w_up" in names and "blocks.1.mixer.w_down" in names
    ids = torch.randint(0, 97, (2, 19))
    ref = m(ids).logits
    quantize_(m, scheme, 32)
    layer = m.blocks[1].mixer
    assert isinstance(layer.w_up, QuantizedExperts) and "w_up" not in dict(layer.named_parameters())
    assert "blocks.1.mixer.w_gate" in quantization_of(m)["modules"]
    with torch.no_grad():
        full = m(ids).logits
        # int4: x rounded to int8 per block in the CPU kernel (Q8_0), so last-bit differences flip a rounding here
        # and there (tests/test_cpu_kernels.py, test_decode_equals_forward_with_kernels)
        atol = 1e-4 if scheme == "int8" else 0.05 * full.abs().max()
        assert_close(decode_logits(m, ids, 7, cache=m.make_cache(2)), full, atol=atol, msg=scheme)
    assert 0 < (full - ref).abs().max() < (0.05 if scheme == "int8" else 0.3) * ref.abs().max()
    loaded, _ = load_checkpoint(save_checkpoint(str(tmp_path), m))
    assert torch.equal(loaded.blocks[1].mixer.w_up.weight_q, layer.w_up.weight_q)
    with torch.no_grad():
        assert_close(loaded.eval()(ids).logits, full, rtol=0, atol=1e-5)    # (mmap-aligned loads may sum apart)


def test_quantize_refuses_a_name_that_is_no_expert_weight():
    from hybridlm.errors import InputError
    m = tiny("qwen3-next")
    with pytest.raises(InputError, match="not a linear layer"):
        quantize_(m, "int8", modules=["blocks.1.mixer.router_bias"])


def test_kernel_layout_keeps_values_and_state_dict():
    torch.manual_seed(0)
    m = tiny("kimi-linear")
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    use_cpu_kernels_(m)
    after = m.state_dict()
    assert after.keys() == sd.keys() and all(torch.equal(after[k], sd[k]) for k in sd)
    ids = torch.randint(0, 97, (1, 5))
    loss = F.cross_entropy(m(ids).logits.flatten(0, 1), ids.flatten())    # training restores the layout
    loss.backward()
    assert all(p.is_contiguous() for p in m.parameters())
    assert all(type(x) is not nn.Linear for x in m.modules())


def test_transformers_generate_uses_kernels(monkeypatch):
    pytest.importorskip("transformers")
    from hybridlm.hf.modeling import HybridLMForCausalLM
    torch.manual_seed(0)
    m = tiny("qwen3-next")
    ids = torch.randint(0, 97, (1, 6))
    monkeypatch.setattr("hybridlm.models.quantize.cpu_kernels_by_default_", lambda model: model)   # as before
    before = copy.deepcopy(m).generate(ids, 5, temperature=0)
    monkeypatch.undo()
    w = HybridLMForCausalLM.from_model(m)
    out = w.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, eos_token_id=None,
                     pad_token_id=0)
    assert any(isinstance(x, KernelLinear) for x in m.modules())
    assert torch.equal(out, before)
