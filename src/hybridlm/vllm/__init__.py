"""hybridlm's vLLM plugin: `vllm serve RUN` and `vllm.LLM(model=RUN)` open a hybridlm run or export directory.

Installed with `pip install hybridlm[vllm]` (scripts/setup-vllm.sh), vLLM finds `register` through the
`vllm.general_plugins` entry point in every process it starts, before it reads a config:

  - config.json's model_type "hybridlm" -> config.HybridLMVLLMConfig (for the transformers vLLM brings);
  - architecture "HybridLMForCausalLM" -> model.HybridLMForCausalLM (imported by vLLM when a model needs it);
  - the mamba backend of our own recurrent layers (R, G, K, B: state.py).

Nothing else in hybridlm imports this package; it imports vLLM, and from hybridlm only the layers, models, ops
and the cache (never hybridlm.hf, which is written for the hf extra's transformers).
"""


def register():
    from vllm import ModelRegistry
    from vllm.transformers_utils.config import _CONFIG_REGISTRY
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    from .config import HybridLMVLLMConfig
    from .state import BACKEND
    _CONFIG_REGISTRY[HybridLMVLLMConfig.model_type] = HybridLMVLLMConfig
    if BACKEND not in MambaAttentionBackendEnum.__members__:
        MambaAttentionBackendEnum.register(BACKEND, "hybridlm.vllm.state.RecurrentBackend")
    if "HybridLMForCausalLM" not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model("HybridLMForCausalLM", "hybridlm.vllm.model:HybridLMForCausalLM")
