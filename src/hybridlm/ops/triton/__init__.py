"""Our own Triton kernels for the GPU fast path (optional: `pip install hybridlm[gpu]`).

    ssd_chunked_triton   chunked SSD (Mamba-2), forward and backward       (ops/triton/ssd.py)
    gla_chunked_triton   chunked gated linear attention, vector decay        (ops/triton/gla.py)
    expert_neurons_triton  CDMoE single-neuron experts, gathered and summed  (ops/triton/cdmoe.py)

Triton is imported lazily: importing hybridlm never needs it. `ops.ssd.ssd_chunked`, `ops.gla.gla_chunked`
and `ops.moe.expert_neurons` call these automatically for CUDA tensors when `enabled()`; CPU tensors keep the
PyTorch path. Under TRITON_INTERPRET=1 the entry points also run on CPU tensors (that is how the tests check
them without a GPU).
HYBRIDLM_TRITON=0 turns the automatic dispatch off. The entry points are opaque to torch.compile (a graph
break per call): the kernels are already fused, and tracing them is not what a compiled model needs to gain.
"""
import contextlib
import functools
import os

import torch
import torch.nn.functional as F

# the activations the CDMoE kernel implements, by the callables the layers pass (layers/mlp.py ACTIVATIONS)
CDMOE_ACTS = {F.silu: "silu", F.relu: "relu", torch.relu: "relu", F.gelu: "gelu"}


@functools.cache
def available() -> bool:
    """True when triton imports (it is an optional extra)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def disabled():
    """The PyTorch ops inside (HYBRIDLM_TRITON=0), whatever the variable was before: references and comparisons."""
    old = os.environ.get("HYBRIDLM_TRITON")
    os.environ["HYBRIDLM_TRITON"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["HYBRIDLM_TRITON"]
        else:
            os.environ["HYBRIDLM_TRITON"] = old


def enabled(*tensors: torch.Tensor) -> bool:
    """Dispatch test for the ops: every tensor on CUDA in float32/bf16/fp16, triton importable, and
    HYBRIDLM_TRITON not set to 0."""
    if os.environ.get("HYBRIDLM_TRITON", "1") == "0":
        return False
    if not all(t.is_cuda and t.dtype in (torch.float32, torch.bfloat16, torch.float16) for t in tensors):
        return False
    return available()


@torch.compiler.disable
def ssd_chunked_triton(*args, **kwargs):
    from .ssd import ssd_chunked_triton as f
    return f(*args, **kwargs)


@torch.compiler.disable
def gla_chunked_triton(*args, **kwargs):
    from .gla import gla_chunked_triton as f
    return f(*args, **kwargs)


@torch.compiler.disable
def expert_neurons_triton(*args, **kwargs):
    from .cdmoe import expert_neurons_triton as f
    return f(*args, **kwargs)
