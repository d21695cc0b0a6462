"""Weight-only quantization of a model, applied from outside it (as torchao's `quantize_`): every eligible
`nn.Linear` is swapped for a `layers.quantized.QuantizedLinear`, and every stack of routed experts' weights (a module's
`EXPERT_WEIGHTS`, [E, d_in, d_out] Parameters) for a `layers.quantized.QuantizedExperts` under the same name,
quantized per expert; the model classes know nothing of it beyond that name list.

Eligible: the linear layers that carry the bulk of the weights (attention, MLP, expert and mixer projections, the
LM head) and the routed experts. Kept in float: embeddings, norms, recurrent state and its parameters (A_log, D, dt_bias, convs) and the
small linears that set decays, input gates or routing (`KEEP`), where a rounding error compounds over time or
flips a choice. A module named for quantization that is no linear layer of the model is refused with one InputError
naming it; nothing is swapped then.

A tied LM head is quantized into its own buffers while the embedding keeps the float matrix (a lookup reads one
row; the head reads all of them every token). Weight-shared layers (`X@k`) share one quantized module.
"""
import warnings

import torch
from torch import nn

from ..errors import InputError
from ..layers.quantized import KernelLinear, QuantizedExperts, QuantizedLinear
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


def _experts(model: nn.Module) -> list[str]:
    """Names of the float routed-expert weights ([E, d_in, d_out] Parameters a module lists in EXPERT_WEIGHTS)."""
    return [f"{n}.{a}" if n else a for n, m in model.named_modules() for a in getattr(m, "EXPERT_WEIGHTS", ())
            if isinstance(getattr(m, a, None), nn.Parameter)]


def eligible(model: nn.Module) -> list[str]:
    """Names of the `nn.Linear` modules and routed-expert weights `quantize_` would swap, in module order."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] not in KEEP] \
        + _experts(model)


def _shape(model: nn.Module, name: str) -> tuple[int, int] | None:
    """(out_features, in_features) of the linear layer or of one expert of the expert weights `name`; None if it is
    neither."""
    parent, _, leaf = name.rpartition(".")
    try:
        owner = model.get_submodule(parent) if parent else model
    except AttributeError:
        return None
    t = getattr(owner, leaf, None)
    if isinstance(t, nn.Linear):
        return t.out_features, t.in_features
    if leaf in getattr(owner, "EXPERT_WEIGHTS", ()) and isinstance(t, nn.Parameter) and t.dim() == 3:
        return t.shape[2], t.shape[1]
    return None


def quantization_of(model: nn.Module) -> dict | None:
    """{"scheme", "group_size", "modules": [names]} of a quantized model (what config.json records), else None."""
    mods = [(n, m) for n, m in model.named_modules(remove_duplicate=False)
            if isinstance(m, (QuantizedLinear, QuantizedExperts))]
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
    for n in names:
        shape = _shape(model, n)
        if shape is None:
            raise InputError(f"cannot quantize {n!r}: not a linear layer of this model")
        why = check_shape(scheme, *shape, group_size)
        if why:
            raise InputError(f"--quantize {scheme} cannot serve {n} [{shape[0]} x {shape[1]}]: {why}")
    done: dict[int, nn.Module] = {}          # id(weight) -> its quantized module (shared layers share it)
    for n in names:
        parent, _, leaf = n.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        t = getattr(owner, leaf)
        w = t.weight if isinstance(t, nn.Linear) else t
        q = done.get(id(w))
        if q is None:
            q = done[id(w)] = (QuantizedLinear.from_linear(t, scheme, group_size) if isinstance(t, nn.Linear)
                               else QuantizedExperts.from_weight(t, scheme, group_size))
        if not isinstance(t, nn.Linear):
            delattr(owner, leaf)                 # a Parameter's name becomes a module's
        setattr(owner, leaf, q)
    return model


def use_cpu_kernels_(model: nn.Module, enable: bool = True) -> nn.Module:
    """Route the decode-sized CPU calls (no gradient) of every float `nn.Linear` of `model` through the project's
    matrix-vector kernel (layers.quantized.KernelLinear, a class swap: no copy, the same state dict), and lay the
    float routed experts out for it (`kernel_layout_`: the same values, transposed in memory); quantized layers use
    the kernels already. Calls with gradient compute as before. `enable=False` undoes both. A no-op where the kernels
    cannot be built (ops/cpu_kernels.py says why once) or HYBRIDLM_CPU_KERNELS=0. Returns `model`."""
    from ..ops import cpu_kernels
    if enable and not cpu_kernels.available():
        return model
    for m in model.modules():
        if enable and type(m) is nn.Linear:
            m.__class__ = KernelLinear
        elif not enable and type(m) is KernelLinear:
            m.__class__ = nn.Linear
        if hasattr(m, "kernel_layout_"):
            m.kernel_layout_(enable)
    return model


def cpu_kernels_by_default_(model: nn.Module) -> nn.Module:
    """What decoding calls on its own (`CausalLM.stream` / `generate`, transformers' `generate` on a hybridlm model):
    `use_cpu_kernels_` for a model on a CPU, silently where the kernels cannot be built (the user asked for no
    kernels: PyTorch's path, as before). HYBRIDLM_CPU_KERNELS=0 keeps them off. Training is unaffected: the kernels
    serve only calls without gradient, and a training forward puts the experts' layout back first."""
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cpu":
        return model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return use_cpu_kernels_(model)
