"""What every converter shares: the registry keyed by transformers' `model_type`, and weight-copy helpers (renames
and concatenations of a checkpoint's tensors, with one clear error for a tensor that is absent). Converters import
this module, never each other; a block several families share (the Mamba-2 mixer, stacked routed experts) is copied
by one helper here. A converter whose weights need the transformers config (constant multipliers folded into
weights: Falcon-H1, Granite) registers `with_config=True`, and `convert_weights` then passes that config."""
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
    with_config: bool = False       # weights(sd, cfg, hf_config): constants to fold into the weights (Granite)


CONVERTERS: dict[str, Converter] = {}                          # keyed by transformers' `model_type`


def register(model_type: str, hf_class: str, config: Callable, weights: Callable, *, with_config: bool = False):
    CONVERTERS[model_type] = Converter(hf_class, config, weights, with_config)


def convert_weights(hf_config, sd, cfg: ModelConfig) -> dict[str, Tensor]:
    """Our state dict from a checkpoint's tensors `sd`, by the converter of `hf_config.model_type`."""
    conv = CONVERTERS[hf_config.model_type]
    return conv.weights(sd, cfg, hf_config) if conv.with_config else conv.weights(sd, cfg)


# preset name -> twin(d_model, n_layers, vocab_size, max_seq_len) -> the transformers config of the same model:
# `presets.get(name, d_model=..., n_layers=...)` is what converting that config gives (tests check it), so
# `hybridlm bench --suite twins` times both on the same weights
TWINS: dict[str, Callable[..., Any]] = {}


# ---------------------------------------------------------------------------------------------------
# shared helpers

def hf_get(cfg, name: str, default=None):
    return getattr(cfg, name, default)


def unsupported(arch: str, what: str):
    raise ConfigError(f"cannot convert {arch}: {what} is not supported")


def require(cond: bool, arch: str, what: str):
    if not cond:
        unsupported(arch, what)


def hf_activation(arch: str, name: str, where: str) -> str:
    """transformers activation name -> ours; only exact equivalents are accepted."""
    table = {"silu": "silu", "swish": "silu", "relu2": "relu2"}
    if name not in table:
        unsupported(arch, f"{where} activation {name!r} (supported: {', '.join(sorted(table))})")
    return table[name]


def require_silu(arch: str, name: str, where: str) -> str:
    """"silu" for a transformers activation that also drives a short conv (ours always SiLU there): anything else is
    refused, naming `where` (e.g. "hidden_act (MLP and conv)")."""
    require(name in ("silu", "swish"), arch, f"{where} activation {name!r} (supported: silu; the conv is always SiLU)")
    return "silu"


def hf_rope_base(arch: str, hf_cfg, *, allow_partial: bool = False) -> float:
    """The rotary base of a plain (unscaled, full-dim unless `allow_partial`) RoPE config; scaling variants are
    refused."""
    params = hf_get(hf_cfg, "rope_parameters") or {}
    if params and not isinstance(params, dict):
        params = dict(params)
    if params and "rope_type" not in params and all(isinstance(v, dict) for v in params.values()):
        unsupported(arch, "per-layer-type rope_parameters")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        unsupported(arch, f"rope_scaling / rope_type {rope_type!r} (only plain RoPE)")
    if not allow_partial and float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        unsupported(arch, f"partial_rotary_factor {params['partial_rotary_factor']}")
    base = params.get("rope_theta", hf_get(hf_cfg, "rope_theta", 10000.0))
    return float(base)


def hf_rope_partial(arch: str, hf_cfg, head_dim: int) -> tuple[float, int]:
    """(base, rotary channels per head) of a plain RoPE config that may rotate only the first
    `partial_rotary_factor` · head_dim channels of each head (Qwen3-Next, GLM, Phi)."""
    params = dict(hf_get(hf_cfg, "rope_parameters") or {})
    factor = float(params.get("partial_rotary_factor", hf_get(hf_cfg, "partial_rotary_factor", 1.0)))
    dim = int(head_dim * factor)
    require(0 < dim <= head_dim and dim % 2 == 0, arch,
          f"partial_rotary_factor {factor} (rotary dim {dim} of head_dim {head_dim} must be even and > 0)")
    return hf_rope_base(arch, hf_cfg, allow_partial=True), dim


def hf_tied(hf_cfg) -> bool:
    return bool(hf_get(hf_cfg, "tie_word_embeddings", False))


class LazyTensor:
    """A tensor of a safetensors file, read only when a converter asks for it (so converting a checkpoint holds one
    copy of its weights, not two)."""

    def __init__(self, path: str, name: str):
        self.path, self.name = path, name

    def load(self) -> Tensor:
        from safetensors import safe_open
        with safe_open(self.path, "pt") as f:
            return f.get_tensor(self.name)


class Tensors(dict):
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


def copy_renamed(out: dict[str, Tensor], prefix: str, s: Tensors, table: dict[str, str], optional: bool = False):
    """out[prefix + ours] = s[theirs] for each `ours: theirs` of `table` (renames only). With `optional` (biases,
    parameters only some variants have) a tensor `s` lacks is skipped; otherwise it is a ConfigError."""
    for ours, theirs in table.items():
        if not optional or theirs in s:
            out[prefix + ours] = s[theirs]


def head_tensors(sd: Tensors, cfg: ModelConfig, embed_key: str, norm_key: str) -> dict[str, Tensor]:
    """Embedding, final norm and lm_head entries; with tied embeddings our state dict still names lm_head.weight."""
    emb = sd[embed_key]
    head = emb if cfg.tie_embeddings else sd["lm_head.weight"]
    return {"embed.weight": emb, "norm.weight": sd[norm_key], "lm_head.weight": head}


def decoder_layers(sd: Tensors, out: dict[str, Tensor], mixer_norm: str = "input_layernorm",
                    ff_norm: str = "post_attention_layernorm") -> Iterator[tuple[Tensors, str, str]]:
    """Decoder layers `model.layers.{i}.*` of a token mixer then a channel mixer (Llama, Doge, DeepSeek, Bamba, Granite,
    Jamba, Falcon-H1, LFM2, ...): layer i is our block 2i and block 2i+1. Copies the two pre-norms (named
    `mixer_norm`, `ff_norm`), then yields (layer i's tensors, "blocks.{2i}.", "blocks.{2i+1}.")."""
    n_layers = sum(1 for k in sd if k.startswith("model.layers.") and k.endswith(f".{mixer_norm}.weight"))
    for i in range(n_layers):
        s = Tensors(sd, f"model.layers.{i}.")
        a, m = f"blocks.{2 * i}.", f"blocks.{2 * i + 1}."
        copy_renamed(out, a, s, {"norm.weight": f"{mixer_norm}.weight"})
        copy_renamed(out, m, s, {"norm.weight": f"{ff_norm}.weight"})
        yield s, a, m


def maybe_bias(out: dict, name: str, *tensors: Tensor | None):
    """Concatenate biases into `name` when the layer has them (all or none)."""
    present = [t is not None for t in tensors]
    if any(present):
        if not all(present):
            raise ConfigError(f"cannot convert: {name} has bias on only some of its fused parts")
        out[name] = torch.cat(tensors, 0)


def fused_attention(out: dict[str, Tensor], prefix: str, s: Tensors, name: str = "self_attn"):
    """`name` q/k/v projections -> our fused `qkv` (rows [q; k; v]), o_proj -> `out`; biases where present."""
    out[prefix + "qkv.weight"] = torch.cat([s[f"{name}.{p}_proj.weight"] for p in "qkv"], 0)
    maybe_bias(out, prefix + "qkv.bias", *(s.get(f"{name}.{p}_proj.bias") for p in "qkv"))
    copy_renamed(out, prefix, s, {"out.weight": f"{name}.o_proj.weight"})
    copy_renamed(out, prefix, s, {"out.bias": f"{name}.o_proj.bias"}, optional=True)


def gated_mlp(out: dict[str, Tensor], prefix: str, s: Tensors, name: str = "mlp"):
    """`name` gate/up projections -> our fused `w_in` (rows [gate; up]), down_proj -> `w_out`; biases where present."""
    out[prefix + "w_in.weight"] = torch.cat((s[f"{name}.gate_proj.weight"], s[f"{name}.up_proj.weight"]), 0)
    maybe_bias(out, prefix + "w_in.bias", s.get(f"{name}.gate_proj.bias"), s.get(f"{name}.up_proj.bias"))
    copy_renamed(out, prefix, s, {"w_out.weight": f"{name}.down_proj.weight"})
    copy_renamed(out, prefix, s, {"w_out.bias": f"{name}.down_proj.bias"}, optional=True)


def mamba2_mixer(out: dict[str, Tensor], prefix: str, s: Tensors, scale: float = 1.0):
    """A transformers Mamba-2 mixer (Mamba2, Bamba, Nemotron-H, Granite-4.0: `in_proj` rows [gate, xBC, dt], a
    depthwise `conv1d`, `dt_bias`, `A_log`, `D`, the gated `norm`, `out_proj`) -> our Mamba2 under `prefix`; `s` holds
    the mixer's tensors. `scale` multiplies out_proj (a folded residual multiplier)."""
    copy_renamed(out, prefix, s, {"in_proj.weight": "in_proj.weight", "dt_bias": "dt_bias", "A_log": "A_log", "D": "D",
                           "norm_weight": "norm.weight"})
    copy_renamed(out, prefix, s, {"in_proj.bias": "in_proj.bias", "conv.bias": "conv1d.bias"}, optional=True)
    out[prefix + "conv.weight"] = s["conv1d.weight"].squeeze(1)               # [C, 1, K] -> [C, K]
    for p in ("weight", "bias"):
        if f"out_proj.{p}" in s:
            out[prefix + f"out_proj.{p}"] = scaled(s[f"out_proj.{p}"], scale)


def mamba2_fields(arch: str, hf, *, d_model: int, n_heads: int, head_dim: int, n_groups: int, d_state: int,
                   d_conv: int, chunk_size: int, conv_bias: bool, proj_bias: bool, act: str,
                   dt_limit: tuple | None = None) -> dict:
    """ModelConfig fields of the S letter for a transformers Mamba-2 mixer of these sizes; the dt clamp (`dt_limit`,
    else the config's `time_step_limit`) becomes ssd_dt_limit (None when it is (0, inf))."""
    require_silu(arch, act, "Mamba")
    lim = hf_get(hf, "time_step_limit") if dt_limit is None else dt_limit
    lim = (0.0, float("inf")) if lim is None else tuple(float(v) for v in lim)
    require(len(lim) == 2 and 0 <= lim[0] < lim[1], arch, f"time_step_limit {lim}")
    d_inner = n_heads * head_dim
    return dict(ssd_d_state=d_state, d_conv=d_conv, ssd_headdim=head_dim, ssd_ngroups=n_groups,
                ssd_chunk_size=chunk_size, ssd_bias=proj_bias, ssd_conv_bias=conv_bias,
                ssd_dt_limit=None if lim == (0.0, float("inf")) else lim,
                **(dict(ssd_expand=d_inner // d_model) if d_inner % d_model == 0 else dict(ssd_d_inner=d_inner)))


def scaled(t: Tensor, scale) -> Tensor:
    """t · scale, a constant multiplier folded into a weight (a number, or one per row [rows]), computed in float64
    and rounded once to t's dtype; t itself when scale is the number 1."""
    if isinstance(scale, (int, float)) and scale == 1.0:
        return t
    s = torch.as_tensor(scale, dtype=torch.float64)
    if s.dim() == 1 and t.dim() == 2:
        s = s[:, None]
    return (t.double() * s).to(t.dtype)


def stacked_experts(s: Tensors, n_experts: int, hidden: int,
                     names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> tuple[Tensor, ...]:
    """(gate, up, down) of gated experts in F.linear layout ([E, h, d], [E, h, d], [E, d, h]) from transformers'
    fused in-memory tensors (experts.gate_up_proj [E, 2h, d], rows [gate; up], and experts.down_proj) or from the
    per-expert names saved and released checkpoints store (experts.{e}.<name>.weight, `names` = gate, up, down)."""
    if "experts.gate_up_proj" in s:
        gate_up = s["experts.gate_up_proj"]
        return gate_up[:, :hidden], gate_up[:, hidden:], s["experts.down_proj"]
    return tuple(torch.stack([s[f"experts.{e}.{n}.weight"] for e in range(n_experts)]) for n in names)


def routed_experts(out: dict[str, Tensor], prefix: str, *, up: Tensor, down: Tensor, gate: Tensor | None = None,
                    scale: float = 1.0):
    """Stacked experts in transformers' F.linear layout (up/gate [E, h, d], down [E, d, h]) -> our RoutedMoE's
    matmul layout (w_up/w_gate [E, d, h], w_down [E, h, d]); `scale` multiplies w_down (a folded constant)."""
    out[prefix + "w_up"] = up.transpose(1, 2)
    if gate is not None:
        out[prefix + "w_gate"] = gate.transpose(1, 2)
    out[prefix + "w_down"] = scaled(down, scale).transpose(1, 2)
