"""Weight-only quantization of a model, applied from outside it (as torchao's `quantize_`): every eligible
`nn.Linear` is swapped for a `layers.quantized.QuantizedLinear`; the model classes know nothing of it.

Eligible: the linear layers that carry the bulk of the weights (attention, MLP, expert and mixer projections, the
LM head). Kept in float: embeddings, norms, recurrent state and its parameters (A_log, D, dt_bias, convs) and the
small linears that set decays, input gates or routing (`KEEP`), where a rounding error compounds over time or
flips a choice. A module named for quantization that is no linear layer of the model is refused with one InputError
naming it; nothing is swapped then.

A tied LM head is quantized into its own buffers while the embedding keeps the float matrix (a lookup reads one
row; the head reads all of them every token). Weight-shared layers (`X@k`) share one quantized module.
"""
import torch
from torch import nn

from ..errors import InputError
from ..layers.quantized import KernelLinear, QuantizedLinear
from ..ops.quant import check_shape

# last name component -> why it stays in float
KEEP = {
    "router": "routing", "shared_gate": "routing", "queries": "product-key routing (CDMoE)",
    "gate_proj": "Rodimus decay and temperature gates", "beta_down": "Rodimus input gate",
    "beta_up": "Rodimus input gate", "dt_proj": "time steps (decays)", "x_proj": "Mamba-1 time steps and B, C",
    "f_a": "KDA decays", "f_b": "KDA decays", "b_proj": "KDA beta", "in_proj_ba": "Gated DeltaNet beta and decay",
    "kv_b": "MLA's absorbed decode reads it as a matrix", "w": "indexer head weights (top-k choice)",
}
DEFAULT_GROUP = 64


def eligible(model: nn.Module) -> list[str]:
    """Names of the `nn.Linear` modules `quantize_` would swap, in module order."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] not in KEEP]


def quantization_of(model: nn.Module) -> dict | None:
    """{"scheme", "group_size", "modules": [names]} of a quantized model (what config.json records), else None."""
    mods = [(n, m) for n, m in model.named_modules(remove_duplicate=False) if isinstance(m, QuantizedLinear)]
    if not mods:
        return None
    m = mods[0][1]
    return {"quant_method": "hybridlm", "scheme": m.scheme, "group_size": m.group_size, "modules": [n for n, _ in mods]}


def describe(q: dict | None) -> str:
    if q is None:
        return "float"
    return q["scheme"] + (f" (groups of {q['group_size']})" if q.get("group_size") else "")


@torch.no_grad()
def quantize_(model: nn.Module, scheme: str, group_size: int | None = DEFAULT_GROUP,
              modules: list[str] | None = None) -> nn.Module:
    """Swap the eligible linears of `model` (or exactly `modules`) for QuantizedLinear in place; returns `model`.
    Idempotent for the scheme a model already has; another scheme on a quantized model is refused (quantizing
    rounded weights again only adds error). Works on the meta device too (shapes only: a checkpoint's skeleton)."""
    group_size = group_size if scheme == "int4" else None
    have = quantization_of(model)
    if have is not None:
        if (have["scheme"], have["group_size"]) != (scheme, group_size):
            raise InputError(f"the model is already quantized {describe(have)}; it cannot be quantized again as "
                             f"{describe({'scheme': scheme, 'group_size': group_size})}: start from the float "
                             f"checkpoint")
        return model
    names = eligible(model) if modules is None else list(modules)
    found = dict(model.named_modules(remove_duplicate=False))
    for n in names:
        lin = found.get(n)
        if not isinstance(lin, nn.Linear):
            raise InputError(f"cannot quantize {n!r}: not a linear layer of this model")
        why = check_shape(scheme, lin.out_features, lin.in_features, group_size)
        if why:
            raise InputError(f"--quantize {scheme} cannot serve {n} [{lin.out_features} x {lin.in_features}]: {why}")
    done: dict[int, QuantizedLinear] = {}          # id(weight) -> its quantized module (shared layers share it)
    for n in names:
        lin = found[n]
        q = done.get(id(lin.weight))
        if q is None:
            q = done[id(lin.weight)] = QuantizedLinear.from_linear(lin, scheme, group_size)
        parent, _, leaf = n.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, q)
    return model


def use_cpu_kernels_(model: nn.Module) -> nn.Module:
    """Route the decode-sized CPU calls of every float `nn.Linear` of `model` through the project's matrix-vector
    kernel (layers.quantized.KernelLinear, a class swap: no copy, the same state dict); quantized layers use theirs
    already. A no-op where the kernels cannot be built (ops/cpu_kernels.py says why once). Returns `model`."""
    from ..ops import cpu_kernels
    if cpu_kernels.available():
        for m in model.modules():
            if type(m) is nn.Linear:
                m.__class__ = KernelLinear
    return model
