"""`--dtype auto`: bf16 where the hardware multiplies bf16 natively, float32 elsewhere.

CPUs with AMX-BF16 (Sapphire Rapids and later Xeons) or AVX512-BF16 (Cooper Lake, Zen 4 and later) run bf16
matmuls at 2-4x float32; without them bf16 is emulated and slower than float32. CUDA GPUs with bf16 (Ampere and
later) likewise. Training and evaluation then autocast to bf16 (float32 weights); generation casts the weights.
HYBRIDLM_AUTO_DTYPE=float32|bfloat16 fixes what auto means (scripts and test suites that must not depend on the
machine).
"""
import os

from .errors import ConfigError

CHOICES = ("auto", "float32", "bfloat16")
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")      # /proc/cpuinfo names


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux); on other systems the bf16 ones torch detects."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    import torch
    probes = {"amx_bf16": "_is_amx_tile_supported", "avx512_bf16": "_is_avx512_bf16_supported"}
    cpu = getattr(torch._C, "_cpu", None)
    return {flag for flag, fn in probes.items() if cpu is not None and getattr(cpu, fn, lambda: False)()}


def resolve_device(device) -> "torch.device":
    """auto/None -> cuda when available, else cpu."""
    import torch
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError:
        raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}") from None


def resolve_dtype(dtype: str, device="auto") -> tuple[str, str]:
    """(float32 | bfloat16, label for run headers) for `dtype` (auto | float32 | bfloat16) on `device`
    (auto | cpu | cuda[:N]); the label says why auto chose, e.g. 'bfloat16 (auto: the CPU has AMX-BF16)'."""
    if dtype not in CHOICES:
        raise ConfigError(f"dtype must be one of {', '.join(CHOICES)}, got {dtype!r}")
    if dtype != "auto":
        return dtype, dtype
    forced = os.environ.get("HYBRIDLM_AUTO_DTYPE")
    if forced:
        if forced not in CHOICES[1:]:
            raise ConfigError(f"HYBRIDLM_AUTO_DTYPE must be float32 or bfloat16, got {forced!r}")
        return forced, f"{forced} (auto: HYBRIDLM_AUTO_DTYPE)"
    chosen, why = _auto(resolve_device(device))
    return chosen, f"{chosen} (auto: {why})"


def _auto(dev) -> tuple[str, str]:
    import torch
    if dev.type == "cuda":
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return ("bfloat16", "the GPU has bf16") if ok else ("float32", "no bf16 on this GPU")
    if dev.type == "cpu":
        found = [f for f in BF16_CPU_FLAGS if f in cpu_flags()]
        if found:
            return "bfloat16", f"the CPU has {found[0].replace('_', '-').upper()}"
        return "float32", "no AMX-BF16 or AVX512-BF16 on this CPU"
    return "float32", f"no bf16 rule for {dev.type}"

