"""Register hybridlm with transformers' Auto classes without importing transformers ourselves.

`import hybridlm` calls `install()`: if transformers is already imported, `register()` runs now; otherwise a one-shot
import hook runs it right after transformers' own `__init__` has run, so `AutoModelForCausalLM.from_pretrained(dir)`
finds model_type "hybridlm" in any program that imported hybridlm, and `import hybridlm` stays as fast as before and
works without transformers installed.
"""
import importlib.abc
import importlib.util
import sys
import warnings


def register():
    """AutoConfig / AutoModelForCausalLM learn model_type "hybridlm" (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from .modeling import HybridLMConfig, HybridLMForCausalLM
    AutoConfig.register("hybridlm", HybridLMConfig, exist_ok=True)
    AutoModelForCausalLM.register(HybridLMConfig, HybridLMForCausalLM, exist_ok=True)


def _register_quietly():
    modeling = sys.modules.get(__package__ + ".modeling")
    if modeling is not None and not hasattr(modeling, "HybridLMForCausalLM"):
        return      # transformers was first imported by hf/modeling.py itself, which registers when it is complete
    try:
        register()
    except Exception as e:  # an incompatible transformers must not break the user's `import transformers`
        warnings.warn(f"hybridlm: could not register with transformers ({type(e).__name__}: {e}); "
                      "hybridlm.hf.modeling needs transformers 5.x", stacklevel=2)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds transformers' real spec and wraps its loader so that `register()` follows its execution."""

    def find_spec(self, name, path=None, target=None):
        if name != "transformers":
            return None
        sys.meta_path.remove(self)              # one shot; and lets the lookup below reach the real finders
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _register_quietly()
        spec.loader.exec_module = exec_module
        return spec


def install():
    if "transformers" in sys.modules:
        _register_quietly()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
