"""The project's CPU GEMM (ops/cpu_kernels.py) against the float32 reference at every instruction-set level this CPU
can run (the others at least compiled): every stored format, any number of rows (1, 3, 17, 130), odd sizes (K not a
multiple of the vector width or of the int4 group, N not of the tile); the int4 product against a float32 form of
exactly its math (tight) and the float model (loose); the dispatch (the highest level, HYBRIDLM_CPU_ISA forcing a
lower one); the layers that use the kernels (QuantizedLinear, KernelLinear) and the rows routed to PyTorch;
decode = forward with the kernels on; the fallback when the compiler is missing (one warning, PyTorch's path)."""
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
from test_quant import int16_bound, kernel_bound, q8_bound

# skipped only where there is no compiler at all: a kernel that fails to compile where one exists fails here
pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")
X86 = os.uname().machine == "x86_64"
SHAPES = [(37, 200), (64, 67), (13, 300), (5, 31)]          # [N, K]: N off the tiles, K off the vectors and groups


def test_kernels_build_at_the_highest_level():
    assert cpu_kernels.available()
    assert cpu_kernels.level() == cpu_kernels.cpu_levels()[-1] == cpu_kernels.chosen_level()


@pytest.fixture(params=list(cpu_kernels.LEVELS))
def level(request, monkeypatch):
    """Each level: loaded in place of the chosen library where this CPU runs it, else only compiled."""
    name = request.param
    if name != "portable" and not X86:
        pytest.skip("an x86 level")
    if name not in cpu_kernels.cpu_levels():
        cpu_kernels.build(name)                      # compiles: a CPU with the flags would run it
        pytest.skip(f"compiled only: this CPU cannot run {name}")
    lib = cpu_kernels.load(name)
    assert lib.cpu_level().decode() == name
    monkeypatch.setattr(cpu_kernels, "_lib", lib)
    return name


def test_float_formats_equal_the_reference(level):
    torch.manual_seed(0)
    for N, K in SHAPES:
        for M in (1, 3, 17, 130):
            w, x, b = torch.randn(N, K), torch.randn(M, K), torch.randn(N)
            scale = x.abs() @ w.abs().T
            assert ((cpu_kernels.linear(x, w, b) - F.linear(x, w, b)).abs() <= 1e-5 * scale + 1e-5).all()
            wb = w.bfloat16()
            xr = x.bfloat16().float() if cpu_kernels.bf16_dot() else x       # the bf16 dot products round x once
            y = cpu_kernels.linear(x, wb)
            assert ((y - xr @ wb.float().T).abs() <= 1e-5 * scale + 1e-5).all(), (level, N, K, M)
            yb = cpu_kernels.linear(x.bfloat16(), wb, b.bfloat16())         # bf16 in, bf16 out
            assert yb.dtype == torch.bfloat16
            want = cpu_kernels.linear(x.bfloat16().float(), wb, b.bfloat16().float()).bfloat16()
            assert torch.equal(yb, want)


def test_quantized_formats_equal_the_reference(level):
    torch.manual_seed(0)
    for (N, K), g in zip(SHAPES, (32, 64, 128, 32)):
        for M in (1, 3, 17, 130):
            w, x, b = torch.randn(N, K), torch.randn(M, K), torch.randn(N)
            t = quant.quantize(w, "int8")
            err = (cpu_kernels.int8_linear(x, *t, b) - quant.linear_reference(x, "int8", t, b)).abs()
            assert (err <= int16_bound(x, "int8", t)).all(), (level, N, K, M)
            t = quant.quantize(w, "int4", g)
            y = cpu_kernels.int4_linear(x, cpu_kernels.int4_pack(*t), N, t[0].shape[1] * 2, t[1].shape[1], b)
            exact = quant.int4_q8_reference(x, *t, b)                      # the kernel's own math, in float32
            tight = 2e-6 * (x.abs() @ quant.dequantize("int4", t)[:, :K].abs().T) + 1e-5
            assert ((y - exact).abs() <= tight).all(), (level, N, K, M, g)
            assert ((y - quant.linear_reference(x, "int4", t, b)).abs() <= q8_bound(x, t)).all()


def test_products_split_over_threads_equal_one_thread():
    """A weight large enough to be split over threads (past gemm.cpp's SMALL) gives, in every format and at 1 and 3
    rows, exactly the numbers of one thread (each output is one thread's sum) and the reference's."""
    torch.manual_seed(0)
    N, K = 301, 256
    w = torch.randn(N, K)
    t8, t4 = quant.quantize(w, "int8"), quant.quantize(w, "int4", 64)
    packed = cpu_kernels.int4_pack(*t4)
    threads = torch.get_num_threads()
    for M in (1, 3):
        x = torch.randn(M, K)
        calls = [lambda: cpu_kernels.linear(x, w), lambda: cpu_kernels.linear(x, w.bfloat16()),
                 lambda: cpu_kernels.linear(x.bfloat16(), w.bfloat16()), lambda: cpu_kernels.int8_linear(x, *t8),
                 lambda: cpu_kernels.int4_linear(x, packed, N, K, K // 64)]
        try:
            torch.set_num_threads(1)
            one = [f() for f in calls]
            torch.set_num_threads(2)
            two = [f() for f in calls]
        finally:
            torch.set_num_threads(threads)
        for a, b in zip(one, two):
            assert torch.equal(a, b), M
        assert ((one[0] - x @ w.T).abs() <= 1e-5 * (x.abs() @ w.abs().T) + 1e-5).all()


def test_every_level_compiles_and_a_forced_level_loads(tmp_path):
    """Every level builds on this host (a pool's other CPUs); HYBRIDLM_CPU_ISA forces each level this CPU runs at
    load, and one it cannot run, or no level at all, is refused with a warning that names it (PyTorch's path runs)."""
    if X86:
        for name in cpu_kernels.LEVELS:
            assert os.path.exists(cpu_kernels.build(name))
    code = ("import os, warnings\nfrom hybridlm.ops import cpu_kernels\nfor name in os.environ['LEVELS'].split():\n"
            "    os.environ['HYBRIDLM_CPU_ISA'] = name\n    cpu_kernels._lib = None\n"
            "    with warnings.catch_warnings(record=True) as w:\n        warnings.simplefilter('always')\n"
            "        print(cpu_kernels.level(), *[str(m.message) for m in w])")
    cannot = [name for name in cpu_kernels.LEVELS if name not in cpu_kernels.cpu_levels()][:1]
    env = dict(os.environ, LEVELS=" ".join(cpu_kernels.cpu_levels() + ["sse9"] + cannot))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    lines = out.stdout.splitlines()
    assert lines[:len(cpu_kernels.cpu_levels())] == cpu_kernels.cpu_levels()        # each level forced in turn
    for bad, line in zip(["sse9"] + cannot, lines[len(cpu_kernels.cpu_levels()):]):
        assert line.startswith(f"None HYBRIDLM_CPU_ISA={bad!r} ") and "PyTorch's" in line, line


def test_bf16_dot_products_follow_the_level():
    """The bf16 dot-product loop runs exactly at level avx512_bf16; its numbers equal the widen-by-shift loop's on x
    rounded to bf16 (the same numbers up to summation order), within bf16's rounding of the unrounded x."""
    assert cpu_kernels.bf16_dot() == (cpu_kernels.level() == "avx512_bf16")
    torch.manual_seed(0)
    lib = cpu_kernels._lib
    for N, K in [(37, 200), (64, 2048), (5, 31), (9, 33)]:
        w, x = torch.randn(N, K).bfloat16(), torch.randn(3, K)
        y, ref = torch.empty(3, N), torch.empty(3, N)
        lib.mv_bf16(x.data_ptr(), 3, K, w.data_ptr(), N, y.data_ptr())
        xr = x.bfloat16().float() if lib.mv_bf16_dot() else x
        lib.mv_bf16_f32(xr.data_ptr(), 3, K, w.data_ptr(), N, ref.data_ptr())
        assert_close(y, ref, rtol=1e-5, atol=1e-5)
        assert ((y - x @ w.float().T).abs() <= 2 ** -8 * (x.abs() @ w.float().abs().T) + 1e-6).all()


def test_rows_are_routed_to_the_faster():
    """Our kernel up to cpu_kernels.ROWS rows of each format, PyTorch's past it; a non-contiguous bf16 x takes the
    float path with the same numbers."""
    x = torch.randn(cpu_kernels.ROWS["float32"] + 1, 8)
    assert cpu_kernels.serves(x[:-1], torch.float32) and not cpu_kernels.serves(x, torch.float32)
    assert cpu_kernels.serves(torch.randn(4096, 8), "int4") and cpu_kernels.serves(torch.randn(4096, 8), "int8")
    assert cpu_kernels.serves(torch.randn(4096, 8), torch.bfloat16) == (not cpu_kernels.torch_bf16())
    assert not cpu_kernels.serves(torch.randn(2, 8, requires_grad=True), torch.float32)
    w = torch.randn(37, 200).bfloat16()
    xt = torch.randn(200, 2).bfloat16().T
    assert torch.equal(cpu_kernels.linear(xt, w), cpu_kernels.linear(xt.contiguous(), w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme,g", [("int8", None), ("int4", 32), ("int4", 64), ("int4", 128)])
def test_one_pass_dequantize_equals_reference(scheme, g, dtype):
    """The weight for PyTorch's matmul where the kernel does not take the rows: the one-pass dequantization equals
    ops/quant's (float32: to the last bit an FMA may round differently; bf16: the same values but for such ties)."""
    assert cpu_kernels.available()
    torch.manual_seed(0)
    t = quant.quantize(torch.randn(9, 300), scheme, g)
    got = cpu_kernels.dequantize(scheme, t, dtype)
    want = quant.dequantize(scheme, t).to(dtype)
    assert got.dtype == dtype and got.shape == want.shape
    assert_close(got.float(), want.float(), rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-6)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_linear_paths_agree(scheme, monkeypatch):
    """Every row count goes to our kernel (int4: packed once, repacked when the stored weight changes in place),
    and without the kernels to PyTorch's int8 / int4 kernels or a dequantized matmul: all equal the reference."""
    torch.manual_seed(0)
    lin = nn.Linear(96, 40)
    q = QuantizedLinear.from_linear(lin, scheme, 32)
    calls = []
    real = getattr(cpu_kernels, f"{scheme}_linear")
    monkeypatch.setattr(cpu_kernels, f"{scheme}_linear", lambda *a: calls.append(1) or real(*a))
    for rows in (1, 8, 9, 130):
        x = torch.randn(rows, 96)
        assert ((q(x) - quant.linear_reference(x, scheme, q.stored(), q.bias)).abs()
                <= kernel_bound(x, scheme, q.stored())).all()
    assert len(calls) == 4
    if scheme == "int4":
        packed = q._q4[1]
        q(x)
        assert q._q4[1] is packed                              # kept
        q.load_state_dict(QuantizedLinear.from_linear(nn.Linear(96, 40), scheme, 32).state_dict())
        assert ((q(x) - quant.linear_reference(x, scheme, q.stored(), q.bias)).abs()
                <= kernel_bound(x, scheme, q.stored())).all()  # repacked after the in-place load
    monkeypatch.setattr(cpu_kernels, "_lib", False)            # as without a compiler
    for rows in (2, 20):
        x = torch.randn(rows, 96)
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
    with torch.no_grad():
        assert_close(m(ids).logits, ref, atol=2e-5)           # the prompt's 38 rows through the kernels too
    assert_close(decode_logits(m, ids, 7, cache=m.make_cache(2)), ref, atol=2e-5)
    loss = F.cross_entropy(m(ids).logits.flatten(0, 1), ids.flatten())      # training still runs nn.Linear's path
    loss.backward()
    assert m.lm_head.weight.grad is not None


@pytest.mark.parametrize("name,scheme", [("rodimus++", "int4"), ("mamba2", "int8")])
def test_decode_equals_forward_with_kernels(name, scheme):
    torch.manual_seed(0)
    m = use_cpu_kernels_(quantize_(tiny(name), scheme, 32))
    packed = [q._q4 is not None for q in m.modules() if isinstance(q, QuantizedLinear)]
    assert packed and all(packed) == (scheme == "int4")          # int4 packed at load, by use_cpu_kernels_
    ids = torch.randint(0, 97, (2, 19))
    with torch.no_grad():                                        # (with gradient the layers take PyTorch's path)
        full = m(ids).logits
        # int4 rounds x to int8 per block, as llama.cpp's Q8_0: the last-bit differences between a full forward and
        # the decode steps flip a rounding here and there (a step of x times |W|), as they do in llama.cpp
        atol = 1e-4 if scheme == "int8" else 0.05 * full.abs().max()          # int8: x to int16, finer
        assert_close(decode_logits(m, ids, 7, cache=m.make_cache(2)), full, atol=atol, msg=name)


def test_missing_compiler_warns_once_and_falls_back(tmp_path):
    code = ("import warnings, torch\nfrom hybridlm.ops import cpu_kernels\nfrom hybridlm.layers.quantized import "
            "QuantizedLinear\nwith warnings.catch_warnings(record=True) as w:\n    warnings.simplefilter('always')\n"
            "    q = QuantizedLinear.from_linear(torch.nn.Linear(64, 8), 'int8')\n    q(torch.randn(1, 64)); "
            "q(torch.randn(1, 64))\nprint(cpu_kernels.available(), len(w), str(w[0].message))")
    env = dict(os.environ, CXX="/nonexistent/c++", HYBRIDLM_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.startswith("False 1 ") and "could not be compiled" in out and "CXX" in out
