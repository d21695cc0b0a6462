"""Converters from Hugging Face `transformers` causal LMs to hybridlm models.

    from hybridlm.hf import from_transformers
    model = from_transformers(LlamaForCausalLM.from_pretrained(...))    # -> hybridlm.CausalLM

One `Converter` per architecture, found by the transformers config's `model_type`:
  - `config(hf_config) -> dict` of ModelConfig fields (raises ConfigError on options we cannot mirror
    exactly), and
  - `weights(hf_state_dict, ModelConfig) -> our state dict` (pure tensor re-arrangement, no copies of the
    numbers' values).
New architectures (Doge, DeepSeek-V3, ...) add one pair of functions and one `register(...)` line.
transformers is an optional dependency: nothing here imports it.
"""
import torch
from torch import Tensor

from ..errors import ConfigError
from ..models.causal_lm import CausalLM
from ..models.config import ModelConfig, quiet_unread, warn_unread
from .common import (CONVERTERS, Converter, Tensors, convert_weights, copy_renamed, decoder_layers, fused_attention,
                     gated_mlp, head_tensors, hf_activation, hf_get, hf_rope_base, hf_tied, mamba2_fields, mamba2_mixer,
                     register, require)


# ---------------------------------------------------------------------------------------------------
# Llama (LlamaForCausalLM) -> layout "(AM)*n"

def llama_config(hf) -> dict:
    arch = "LlamaForCausalLM"
    require(int(hf_get(hf, "pretraining_tp", 1) or 1) == 1, arch, f"pretraining_tp {hf_get(hf, 'pretraining_tp')}")
    act = hf_activation(arch, hf_get(hf, "hidden_act", "silu"), "MLP")
    n_heads = hf.num_attention_heads
    n_kv = hf_get(hf, "num_key_value_heads") or n_heads
    head_dim = hf_get(hf, "head_dim") or hf.hidden_size // n_heads
    return dict(
        layout=f"(AM)*{hf.num_hidden_layers}", vocab_size=hf.vocab_size, d_model=hf.hidden_size,
        max_seq_len=int(hf_get(hf, "max_position_embeddings", 2048)), tie_embeddings=hf_tied(hf),
        norm="rms", norm_eps=float(hf.rms_norm_eps), pos_embedding="rope",
        n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, rope_base=hf_rope_base(arch, hf),
        rope_interleaved=False, attn_bias=bool(hf_get(hf, "attention_bias", False)),
        mlp_hidden=hf.intermediate_size, mlp_act=act, mlp_gated=True, mlp_bias=bool(hf_get(hf, "mlp_bias", False)),
    )


def llama_weights(sd: Tensors, cfg: ModelConfig) -> dict[str, Tensor]:
    out = head_tensors(sd, cfg, "model.embed_tokens.weight", "model.norm.weight")
    for s, a, m in decoder_layers(sd, out):
        fused_attention(out, a + "mixer.", s)
        gated_mlp(out, m + "mixer.", s)
    return out


# ---------------------------------------------------------------------------------------------------
# Mamba-2 (Mamba2ForCausalLM) -> layout "S*n"

def mamba2_config(hf) -> dict:
    arch = "Mamba2ForCausalLM"
    expand = hf_get(hf, "expand", 2)
    require(float(expand).is_integer(), arch, f"non-integer expand {expand}")
    d_inner = int(expand) * hf.hidden_size
    require(hf.num_heads * hf.head_dim == d_inner, arch,
          f"num_heads*head_dim ({hf.num_heads}*{hf.head_dim}) != expand*hidden_size ({d_inner})")
    return dict(
        layout=f"S*{hf.num_hidden_layers}", vocab_size=hf.vocab_size, d_model=hf.hidden_size,
        max_seq_len=1 << 20,               # no positional limit in Mamba-2; override if needed
        tie_embeddings=hf_tied(hf), norm="rms", norm_eps=float(hf.layer_norm_epsilon), pos_embedding="none",
        ssd_dt_min=float(hf_get(hf, "time_step_min", 1e-3)), ssd_dt_max=float(hf_get(hf, "time_step_max", 0.1)),
        **mamba2_fields(arch, hf, d_model=hf.hidden_size, n_heads=hf.num_heads, head_dim=hf.head_dim,
                         n_groups=hf.n_groups, d_state=hf.state_size, d_conv=hf.conv_kernel,
                         chunk_size=int(hf_get(hf, "chunk_size", 256)),
                         conv_bias=bool(hf_get(hf, "use_conv_bias", True)),
                         proj_bias=bool(hf_get(hf, "use_bias", False)), act=hf_get(hf, "hidden_act", "silu")),
    )


def mamba2_weights(sd: Tensors, cfg: ModelConfig) -> dict[str, Tensor]:
    out = head_tensors(sd, cfg, "backbone.embeddings.weight", "backbone.norm_f.weight")
    n_layers = sum(1 for k in sd if k.startswith("backbone.layers.") and k.endswith(".mixer.A_log"))
    for i in range(n_layers):
        s, b = Tensors(sd, f"backbone.layers.{i}."), f"blocks.{i}."
        copy_renamed(out, b, s, {"norm.weight": "norm.weight"})
        mamba2_mixer(out, b + "mixer.", Tensors(s, "mixer."))
    return out


register("llama", "LlamaForCausalLM", llama_config, llama_weights)
register("mamba2", "Mamba2ForCausalLM", mamba2_config, mamba2_weights)
# the other families register themselves when imported (each uses .common and models/, never this module)
from . import (convert_bamba, convert_deepseek, convert_doge, convert_falcon_h1,  # noqa: E402,F401
               convert_granitemoehybrid, convert_kimi_linear, convert_lfm2, convert_mamba1, convert_nemotron_h,
               convert_qwen3_next, convert_zamba2)


# ---------------------------------------------------------------------------------------------------
# public API

def _converter(hf_model) -> Converter:
    cls = type(hf_model).__name__
    mt = getattr(getattr(hf_model, "config", None), "model_type", None)
    conv = CONVERTERS.get(mt)
    if conv is None or conv.hf_class != cls:
        known = ", ".join(c.hf_class for c in CONVERTERS.values())
        raise ConfigError(f"cannot convert {cls} (model_type {mt!r}): supported classes are {known}")
    return conv


def config_from_transformers(hf_config, **overrides) -> ModelConfig:
    """The ModelConfig mirroring a transformers config (keyed by its `model_type`); `overrides` replace
    fields (for example `max_seq_len` or `ssd_chunk_size`, which do not change the function computed)."""
    mt = getattr(hf_config, "model_type", None)
    if mt not in CONVERTERS:
        raise ConfigError(f"cannot convert model_type {mt!r}: supported are {', '.join(sorted(CONVERTERS))}")
    fields = CONVERTERS[mt].config(hf_config)
    fields.update(overrides)
    try:
        with quiet_unread():       # a family's fields, whatever letters this checkpoint's layout has
            cfg = ModelConfig(**fields)
    except TypeError as e:
        raise ConfigError(str(e)) from None
    warn_unread(cfg, overrides)
    return cfg


def to_state_dict(hf_model, **overrides) -> tuple[ModelConfig, dict[str, Tensor]]:
    """(ModelConfig, our state dict) for a transformers model, without building our model. The tensors
    share storage with the transformers model (detach/clone before changing either)."""
    _converter(hf_model)                                     # an unsupported class: one clear error
    cfg = config_from_transformers(hf_model.config, **overrides)
    sd = Tensors({k: v.detach() for k, v in hf_model.state_dict().items()})
    return cfg, convert_weights(hf_model.config, sd, cfg)


def from_transformers(hf_model, **overrides) -> CausalLM:
    """A hybridlm CausalLM computing the same function as `hf_model` (a transformers LlamaForCausalLM or
    Mamba2ForCausalLM): same config, weights copied exactly, same dtype and device, in eval mode.
    Raises ConfigError naming any option we cannot mirror (RoPE scaling, time-step limits, activations,
    unknown classes)."""
    cfg, sd = to_state_dict(hf_model, **overrides)
    p = next(hf_model.parameters())
    with torch.device("meta"):       # no init: every weight comes from hf_model
        model = CausalLM(cfg)
    copies = {k: v.to(device=p.device, dtype=p.dtype, memory_format=torch.contiguous_format, copy=True)
              for k, v in sd.items()}
    missing, unexpected = model.load_state_dict(copies, strict=False, assign=True)
    if cfg.tie_embeddings:
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ConfigError(f"cannot convert {type(hf_model).__name__}: missing weights {missing}, "
                          f"unexpected weights {unexpected}")
    model.tie_weights()              # assign made one tensor per name
    return model.eval()
