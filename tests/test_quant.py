"""Weight-only quantization: the ops' fast forms against their dequantized reference, the quantized linear against
the float one within each scheme's rounding bound, decode = forward on quantized models, a quantized checkpoint's
round trip (loaded without re-quantizing), and the refusals."""
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import assert_close, decode_logits
from hybridlm.checkpoint import load_checkpoint, save_checkpoint
from hybridlm.errors import CheckpointError, InputError
from hybridlm.layers.quantized import QuantizedLinear
from hybridlm.models.quantize import eligible, quantization_of, quantize_
from hybridlm.ops import quant
from test_models import tiny

SCHEMES = [("int8", None), ("int4", 32), ("int4", 64), ("int4", 128)]


def _rounding_bound(scheme, tensors, K):
    """Per-element bound on |W - dequantize(quantize(W))|: half a step (+ float slack) [N, K]."""
    scale = tensors[1].float()
    step = scale[:, None].expand(-1, K) if scheme == "int8" else scale.repeat_interleave(-(-K // scale.shape[1]), 1)
    step = step[:, :K]
    return step / 2 * (1 + 1e-5) + 1e-7


def int16_bound(x, scheme, t):
    """What rounding x to int16 per row may cost: half a step of x times |W| summed over k (+ float32 slack)."""
    w = quant.dequantize(scheme, t)[:, :x.shape[-1]]
    x2 = x.reshape(-1, x.shape[-1])
    step = x2.abs().amax(1, keepdim=True) / 32767
    return (step / 2 * w.abs().sum(1) + 1e-5 * (x2.abs() @ w.abs().T) + 1e-5).reshape(*x.shape[:-1], -1)


def q8_bound(x, t):
    """What the int4 kernel's roundings may cost against the float32 reference: x to int8 per block of 32 (half a
    step of the block times |W| there) and the scales and mins to float16 (2^-11 of 15 |scale| + |min| per column),
    + float32 slack."""
    q, s, z = t
    N, G = s.shape
    Kp, K = q.shape[1] * 2, x.shape[-1]
    w = quant.dequantize("int4", t)
    x2 = F.pad(x.reshape(-1, K).float(), (0, Kp - K))
    step = x2.reshape(-1, Kp // 32, 32).abs().amax(-1) / 127
    act = step / 2 @ w.abs().reshape(N, Kp // 32, 32).sum(-1).T
    s, z = s.float(), z.float()
    half = 2 ** -11 * x2.abs() @ (15 * s.abs() + (z - 8 * s).abs()).repeat_interleave(Kp // G, 1).T
    return (act + half + 1e-5 * (x2.abs() @ w.abs().T) + 1e-5).reshape(*x.shape[:-1], N)


def kernel_bound(x, scheme, t):
    """How far the CPU kernel's product may be from `quant.linear_reference` (the roundings of x it makes)."""
    return int16_bound(x, scheme, t) if scheme == "int8" else q8_bound(x, t)


@pytest.mark.parametrize("scheme,g", SCHEMES)
def test_dequantize_within_half_a_step(scheme, g):
    w = torch.randn(48, 256) * torch.logspace(-2, 1, 48)[:, None]     # rows of very different ranges
    t = quant.quantize(w, scheme, g)
    assert (quant.dequantize(scheme, t) - w).abs().le(_rounding_bound(scheme, t, 256)).all()
    if scheme == "int8":
        assert t[0].dtype == torch.int8 and t[0].shape == (48, 256) and t[1].shape == (48,)
    else:
        assert t[0].dtype == torch.uint8 and t[0].shape == (48, 128) and t[1].shape == t[2].shape == (48, 256 // g)


@pytest.mark.parametrize("scheme,g", SCHEMES)
@pytest.mark.parametrize("N", [16, 40, 1])            # 40 and 1: int4 pads to the kernel's 16 outputs
def test_fast_equals_reference(scheme, g, N):
    torch.manual_seed(0)
    K = 256
    w, bias, x = torch.randn(N, K), torch.randn(N), torch.randn(2, 3, K)
    lin = nn.Linear(K, N)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(bias)
    q = QuantizedLinear.from_linear(lin, scheme, g)
    ref = quant.linear_reference(x, scheme, q.stored(), q.bias)
    assert ((q(x) - ref).abs() <= kernel_bound(x, scheme, q.stored())).all()    # the CPU kernel
    qb = QuantizedLinear.from_linear(lin, scheme, g).to(torch.bfloat16)
    refb = quant.linear_reference(x.bfloat16(), scheme, qb.stored(), qb.bias).float()
    assert_close(qb(x.bfloat16()).float(), refb, rtol=2e-2, atol=0.5, msg="bfloat16")
    # the quantized layer against the float one: |x| · (half a step) bounds the output error, + the kernel's
    bound = x.abs() @ _rounding_bound(scheme, q.stored(), K).T + kernel_bound(x, scheme, q.stored()) + 1e-4
    assert (q(x) - lin(x)).abs().le(bound).all()


@pytest.mark.parametrize("name,scheme", [("transformer++", "int8"), ("transformer++", "int4"), ("mamba2", "int4"),
                                         ("rodimus++", "int8"), ("rodimus++", "int4"), ("cheems", "int8"),
                                         ("deepseek-mla", "int4")])
def test_decode_equals_forward_quantized(name, scheme):
    torch.manual_seed(0)
    m = tiny(name)
    ids = torch.randint(0, 97, (2, 19))
    ref = m(ids).logits
    quantize_(m, scheme, 32)
    full = m(ids).logits
    assert_close(decode_logits(m, ids, 7, cache=m.make_cache(2)), full, atol=2e-5, msg=name)
    assert 0 < (full - ref).abs().max() < (0.05 if scheme == "int8" else 0.3) * ref.abs().max()


def test_what_is_swapped_and_kept():
    m = tiny("rodimus++")
    names = eligible(m)
    quantize_(m, "int8")
    assert "lm_head" in names and all(isinstance(m.get_submodule(n), QuantizedLinear) for n in names)
    kept = [n for n, mod in m.named_modules() if isinstance(mod, nn.Linear)]
    assert kept and all(n.rsplit(".", 1)[-1] in ("gate_proj", "beta_down", "beta_up") for n in kept)
    assert isinstance(m.embed.weight, nn.Parameter) and m.embed.weight.dtype == torch.float32   # tied: stays float
    assert quantization_of(m)["scheme"] == "int8" and quantize_(m, "int8") is m                   # idempotent


def test_shared_layers_share_one_quantized_module():
    m = tiny("transformer++", layout="A@0 M A@0 M")
    quantize_(m, "int4", 32)
    assert m.blocks[0].mixer.qkv is m.blocks[2].mixer.qkv


def test_quantized_checkpoint_round_trip(tmp_path):
    torch.manual_seed(0)
    m = quantize_(tiny("llama"), "int4", 32)
    ids = torch.randint(0, 97, (1, 11))
    path = save_checkpoint(str(tmp_path), m)
    cfg = json.load(open(f"{path}/config.json"))["quantization_config"]
    assert cfg["scheme"] == "int4" and cfg["group_size"] == 32 and "lm_head" in cfg["modules"]
    loaded, _ = load_checkpoint(path)
    assert loaded.lm_head.weight_q.dtype == torch.uint8 and torch.equal(loaded.lm_head.weight_q, m.lm_head.weight_q)
    assert torch.equal(loaded.eval()(ids).logits, m(ids).logits)
    with pytest.raises(InputError, match="already quantized int4 .groups of 32.*int8"):
        quantize_(loaded, "int8")
    cfg_file = f"{path}/config.json"                       # a config that names a module the weights lack
    d = json.load(open(cfg_file))
    d["quantization_config"]["modules"] = d["quantization_config"]["modules"][:-1]
    json.dump(d, open(cfg_file, "w"))
    with pytest.raises(CheckpointError):
        load_checkpoint(path)


def test_refuses_what_it_cannot_serve():
    m = tiny("transformer++")
    with pytest.raises(InputError, match=r"^cannot quantize 'blocks.0.norm': not a linear layer of this model$"):
        quantize_(m, "int8", modules=["blocks.0.mixer.qkv", "blocks.0.norm"])
    assert quantization_of(m) is None                                    # nothing swapped
    with pytest.raises(InputError, match="group size must be one of"):
        quant.quantize(torch.randn(16, 64), "int4", 48)


def test_int4_pads_inputs_to_the_group():
    """Rodimus's FFN width (4/3 d rounded to 8, e.g. 2736) is no multiple of a group: zero columns pad it."""
    torch.manual_seed(0)
    lin = nn.Linear(88, 24)
    q = QuantizedLinear.from_linear(lin, "int4", 64)
    assert q.weight_q.shape == (24, 64) and q.scale.shape == (24, 2) and q.dequantized().shape == (24, 88)
    x = torch.randn(3, 88)
    assert ((q(x) - quant.linear_reference(x, "int4", q.stored(), q.bias)).abs() <= q8_bound(x, q.stored())).all()
    assert (q(x) - lin(x)).abs().max() < 0.1 * lin(x).abs().max()
