"""The project's CPU matrix-vector kernels (ops/cpu_kernels.py) against the float32 reference: every dtype, odd sizes
(K not a multiple of the vector width, N not of the row block, int4's padded groups), 1-8 rows; the layers that use
them (QuantizedLinear, KernelLinear) on the decode path and off it; decode = forward with the kernels on; and the
fallback when the compiler is missing (one warning, PyTorch's path, the same numbers)."""
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import assert_close, decode_logits
from hybridlm.layers.quantized import KernelLinear, QuantizedLinear
from hybridlm.models.quantize import quantize_, use_cpu_kernels_
from hybridlm.ops import cpu_kernels, quant
from test_models import tiny
from test_quant import int16_bound

# skipped only where there is no compiler at all: a kernel that fails to compile where one exists fails here
pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")


def test_kernels_build():
    assert cpu_kernels.available()


@pytest.mark.parametrize("N,K", [(37, 200), (64, 67), (1, 8), (5, 3)])
@pytest.mark.parametrize("M", [1, 3, 8])
def test_float_kernels_equal_matmul(N, K, M):
    torch.manual_seed(0)
    w, x, b = torch.randn(N, K), torch.randn(M, K), torch.randn(N)
    assert_close(cpu_kernels.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    wb = w.bfloat16()
    xr = x.bfloat16().float() if cpu_kernels.bf16_dot() else x        # the bf16 dot products round x once
    assert_close(cpu_kernels.linear(x, wb), xr @ wb.float().T, rtol=1e-5, atol=1e-5, msg="bf16 weights, f32 acts")
    out = cpu_kernels.linear(x.bfloat16(), wb)
    assert out.dtype == torch.bfloat16
    assert_close(out.float(), x.bfloat16().float() @ wb.float().T, rtol=1e-2, atol=2e-2)


@pytest.mark.parametrize("N,K", [(37, 200), (64, 2048), (5, 31), (9, 33)])
def test_bf16_dot_products_equal_float_convert(N, K):
    """The two bf16 loops of one build: the CPU's bf16 dot products (x rounded to bf16) against the float32-convert
    loop on that rounded x (the same numbers up to summation order), and within bf16's rounding of x of the
    unrounded x. On a CPU without bf16 units both are the convert loop."""
    torch.manual_seed(0)
    lib = cpu_kernels._lib if cpu_kernels.available() else None
    w, x = torch.randn(N, K).bfloat16(), torch.randn(3, K)
    y, ref = torch.empty(3, N), torch.empty(3, N)
    lib.mv_bf16(x.data_ptr(), 3, K, w.data_ptr(), N, y.data_ptr())
    xr = x.bfloat16().float() if lib.mv_bf16_dot() else x
    lib.mv_bf16_f32(xr.data_ptr(), 3, K, w.data_ptr(), N, ref.data_ptr())
    assert_close(y, ref, rtol=1e-5, atol=1e-5)
    exact = x @ w.float().T
    assert ((y - exact).abs() <= 2 ** -8 * (x.abs() @ w.float().abs().T) + 1e-6).all()


@pytest.mark.parametrize("bias", [False, True])
def test_bf16_in_and_out_equals_the_float_path(bias):
    """bf16 x, w and bias: the kernel reads x and writes y as bf16 (mv_bf16_io), bit for bit what the float path
    gives rounded to bf16; 1 and 3 rows; a non-contiguous x takes the float path."""
    assert cpu_kernels.available()
    torch.manual_seed(0)
    w, b = torch.randn(37, 200).bfloat16(), torch.randn(37).bfloat16() if bias else None
    for rows in (1, 3):
        x = torch.randn(rows, 1, 200).bfloat16()
        y = cpu_kernels.linear(x, w, b)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, 1, 37)
        want = cpu_kernels.linear(x.float(), w, b.float() if bias else None).bfloat16()
        assert torch.equal(y, want)
    xt = torch.randn(200, 2).bfloat16().T
    assert_close(cpu_kernels.linear(xt, w, b).float(), cpu_kernels.linear(xt.contiguous(), w, b).float(), rtol=0,
                 atol=0)


def test_bf16_dot_products_follow_the_cpu():
    """The build takes the bf16 dot-product loop exactly where the CPU has AVX512-BF16."""
    from hybridlm.dtypes import cpu_flags
    assert cpu_kernels.bf16_dot() == ("avx512_bf16" in cpu_flags() and sys.platform == "linux"
                                      and os.uname().machine == "x86_64")


@pytest.mark.parametrize("scheme,g", [("int8", None), ("int4", 32), ("int4", 64), ("int4", 128)])
@pytest.mark.parametrize("N,K", [(37, 200), (16, 128), (3, 290), (9, 600)])
def test_quantized_kernels_equal_reference(scheme, g, N, K):
    torch.manual_seed(0)
    w, x, b = torch.randn(N, K), torch.randn(2, 3, K), torch.randn(N)
    t = quant.quantize(w, scheme, g)
    fn = cpu_kernels.int8_linear if scheme == "int8" else cpu_kernels.int4_linear
    err = (fn(x, *t, b) - quant.linear_reference(x, scheme, t, b)).abs()
    assert (err <= int16_bound(x, scheme, t)).all(), err.max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme,g", [("int8", None), ("int4", 32), ("int4", 64), ("int4", 128)])
def test_one_pass_dequantize_equals_reference(scheme, g, dtype):
    """Prefill's weight: the kernels' one-pass dequantization equals ops/quant's (float32: to the last bit an FMA
    may round differently; bf16: the same bf16 values but for such ties)."""
    assert cpu_kernels.available()
    torch.manual_seed(0)
    t = quant.quantize(torch.randn(9, 300), scheme, g)
    got = cpu_kernels.dequantize(scheme, t, dtype)
    want = quant.dequantize(scheme, t).to(dtype)
    assert got.dtype == dtype and got.shape == want.shape
    assert_close(got.float(), want.float(), rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-6)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_linear_paths_agree(scheme, monkeypatch):
    """Decode rows go to the kernel, prefill rows to dequantize + matmul, and without the kernel to PyTorch's
    int8 / int4 kernels: all three equal the reference."""
    torch.manual_seed(0)
    lin = nn.Linear(96, 40)
    q = QuantizedLinear.from_linear(lin, scheme, 32)
    calls = []
    real = cpu_kernels.int8_linear if scheme == "int8" else cpu_kernels.int4_linear
    monkeypatch.setattr(cpu_kernels, f"{scheme}_linear", lambda *a: calls.append(1) or real(*a))
    for rows in (1, 8, 9, 64):
        x = torch.randn(rows, 96)
        err = (q(x) - quant.linear_reference(x, scheme, q.stored(), q.bias)).abs()
        assert (err <= int16_bound(x, scheme, q.stored())).all()
    assert len(calls) == 2                                # 1 and 8 rows: the kernel; 9 and 64: a matmul
    monkeypatch.setattr(cpu_kernels, "_lib", False)       # as without a compiler
    x = torch.randn(2, 96)
    assert_close(q(x), quant.linear_reference(x, scheme, q.stored(), q.bias), rtol=1e-5, atol=1e-4)


def test_kernel_linear_is_a_class_swap():
    torch.manual_seed(0)
    m = tiny("transformer++")
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    ids = torch.randint(0, 97, (2, 19))
    ref = m(ids).logits
    use_cpu_kernels_(m)
    assert any(type(x) is KernelLinear for x in m.modules()) and not any(type(x) is nn.Linear for x in m.modules())
    assert m.state_dict().keys() == sd.keys()
    assert_close(decode_logits(m, ids, 7, cache=m.make_cache(2)), ref, atol=2e-5)
    loss = F.cross_entropy(m(ids).logits.flatten(0, 1), ids.flatten())      # training still runs nn.Linear's path
    loss.backward()
    assert m.lm_head.weight.grad is not None


@pytest.mark.parametrize("name,scheme", [("rodimus++", "int4"), ("mamba2", "int8")])
def test_decode_equals_forward_with_kernels(name, scheme):
    torch.manual_seed(0)
    m = use_cpu_kernels_(quantize_(tiny(name), scheme, 32))
    ids = torch.randint(0, 97, (2, 19))
    assert_close(decode_logits(m, ids, 7, cache=m.make_cache(2)), m(ids).logits, atol=2e-5, msg=name)


def test_missing_compiler_warns_once_and_falls_back(tmp_path):
    code = ("import warnings, torch\nfrom hybridlm.ops import cpu_kernels\nfrom hybridlm.layers.quantized import "
            "QuantizedLinear\nwith warnings.catch_warnings(record=True) as w:\n    warnings.simplefilter('always')\n"
            "    q = QuantizedLinear.from_linear(torch.nn.Linear(64, 8), 'int8')\n    q(torch.randn(1, 64)); "
            "q(torch.randn(1, 64))\nprint(cpu_kernels.available(), len(w), str(w[0].message))")
    env = dict(os.environ, CXX="/nonexistent/c++", HYBRIDLM_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.startswith("False 1 ") and "could not be compiled" in out and "CXX" in out


NO_BF16_UNITS = (["-march=native", "-mno-avx512bf16"] if os.uname().machine == "x86_64" else None)


@pytest.mark.parametrize("march", [[], NO_BF16_UNITS], ids=["generic", "no-bf16-units"])
def test_portable_build_equals_native(tmp_path, monkeypatch, march):
    """The loops for CPUs without AVX2 (ARM, older x86), built with no -march, and those for x86 CPUs without bf16
    units (this CPU's build less AVX512-BF16) give the native build's numbers (bf16: on x rounded to bf16, which
    the native build does where it has bf16 dot products)."""
    import ctypes
    if march is None:
        pytest.skip("not x86")
    assert cpu_kernels.available()
    so = tmp_path / "other.so"
    subprocess.run([os.environ.get("CXX", "c++"), "-O2", *march, "-fopenmp", "-shared", "-fPIC", "-std=c++17",
                    "-Wno-psabi", *cpu_kernels.SOURCES, "-o", str(so)], check=True, capture_output=True)
    torch.manual_seed(0)
    w, x = torch.randn(37, 224), torch.randn(3, 224)
    xb, wb = x.bfloat16().float(), w.bfloat16()

    def each():
        return {"f32": cpu_kernels.linear(x, w), "bf16": cpu_kernels.linear(xb, wb),
                "int8": cpu_kernels.int8_linear(x, *quant.quantize(w, "int8")),
                "int4": cpu_kernels.int4_linear(x, *quant.quantize(w, "int4", 32))}
    want = each()
    monkeypatch.setattr(cpu_kernels, "_lib", cpu_kernels.bind(ctypes.CDLL(str(so))))
    got = each()
    for k in want:
        assert_close(got[k], want[k], rtol=1e-5, atol=2e-4, msg=k)
    assert not cpu_kernels.bf16_dot()
