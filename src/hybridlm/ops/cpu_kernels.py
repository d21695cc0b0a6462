"""The project's CPU linear kernels (csrc/gemm.cpp) for any number of rows: y = x Wᵀ with W read in its stored
form (float32, bfloat16, int8 per channel, int4 per group, repacked once), in register tiles so that each load of W
serves several rows; with the one-token decode ops (csrc/decode_ops.cpp, ops/cpu_decode.py) in one library.

Why: decode is bound by how fast the weights stream from memory and PyTorch's paths stream them slowly on some CPUs
(its int8 / int4 kernels are vectorised for AVX-512 only; bf16 `F.linear` is slow without bf16 instructions); a
serving batch or a prompt needs a tiled product in the stored dtype. `ROWS` says up to how many rows each format
takes our kernel (measured beside PyTorch's: docs/performance.md); more go to PyTorch's.

Run-time dispatch: the library is compiled once per instruction-set level (`LEVELS`: portable, avx2, avx512,
avx512_vnni, avx512_bf16), lazily (only the level in use), with the system's C++ compiler (`cxx_compiler()`: `$CXX`,
else g++ / c++ / clang++), cached under `$HYBRIDLM_CACHE` (default ~/.cache/hybridlm) by a hash of the sources, the
compiler and the level (not the CPU: one cache serves a pool of different CPUs). At load the highest level the CPU's
flags allow is chosen; `HYBRIDLM_CPU_ISA=<level>` forces a lower one. Called through ctypes with the tensors'
pointers (no copy); OpenMP links to the runtime torch already loaded, so the kernel's threads are torch's.

Where the compiler is missing or fails, `available()` is False (one warning says why) and callers keep PyTorch's
path; `HYBRIDLM_CPU_KERNELS=0` turns the kernels off. Shapes and semantics are ops/quant.py's: tests hold every
level to the float32 reference.
"""
import ctypes
import functools
import glob
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings

import torch
from torch import Tensor

CSRC = os.path.join(os.path.dirname(__file__), "csrc")
SOURCES = tuple(sorted(glob.glob(os.path.join(CSRC, "*.cpp"))))      # one library: gemm.cpp, decode_ops.cpp, ...
HEADERS = tuple(sorted(glob.glob(os.path.join(CSRC, "*.h"))))


def _levels() -> dict:
    """instruction-set level -> (compiler flags, the CPU flags (/proc/cpuinfo) it needs), lowest first; each level
    adds to the one before it."""
    out = {"portable": ([], set())}
    for name, cc, cpu in [("avx2", "avx2 fma f16c", "avx2 fma f16c"),
                          ("avx512", "avx512f avx512bw avx512vl avx512dq", "avx512f avx512bw avx512vl avx512dq"),
                          ("avx512_vnni", "avx512vnni", "avx512_vnni"), ("avx512_bf16", "avx512bf16", "avx512_bf16")]:
        cc_before, cpu_before = list(out.values())[-1]
        out[name] = (cc_before + [f"-m{f}" for f in cc.split()], cpu_before | set(cpu.split()))
    return out


LEVELS = _levels()
# rows of x up to which each stored format takes our kernel (None: any number); more rows go to PyTorch's (F.linear,
# or the quantized weight dequantized once for F.linear): the faster at each row count measured (docs/performance.md,
# scripts/gemm_speed.py). bfloat16 only where PyTorch has bf16 instructions to run it on (`torch_bf16()`).
ROWS = {"float32": 128, "bfloat16": 64, "int8": None, "int4": None}
DECODE_ROWS = 8    # rows the one-token decode ops (ops/cpu_decode.py) and the routed experts' per-row path take
_lib = None        # the loaded library, False once it could not be built


def _cache_dir() -> str:
    return os.path.join(os.environ.get("HYBRIDLM_CACHE", os.path.expanduser("~/.cache/hybridlm")), "kernels")


def cxx_compiler() -> str | None:
    """The C++ compiler: $CXX when set, else the first of g++, c++, clang++ on PATH; None if there is none. The one
    lookup for these kernels and for torch.compile on a CPU (which generates C++)."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    return next((c for c in names if shutil.which(c)), None)


def cpu_levels() -> list[str]:
    """The levels this CPU can run, lowest first (x86 levels only on x86)."""
    from ..dtypes import cpu_flags
    flags = cpu_flags()
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return [name for name, (_, need) in LEVELS.items() if name == "portable" or (x86 and need <= flags)]


def chosen_level() -> str:
    """The level to load: `HYBRIDLM_CPU_ISA` when set (one this CPU can run), else the highest the CPU can run."""
    can = cpu_levels()
    want = os.environ.get("HYBRIDLM_CPU_ISA")
    if not want:
        return can[-1]
    if want not in LEVELS:
        raise ValueError(f"HYBRIDLM_CPU_ISA={want!r} is not a level (one of {', '.join(LEVELS)})")
    if want not in can:
        raise ValueError(f"HYBRIDLM_CPU_ISA={want!r} needs CPU flags this CPU lacks (it can run {', '.join(can)})")
    return want


def build(level: str) -> str:
    """Compile the library at `level` (once; cached) and return its path; raises on failure. Any level compiles on
    any x86 host (running it needs the CPU's flags)."""
    cxx = cxx_compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    flags = ["-O3", *LEVELS[level][0], "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-Wno-psabi"]
    src = b""
    for source in SOURCES + HEADERS:
        with open(source, "rb") as f:
            src += f.read()
    key = hashlib.sha256(src + version.encode() + " ".join(flags).encode()).hexdigest()[:16]
    path = os.path.join(_cache_dir(), f"hybridlm-{level}-{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(_cache_dir(), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=_cache_dir())
    os.close(fd)
    done = subprocess.run([cxx, *flags, *SOURCES, "-o", tmp], capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "compiler failed")
    os.replace(tmp, path)           # atomic: a concurrent process sees the whole library or none
    return path


def load(level: str):
    """The library compiled at `level`, loaded and bound (tests load each level the CPU can run)."""
    return bind(ctypes.CDLL(build(level)))


def _load():
    global _lib
    if _lib is None:
        _lib = False
        if os.environ.get("HYBRIDLM_CPU_KERNELS", "1") == "0":
            return _lib
        if sys.platform != "linux" or "OpenMP" not in torch.__config__.parallel_info():
            warnings.warn("hybridlm's CPU kernels need Linux and torch's OpenMP build; using PyTorch's matmul "
                          "instead", stacklevel=3)
            return _lib
        try:
            level = chosen_level()
        except ValueError as e:
            warnings.warn(f"{e}; using PyTorch's matmul instead", stacklevel=3)
            return _lib
        try:
            _lib = load(level)
        except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
            warnings.warn(f"hybridlm's CPU kernels could not be compiled with {cxx_compiler()!r} ({e}); using "
                          f"PyTorch's matmul instead (set CXX to a C++ compiler with OpenMP to enable them)",
                          stacklevel=3)
    return _lib


def bind(lib):
    """Declare the kernels' C signatures on a loaded library (ctypes.CDLL of csrc/*.cpp); returns it."""
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.mv_f32.argtypes = lib.mv_bf16.argtypes = lib.mv_bf16_f32.argtypes = [p, i64, i64, p, i64, p]
    lib.mv_int8.argtypes = [p, i64, i64, p, p, i64, p]
    lib.q4_linear.argtypes = [p, i64, i64, p, i64, i64, i64, p]
    lib.q4_pack.argtypes = [p, p, p, i64, i64, i64, p]
    for fn in (lib.mv_f32, lib.mv_bf16, lib.mv_bf16_f32, lib.mv_int8, lib.q4_linear, lib.q4_pack):
        fn.restype = None
    lib.q4_packed_bytes.argtypes, lib.q4_packed_bytes.restype = [i64, i64, i64], i64
    lib.cpu_level.argtypes, lib.cpu_level.restype = [], ctypes.c_char_p
    lib.dq_int4.argtypes, lib.dq_int4.restype = [p, p, p, i64, i64, i64, p, ctypes.c_int], None
    lib.dq_int8.argtypes, lib.dq_int8.restype = [p, p, i64, i64, p, ctypes.c_int], None
    lib.mv_bf16_io.argtypes, lib.mv_bf16_io.restype = [p, i64, i64, p, i64, p, p], None
    lib.mv_bf16_dot.argtypes, lib.mv_bf16_dot.restype = [], ctypes.c_int
    lib.read_sum.argtypes, lib.read_sum.restype = [p, i64], ctypes.c_float
    for name, args in _STEPS.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    return lib


# the one-token decode ops (csrc/decode_ops.cpp) and the whole-mixer steps (csrc/mixers.cpp): C arguments, in order
# (p: a pointer, i: int64, f: float, b: int); each has a public function below (ops/cpu_decode.py and
# layers/cpu_steps.py call them with the tensors' pointers)
_p, _i, _f, _b = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_STEPS = {"dec_ssd_step": [_p] * 7 + [_i] * 5,
          "dec_ssd_gated": [_p] * 5 + [_f, _f] + [_p] * 4 + [_i] * 5,
          "dec_gla_step": [_p] * 6 + [_i] * 4 + [_f],
          "dec_delta_step": [_p] * 5 + [_b, _p, _p] + [_i] * 4 + [_f],
          "dec_delta_gated": [_p] * 5 + [_b, _p, _p] + [_i] * 5 + [_f, _f],
          "dec_conv_step": [_p] * 5 + [_i] * 3 + [_b, _b],
          "dec_attention": [_p] * 4 + [_i] * 12 + [_p, _p, _i, _f, _b],
          "dec_rms_norm": [_p] * 5 + [_i] * 3 + [_b, _f, _b],
          "mix_gated_deltanet": [_p, _p, _i, _i, _b] + [_p] * 4 + [_i, _p, _p, _p, _f, _p, _p] + [_i] * 4,
          "mix_kda": [_p, _p, _i, _i, _b, _p, _p, _p, _i] + [_p] * 8 + [_f, _p, _p, _i, _i],
          "mix_moe": [_p, _p, _i, _i, _b, _b, _p, _p, _b, _b, _f, _i, _i, _i, _p, _p, _p, _p, _p, _b, _p, _p, _b,
                      _p],
          "mix_mlp": [_p, _p, _i, _i, _b, _p, _p, _b, _b],
          "mix_attention": [_p, _p, _i, _i, _b, _p, _p] + [_i] * 4 + [_b, _p, _p, _f, _i, _b] + [_p] * 4
                           + [_i] * 6 + [_p, _p, _i, _f],
          "mix_mla": [_p, _p, _i, _i, _b, _p, _p, _p, _p, _p, _f, _p, _b, _p] + [_i] * 5 + [_b, _b] + [_p] * 3
                     + [_i, _i, _p, _p, _f],
          "mix_mamba2": [_p, _p, _i, _i, _b] + [_p] * 4 + [_i] + [_p] * 3 + [_f, _f, _b, _p, _f, _p, _p] + [_i] * 4,
          "mix_gated_conv": [_p, _p, _i, _i, _b] + [_p] * 4 + [_i, _p],
          "mix_rodimus": [_p, _p, _i, _i, _b] + [_p] * 4 + [_i, _p, _p, _b] + [_p] * 6 + [_f, _p, _p, _i, _i]}


def _step(name: str):
    def call(*args) -> None:
        if not available():
            raise RuntimeError("hybridlm's CPU kernels are not available (see the warning given when they were "
                               "loaded)")
        getattr(_lib, name)(*args)
    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"csrc's `{name}` (its arguments: `_STEPS`, the C comment above it), on the tensors' pointers."
    return call


dec_ssd_step, dec_ssd_gated, dec_gla_step = _step("dec_ssd_step"), _step("dec_ssd_gated"), _step("dec_gla_step")
dec_delta_step, dec_delta_gated = _step("dec_delta_step"), _step("dec_delta_gated")
dec_conv_step, dec_attention, dec_rms_norm = _step("dec_conv_step"), _step("dec_attention"), _step("dec_rms_norm")
mix_gated_deltanet, mix_kda, mix_moe = _step("mix_gated_deltanet"), _step("mix_kda"), _step("mix_moe")
mix_attention, mix_mla, mix_mamba2 = _step("mix_attention"), _step("mix_mla"), _step("mix_mamba2")
mix_gated_conv, mix_rodimus, mix_mlp = _step("mix_gated_conv"), _step("mix_rodimus"), _step("mix_mlp")


class Lin(ctypes.Structure):
    """One linear layer's stored weight as csrc/mixers.cpp reads it (its `struct Lin`): fmt 0 float32, 1 bf16, 2 int8
    (scale [N] float32), 3 int4 packed by `int4_pack` (K the padded K', G groups); W [N, K] at `w`, a float32 bias or
    null; a stack of experts: expert e's weight `w_step` bytes, its scales `s_step` floats after expert e - 1's."""
    _fields_ = [("fmt", _i), ("N", _i), ("K", _i), ("G", _i), ("w", _p), ("scale", _p), ("zero", _p),
                ("bias", _p), ("w_step", _i), ("s_step", _i)]


FORMATS = {torch.float32: 0, torch.bfloat16: 1, "int8": 2, "int4": 3}      # a weight's `Lin.fmt`


def available() -> bool:
    """True when the kernels are compiled and loaded (builds them on first call)."""
    return bool(_load())


def level() -> str | None:
    """The instruction-set level of the loaded library (`LEVELS`), None without one."""
    return _lib.cpu_level().decode() if available() else None


def bf16_dot() -> bool:
    """True when the bf16 kernel runs on the CPU's bf16 dot products (level avx512_bf16): x is then rounded to bf16
    once per call. Else it widens W to float32 (a 16-bit shift) as it reads."""
    return available() and bool(_lib.mv_bf16_dot())


def decode_sized(x: Tensor) -> bool:
    """True when `x` [..., K] has at most DECODE_ROWS rows (a decode step's input, for the one-token ops)."""
    return x.numel() <= DECODE_ROWS * x.shape[-1]


@functools.cache
def torch_bf16() -> bool:
    """True when the CPU has bf16 instructions (AVX512-BF16 or AMX) for PyTorch's bf16 GEMM (oneDNN); without them
    it converts as it goes and our kernel (bf16 widened by a shift) takes every row count."""
    from ..dtypes import cpu_flags
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def serves(x: Tensor, fmt: "str | torch.dtype") -> bool:
    """True when our kernel takes `x` [..., K] (CPU, no gradient, kernels built) against a weight stored as `fmt`
    (torch.float32 / torch.bfloat16, or the scheme "int8" / "int4"): at most ROWS[fmt] rows, where it is the faster."""
    fmt = str(fmt).removeprefix("torch.")
    limit = ROWS[fmt] if fmt != "bfloat16" or torch_bf16() else None
    return (x.device.type == "cpu" and not x.requires_grad and (limit is None or x.numel() <= limit * x.shape[-1])
            and available())


def _rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1]).float().contiguous()


def _out(x: Tensor, y: Tensor, bias: Tensor | None) -> Tensor:
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _linear(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    bf16 = torch.bfloat16
    if x.dtype == w.dtype == bf16 and (bias is None or bias.dtype == bf16) and x.is_contiguous():
        # a bf16 model: x read and y written as bf16 by the kernel (no conversions around the call)
        y = torch.empty(*x.shape[:-1], w.shape[0], dtype=bf16)
        _lib.mv_bf16_io(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], w.data_ptr(), w.shape[0],
                        bias.data_ptr() if bias is not None else None, y.data_ptr())
        return y
    x2 = _rows(x)
    y = torch.empty(x2.shape[0], w.shape[0])
    fn = _lib.mv_bf16 if w.dtype == torch.bfloat16 else _lib.mv_f32
    fn(x2.data_ptr(), x2.shape[0], x2.shape[1], w.data_ptr(), w.shape[0], y.data_ptr())
    return _out(x, y, bias)


def _int8_linear(x: Tensor, q: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    x2 = _rows(x)
    s = scale.float().contiguous()
    y = torch.empty(x2.shape[0], q.shape[0])
    _lib.mv_int8(x2.data_ptr(), x2.shape[0], x2.shape[1], q.data_ptr(), s.data_ptr(), q.shape[0], y.data_ptr())
    return _out(x, y, bias)


def int4_pack(q: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    """ops/quant.py's stored int4 weight (q uint8 [N, K'/2], scale, zero [N, G]) repacked for `int4_linear`: uint8
    [bytes] of 8-row tiles, float16 scales and mins beside their groups (csrc/gemm.cpp, q4_pack). Done once per
    weight (at load or first use); the stored form stays the checkpoint's."""
    if not available():
        raise RuntimeError("hybridlm's CPU kernels are not available (see the warning given when they were loaded)")
    N, G = scale.shape
    Kp = q.shape[1] * 2
    out = torch.empty(_lib.q4_packed_bytes(N, Kp, G), dtype=torch.uint8)
    q, s, z = q.contiguous(), scale.float().contiguous(), zero.float().contiguous()
    _lib.q4_pack(q.data_ptr(), s.data_ptr(), z.data_ptr(), N, Kp, G, out.data_ptr())
    return out


def _int4_linear(x: Tensor, packed: Tensor, N: int, Kp: int, G: int, bias: Tensor | None = None) -> Tensor:
    x2 = _rows(x)
    y = torch.empty(x2.shape[0], N)
    _lib.q4_linear(x2.data_ptr(), x2.shape[0], x2.shape[1], packed.data_ptr(), N, Kp, G, y.data_ptr())
    return _out(x, y, bias)


def dequantize(scheme: str, tensors: tuple[Tensor, ...], dtype: torch.dtype) -> Tensor:
    """ops/quant.dequantize(scheme, tensors).to(dtype) in one pass (prefill's weight for one matmul): [N, K'] in
    float32 or bfloat16, computed in float32 (an FMA may round the last bit differently). Needs `available()`."""
    q, scale = tensors[0], tensors[1].float().contiguous()
    N = q.shape[0]
    bf = dtype == torch.bfloat16
    out = torch.empty(N, q.shape[1] * (2 if scheme == "int4" else 1), dtype=torch.bfloat16 if bf else torch.float32)
    if scheme == "int4":
        zero = tensors[2].float().contiguous()
        _lib.dq_int4(q.data_ptr(), scale.data_ptr(), zero.data_ptr(), N, out.shape[1], scale.shape[1],
                     out.data_ptr(), int(bf))
    else:
        _lib.dq_int8(q.data_ptr(), scale.data_ptr(), N, out.shape[1], out.data_ptr(), int(bf))
    return out if dtype in (torch.float32, torch.bfloat16) else out.to(dtype)


# the same functions as torch custom ops, which torch.compile keeps as calls inside its graph (a ctypes call would
# break the graph); eager code calls the plain functions (a custom op's dispatch costs microseconds per call)
def _custom_op(name: str, fn, out_features):
    op = torch.library.custom_op(f"hybridlm::{name}", fn, mutates_args=())

    @op.register_fake
    def _(x, *args):
        return x.new_empty(*x.shape[:-1], out_features(*args))
    return op


_ops = {"linear": _custom_op("cpu_linear", _linear, lambda w, bias=None: w.shape[0]),
        "int8": _custom_op("cpu_int8_linear", _int8_linear, lambda q, scale, bias=None: q.shape[0]),
        "int4": _custom_op("cpu_int4_linear", _int4_linear, lambda packed, N, Kp, G, bias=None: N)}


def linear(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ w [N, K]ᵀ (+ bias) -> [..., N] in x's dtype, w float32 or bfloat16 (contiguous). With bf16 w on a
    CPU with bf16 dot products (`bf16_dot()`) x is rounded to bf16 once per call, as llama.cpp does (a relative
    error of 2⁻⁹ per element of x, the size of the weight's own rounding); products are summed in float32."""
    return (_ops["linear"] if torch.compiler.is_compiling() else _linear)(x, w, bias)


def int8_linear(x: Tensor, q: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ (scale[:, None] · q)ᵀ (+ bias) -> [..., N]: q int8 [N, K], scale [N]. The kernel rounds x to
    int16 per row (relative error 1.5e-5, far below the weight's)."""
    return (_ops["int8"] if torch.compiler.is_compiling() else _int8_linear)(x, q, scale, bias)


def int4_linear(x: Tensor, packed: Tensor, N: int, Kp: int, G: int, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ Wᵀ (+ bias) -> [..., N] for an int4 weight [N, Kp] of G groups packed by `int4_pack` (K <= Kp:
    the padding columns meet zeros). x is rounded to int8 per block of 32 columns once per call (llama.cpp's Q8_0: a
    relative error of 0.4% of the block's largest value) and the weight's scales and mins to float16 at packing
    (Q4_0's): `quant.int4_q8_reference` is this math in float32."""
    return (_ops["int4"] if torch.compiler.is_compiling() else _int4_linear)(x, packed, N, Kp, G, bias)

