"""hybridlm: efficient hybrid language models (attention, SSD / Mamba-2, Rodimus, mixture of experts)
built from one layout string."""
from .cache import InferenceCache
from .errors import CheckpointError, ConfigError, HybridLMError, InputError
from .models import CausalLM, CausalLMOutput, ModelConfig, presets
from .hf.auto import install as _install_transformers_hook

_install_transformers_hook()   # AutoModelForCausalLM knows "hybridlm" once transformers is imported (hf/auto.py)

__version__ = "0.1.0"
__all__ = ["CausalLM", "CausalLMOutput", "ModelConfig", "InferenceCache", "presets", "HybridLMError",
           "ConfigError", "InputError", "CheckpointError"]
