"""hybridlm's vLLM plugin: `vllm serve RUN` and `vllm.LLM(model=RUN)` open a hybridlm run or export directory.

Installed with `pip install hybridlm[vllm]` (scripts/setup-vllm.sh), vLLM finds `register` through the
`vllm.general_plugins` entry point in every process it starts, before it reads a config:

  - config.json's model_type "hybridlm" -> config.HybridLMVLLMConfig (for the transformers vLLM brings), and
    config.ArchConvertor (vLLM's reading of its architecture: MLA on when L runs on vLLM's MLA);
  - architecture "HybridLMForCausalLM" -> model.HybridLMForCausalLM (imported by vLLM when a model needs it), and
    its config hook config.ConfigHook;
  - the mamba backend of our own recurrent layers (R, G, K, B: state.py).

Nothing else in hybridlm imports this package; it imports vLLM, and from hybridlm only the layers, models, ops
and the cache (never hybridlm.hf, which is written for the hf extra's transformers).
"""


def register():
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.transformers_utils.config import _CONFIG_REGISTRY
    from vllm.transformers_utils.model_arch_config_convertor import MODEL_ARCH_CONFIG_CONVERTORS
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    from .config import ArchConvertor, ConfigHook, HybridLMVLLMConfig
    from .state import BACKEND
    _CONFIG_REGISTRY[HybridLMVLLMConfig.model_type] = HybridLMVLLMConfig
    MODEL_ARCH_CONFIG_CONVERTORS[HybridLMVLLMConfig.model_type] = ArchConvertor
    if BACKEND not in MambaAttentionBackendEnum.__members__:
        MambaAttentionBackendEnum.register(BACKEND, "hybridlm.vllm.state.RecurrentBackend")
    if "HybridLMForCausalLM" not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model("HybridLMForCausalLM", "hybridlm.vllm.model:HybridLMForCausalLM")
    MODELS_CONFIG_MAP["HybridLMForCausalLM"] = ConfigHook
