"""transformers' kernel fallbacks made device-aware: its hybrid models (Qwen3-Next, Kimi-Linear, Mamba-2, ...) bind
an installed package's kernel (FLA's `chunk_gated_delta_rule` / `chunk_kda`, mamba_ssm's, causal_conv1d's) when
their modeling module is imported and then call it on CPU tensors too, where FLA's Triton kernels fail with
`RuntimeError: 0 active drivers`. `torch_fallback_on_cpu()` routes such calls on CPU tensors to transformers' own
PyTorch function (what it runs when the package is absent); CUDA tensors keep the package's kernel. Our
comparisons with transformers (tests, `bench --suite twins`) call it before building transformers' models."""
import functools
import inspect
import sys

import torch

_HUB = "hub_kernels.py"     # transformers/integrations/hub_kernels.py: where the fallback wrappers are defined


def _on_device(fast, torch_function):
    """fast(*a, **kw) when a tensor argument is on CUDA, else torch_function with the keywords it takes."""
    params = inspect.signature(torch_function).parameters

    @functools.wraps(torch_function)
    def call(*args, **kwargs):
        if any(isinstance(a, torch.Tensor) and a.is_cuda for a in (*args, *kwargs.values())):
            return fast(*args, **kwargs)
        return torch_function(*args, **{k: v for k, v in kwargs.items() if k in params})
    call.hybridlm_on_device = True
    return call


def torch_fallback_on_cpu() -> None:
    """Patch transformers (idempotent): the wrappers of modeling modules already imported, and the decorator
    (`use_kernel_func_from_hub_with_fallback`) for those imported later. A no-op without transformers."""
    try:
        import transformers.integrations as integrations
        from transformers.integrations import hub_kernels
    except ImportError:
        return
    original = hub_kernels.use_kernel_func_from_hub_with_fallback
    if not getattr(original, "hybridlm_on_device", False):
        def decorator_factory(*args, **kwargs):
            wrap = original(*args, **kwargs)
            return lambda torch_function: _on_device(wrap(torch_function), torch_function)
        decorator_factory.hybridlm_on_device = True
        hub_kernels.use_kernel_func_from_hub_with_fallback = decorator_factory
        integrations.use_kernel_func_from_hub_with_fallback = decorator_factory
    for name, module in list(sys.modules.items()):
        if not (name.startswith("transformers.models.") and ".modeling_" in name) or module is None:
            continue
        for attr, fn in list(vars(module).items()):
            if (inspect.isfunction(fn) and fn.__code__.co_filename.endswith(_HUB) and hasattr(fn, "__wrapped__")
                    and not getattr(fn, "hybridlm_on_device", False)):
                setattr(module, attr, _on_device(fn, inspect.unwrap(fn)))
