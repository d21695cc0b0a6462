"""What every converter shares: the registry keyed by transformers' `model_type`, and weight-copy helpers (renames
and concatenations of a checkpoint's tensors, with one clear error for a tensor that is absent). Converters import
this module, never each other."""
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from ..errors import ConfigError
from ..models.config import ModelConfig


@dataclass(frozen=True)
class Converter:
    hf_class: str                                              # e.g. "LlamaForCausalLM"
    config: Callable[[Any], dict]                              # hf config -> ModelConfig fields
    weights: Callable[[dict[str, Tensor], ModelConfig], dict[str, Tensor]]
    # weights(hf_config) -> the function above, for families whose weights depend on config constants (Falcon-H1's
    # muP multipliers are folded into them)
    weights_of_config: Callable[[Any], Callable] | None = None

    def state_dict(self, sd, cfg: ModelConfig, hf_config) -> dict[str, Tensor]:
        """Our state dict from their tensors `sd`, our config and theirs."""
        fn = self.weights if self.weights_of_config is None else self.weights_of_config(hf_config)
        return fn(sd, cfg)


CONVERTERS: dict[str, Converter] = {}                          # keyed by transformers' `model_type`


def register(model_type: str, hf_class: str, config: Callable, weights: Callable | None = None, *,
             weights_of_config: Callable | None = None):
    """`weights(sd, cfg)`, or `weights_of_config(hf_config)` returning it when the weights need config values."""
    CONVERTERS[model_type] = Converter(hf_class, config, weights, weights_of_config)


# preset name -> twin(d_model, n_layers, vocab_size, max_seq_len) -> the transformers config of the same model:
# `presets.get(name, d_model=..., n_layers=...)` is what converting that config gives (tests check it), so
# `hybridlm bench --twins` times both on the same weights
TWINS: dict[str, Callable[..., Any]] = {}


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


class LazyTensor:
    """A tensor of a safetensors file, read only when a converter asks for it (so converting a checkpoint holds one
    copy of its weights, not two)."""

    def __init__(self, path: str, name: str):
        self.path, self.name = path, name

    def load(self) -> Tensor:
        from safetensors import safe_open
        with safe_open(self.path, "pt") as f:
            return f.get_tensor(self.name)


class _Tensors(dict):
    """A checkpoint's tensors under `prefix`, keyed without it; values may be `LazyTensor`s, read on access. Reading an
    absent one is a ConfigError naming its full key: a plain KeyError would name only the stripped tail (e.g.
    'mlp.up_proj.weight', but which layer?)."""

    def __init__(self, sd: dict, prefix: str = ""):
        super().__init__((k[len(prefix):], v) for k, v in dict.items(sd) if k.startswith(prefix))
        self.prefix = getattr(sd, "prefix", "") + prefix

    def __getitem__(self, key: str) -> Tensor:
        v = super().__getitem__(key)
        return v.load() if isinstance(v, LazyTensor) else v

    def __missing__(self, key: str):
        raise ConfigError(f"cannot convert: the checkpoint has no weight {self.prefix + key!r}")

    def get(self, key: str, default=None):
        return self[key] if key in self else default

    def items(self):
        return ((k, self[k]) for k in self)


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
