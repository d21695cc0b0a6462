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
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from ..errors import ConfigError
from ..models.causal_lm import CausalLM
from ..models.config import ModelConfig


@dataclass(frozen=True)
class Converter:
    hf_class: str                                              # e.g. "LlamaForCausalLM"
    config: Callable[[Any], dict]                              # hf config -> ModelConfig fields
    weights: Callable[[dict[str, Tensor], ModelConfig], dict[str, Tensor]]


CONVERTERS: dict[str, Converter] = {}                          # keyed by transformers' `model_type`


def register(model_type: str, hf_class: str, config: Callable, weights: Callable):
    CONVERTERS[model_type] = Converter(hf_class, config, weights)


# ---------------------------------------------------------------------------------------------------
# shared helpers

def _get(cfg, name: str, default=None):
    return getattr(cfg, name, default)


def _unsupported(arch: str, what: str):
    raise ConfigError(f"cannot convert {arch}: {what} is not supported")


def _need(cond: bool, arch: str, what: str):
    if not cond:
        _unsupported(arch, what)


def _activation(arch: str, name: str, where: str) -> str:
    """transformers activation name -> ours; only exact equivalents are accepted."""
    table = {"silu": "silu", "swish": "silu"}
    if name not in table:
        _unsupported(arch, f"{where} activation {name!r} (supported: silu)")
    return table[name]


def _rope_base(arch: str, hf_cfg) -> float:
    """The rotary base of a plain (unscaled, full-dim) RoPE config; scaling variants are refused."""
    params = _get(hf_cfg, "rope_parameters") or {}
    if params and not isinstance(params, dict):
        params = dict(params)
    if params and "rope_type" not in params and all(isinstance(v, dict) for v in params.values()):
        _unsupported(arch, "per-layer-type rope_parameters")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        _unsupported(arch, f"rope_scaling / rope_type {rope_type!r} (only plain RoPE)")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        _unsupported(arch, f"partial_rotary_factor {params['partial_rotary_factor']}")
    base = params.get("rope_theta", _get(hf_cfg, "rope_theta", 10000.0))
    return float(base)


def _tied(hf_cfg) -> bool:
    return bool(_get(hf_cfg, "tie_word_embeddings", False))


class _Tensors(dict):
    """A checkpoint's tensors under `prefix`, keyed without it. Reading an absent one is a ConfigError naming its
    full key: a plain KeyError would name only the stripped tail (e.g. 'mlp.up_proj.weight', but which layer?)."""

    def __init__(self, sd: dict[str, Tensor], prefix: str = ""):
        super().__init__((k[len(prefix):], v) for k, v in sd.items() if k.startswith(prefix))
        self.prefix = getattr(sd, "prefix", "") + prefix

    def __missing__(self, key: str):
        raise ConfigError(f"cannot convert: the checkpoint has no weight {self.prefix + key!r}")


def _copy(out: dict[str, Tensor], prefix: str, s: _Tensors, table: dict[str, str], optional: bool = False):
    """out[prefix + ours] = s[theirs] for each `ours: theirs` of `table` (renames only). With `optional` (biases,
    parameters only some variants have) a tensor `s` lacks is skipped; otherwise it is a ConfigError."""
    for ours, theirs in table.items():
        if not optional or theirs in s:
            out[prefix + ours] = s[theirs]


def _head(sd: _Tensors, cfg: ModelConfig, embed_key: str, norm_key: str) -> dict[str, Tensor]:
    """Embedding, final norm and lm_head entries; with tied embeddings our state dict still names lm_head.weight."""
    emb = sd[embed_key]
    head = emb if cfg.tie_embeddings else sd["lm_head.weight"]
    return {"embed.weight": emb, "norm.weight": sd[norm_key], "lm_head.weight": head}


def _decoder_layers(sd: _Tensors, out: dict[str, Tensor]) -> Iterator[tuple[_Tensors, str, str]]:
    """Llama-style decoder layers `model.layers.{i}.*` (Llama, Doge, DeepSeek): layer i is our attention block 2i
    and MLP block 2i+1. Copies the two pre-norms, then yields (layer i's tensors, "blocks.{2i}.", "blocks.{2i+1}.")."""
    n_layers = sum(1 for k in sd if k.startswith("model.layers.") and k.endswith(".input_layernorm.weight"))
    for i in range(n_layers):
        s = _Tensors(sd, f"model.layers.{i}.")
        a, m = f"blocks.{2 * i}.", f"blocks.{2 * i + 1}."
        _copy(out, a, s, {"norm.weight": "input_layernorm.weight"})
        _copy(out, m, s, {"norm.weight": "post_attention_layernorm.weight"})
        yield s, a, m


def _maybe_bias(out: dict, name: str, *tensors: Tensor | None):
    """Concatenate biases into `name` when the layer has them (all or none)."""
    present = [t is not None for t in tensors]
    if any(present):
        if not all(present):
            raise ConfigError(f"cannot convert: {name} has bias on only some of its fused parts")
        out[name] = torch.cat(tensors, 0)


def _fused_attention(out: dict[str, Tensor], prefix: str, s: _Tensors):
    """self_attn q/k/v projections -> our fused `qkv` (rows [q; k; v]), o_proj -> `out`; biases where present."""
    out[prefix + "qkv.weight"] = torch.cat([s[f"self_attn.{p}_proj.weight"] for p in "qkv"], 0)
    _maybe_bias(out, prefix + "qkv.bias", *(s.get(f"self_attn.{p}_proj.bias") for p in "qkv"))
    _copy(out, prefix, s, {"out.weight": "self_attn.o_proj.weight"})
    _copy(out, prefix, s, {"out.bias": "self_attn.o_proj.bias"}, optional=True)


def _gated_mlp(out: dict[str, Tensor], prefix: str, s: _Tensors):
    """mlp gate/up projections -> our fused `w_in` (rows [gate; up]), down_proj -> `w_out`; biases where present."""
    out[prefix + "w_in.weight"] = torch.cat((s["mlp.gate_proj.weight"], s["mlp.up_proj.weight"]), 0)
    _maybe_bias(out, prefix + "w_in.bias", s.get("mlp.gate_proj.bias"), s.get("mlp.up_proj.bias"))
    _copy(out, prefix, s, {"w_out.weight": "mlp.down_proj.weight"})
    _copy(out, prefix, s, {"w_out.bias": "mlp.down_proj.bias"}, optional=True)


# ---------------------------------------------------------------------------------------------------
# Llama (LlamaForCausalLM) -> layout "(AM)*n"

def llama_config(hf) -> dict:
    arch = "LlamaForCausalLM"
    _need(int(_get(hf, "pretraining_tp", 1) or 1) == 1, arch, f"pretraining_tp {_get(hf, 'pretraining_tp')}")
    act = _activation(arch, _get(hf, "hidden_act", "silu"), "MLP")
    n_heads = hf.num_attention_heads
    n_kv = _get(hf, "num_key_value_heads") or n_heads
    head_dim = _get(hf, "head_dim") or hf.hidden_size // n_heads
    return dict(
        layout=f"(AM)*{hf.num_hidden_layers}", vocab_size=hf.vocab_size, d_model=hf.hidden_size,
        max_seq_len=int(_get(hf, "max_position_embeddings", 2048)), tie_embeddings=_tied(hf),
        norm="rms", norm_eps=float(hf.rms_norm_eps), pos_embedding="rope",
        n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, rope_base=_rope_base(arch, hf),
        rope_interleaved=False, attn_bias=bool(_get(hf, "attention_bias", False)),
        mlp_hidden=hf.intermediate_size, mlp_act=act, mlp_gated=True, mlp_bias=bool(_get(hf, "mlp_bias", False)),
    )


def llama_weights(sd: _Tensors, cfg: ModelConfig) -> dict[str, Tensor]:
    out = _head(sd, cfg, "model.embed_tokens.weight", "model.norm.weight")
    for s, a, m in _decoder_layers(sd, out):
        _fused_attention(out, a + "mixer.", s)
        _gated_mlp(out, m + "mixer.", s)
    return out


# ---------------------------------------------------------------------------------------------------
# Mamba-2 (Mamba2ForCausalLM) -> layout "S*n"

def mamba2_config(hf) -> dict:
    arch = "Mamba2ForCausalLM"
    _activation(arch, _get(hf, "hidden_act", "silu"), "conv")
    lim = tuple(float(v) for v in (_get(hf, "time_step_limit") or (0.0, math.inf)))
    _need(lim == (0.0, math.inf), arch, f"time_step_limit {lim} (only (0, inf))")
    expand = _get(hf, "expand", 2)
    _need(float(expand).is_integer(), arch, f"non-integer expand {expand}")
    expand = int(expand)
    d_inner = expand * hf.hidden_size
    _need(hf.num_heads * hf.head_dim == d_inner, arch,
          f"num_heads*head_dim ({hf.num_heads}*{hf.head_dim}) != expand*hidden_size ({d_inner})")
    return dict(
        layout=f"S*{hf.num_hidden_layers}", vocab_size=hf.vocab_size, d_model=hf.hidden_size,
        max_seq_len=1 << 20,               # no positional limit in Mamba-2; override if needed
        tie_embeddings=_tied(hf), norm="rms", norm_eps=float(hf.layer_norm_epsilon), pos_embedding="none",
        ssd_d_state=hf.state_size, ssd_d_conv=hf.conv_kernel, ssd_expand=expand, ssd_headdim=hf.head_dim,
        ssd_ngroups=hf.n_groups, ssd_chunk_size=int(_get(hf, "chunk_size", 256)),
        ssd_bias=bool(_get(hf, "use_bias", False)), ssd_conv_bias=bool(_get(hf, "use_conv_bias", True)),
        ssd_dt_min=float(_get(hf, "time_step_min", 1e-3)), ssd_dt_max=float(_get(hf, "time_step_max", 0.1)),
    )


# ours (under blocks.{i}.) -> theirs (under backbone.layers.{i}.); in_proj keeps the same [z, xBC, dt] row order
_MAMBA2 = {"norm.weight": "norm.weight", "mixer.in_proj.weight": "mixer.in_proj.weight",
           "mixer.dt_bias": "mixer.dt_bias", "mixer.A_log": "mixer.A_log", "mixer.D": "mixer.D",
           "mixer.norm_weight": "mixer.norm.weight", "mixer.out_proj.weight": "mixer.out_proj.weight"}
_MAMBA2_BIASES = {"mixer.in_proj.bias": "mixer.in_proj.bias", "mixer.out_proj.bias": "mixer.out_proj.bias",
                  "mixer.conv_bias": "mixer.conv1d.bias"}


def mamba2_weights(sd: _Tensors, cfg: ModelConfig) -> dict[str, Tensor]:
    out = _head(sd, cfg, "backbone.embeddings.weight", "backbone.norm_f.weight")
    n_layers = sum(1 for k in sd if k.startswith("backbone.layers.") and k.endswith(".mixer.A_log"))
    for i in range(n_layers):
        s, b = _Tensors(sd, f"backbone.layers.{i}."), f"blocks.{i}."
        _copy(out, b, s, _MAMBA2)
        _copy(out, b, s, _MAMBA2_BIASES, optional=True)
        out[b + "mixer.conv_weight"] = s["mixer.conv1d.weight"].squeeze(1)     # [C, 1, K] -> [C, K]
    return out


register("llama", "LlamaForCausalLM", llama_config, llama_weights)
register("mamba2", "Mamba2ForCausalLM", mamba2_config, mamba2_weights)
from . import convert_deepseek  # noqa: E402,F401  (registers DeepSeek-V3 / V3.2)
from . import convert_doge  # noqa: E402,F401  (registers Doge)


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
        return ModelConfig(**fields)
    except TypeError as e:
        raise ConfigError(str(e)) from None


def to_state_dict(hf_model, **overrides) -> tuple[ModelConfig, dict[str, Tensor]]:
    """(ModelConfig, our state dict) for a transformers model, without building our model. The tensors
    share storage with the transformers model (detach/clone before changing either)."""
    conv = _converter(hf_model)
    cfg = config_from_transformers(hf_model.config, **overrides)
    sd = _Tensors({k: v.detach() for k, v in hf_model.state_dict().items()})
    return cfg, conv.weights(sd, cfg)


def from_transformers(hf_model, **overrides) -> CausalLM:
    """A hybridlm CausalLM computing the same function as `hf_model` (a transformers LlamaForCausalLM or
    Mamba2ForCausalLM): same config, weights copied exactly, same dtype and device, in eval mode.
    Raises ConfigError naming any option we cannot mirror (RoPE scaling, time-step limits, activations,
    unknown classes)."""
    cfg, sd = to_state_dict(hf_model, **overrides)
    p = next(hf_model.parameters())
    model = CausalLM(cfg).to(device=p.device, dtype=p.dtype)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if cfg.tie_embeddings:
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ConfigError(f"cannot convert {type(hf_model).__name__}: missing weights {missing}, "
                          f"unexpected weights {unexpected}")
    return model.eval()
