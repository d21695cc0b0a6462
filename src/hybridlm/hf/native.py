"""A hybridlm model as transformers' own LlamaForCausalLM or Mamba2ForCausalLM, when it is exactly one
(`hybridlm convert --to-hf RUN --as-native`): the result loads without hybridlm installed.

"Exactly" is checked by running the native config back through our converter (hf/convert.py): the ModelConfig it
gives must equal ours in every field the converter sets and in every option the converter cannot express. The
weights are placed by inverting the converter itself: each native tensor element is numbered, the converter maps the
numbers as it would map weights (renames, concatenations, reshapes), and our weights are scattered to where their
numbers came from, so there is no second, hand-written mapping to keep in sync.
"""
import math
from contextlib import contextmanager

import torch
from torch import nn

from ..errors import ConfigError
from ..models.causal_lm import CausalLM
from ..models.config import ModelConfig, quiet_unread
from .common import LazyTensor, Tensors
from .convert import CONVERTERS   # (importing convert registers every converter)

# options no native class has: they must keep their default (off)
_MUST_BE_DEFAULT = ("hyper_connections", "layer_overrides", "qk_norm", "residual_scale", "window", "wm_dyn_mask",
                    "wm_ssd_rope", "rope_dim", "attn_shared_key", "pos_embedding", "ssd_d_inner", "ssd_norm")
_IGNORED = {"max_seq_len"}   # Mamba-2 has no position limit (the converter writes a large one)


def _llama(cfg: ModelConfig, n: int, **special):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.mlp_hidden_size,
                       num_hidden_layers=n, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
                       head_dim=cfg.attn_head_dim, hidden_act=cfg.mlp_act, max_position_embeddings=cfg.max_seq_len,
                       rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
                       rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base},
                       attention_bias=cfg.attn_bias, mlp_bias=cfg.mlp_bias, bos_token_id=None, **special)


def _mamba2(cfg: ModelConfig, n: int, **special):
    from transformers import Mamba2Config
    return Mamba2Config(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=n,
                        state_size=cfg.ssd_d_state, conv_kernel=cfg.d_conv, expand=cfg.ssd_expand,
                        head_dim=cfg.ssd_headdim, num_heads=cfg.ssd_expand * cfg.d_model // cfg.ssd_headdim,
                        n_groups=cfg.ssd_ngroups, chunk_size=cfg.ssd_chunk_size, use_bias=cfg.ssd_bias,
                        use_conv_bias=cfg.ssd_conv_bias, layer_norm_epsilon=cfg.norm_eps,
                        time_step_min=cfg.ssd_dt_min, time_step_max=cfg.ssd_dt_max, time_step_limit=(0.0, math.inf),
                        tie_word_embeddings=cfg.tie_embeddings, bos_token_id=None, **special)


def _normal(cfg: ModelConfig) -> dict:
    """Fields with the defaults that mean "derived" resolved, so equal models compare equal."""
    return dict(cfg.to_dict(), n_kv_heads=cfg.kv_heads, head_dim=cfg.attn_head_dim, mlp_hidden=cfg.mlp_hidden_size)


def native_config(cfg: ModelConfig, **special):
    """transformers' config of the one native class computing exactly `cfg`'s function, else a ConfigError."""
    from ..models.layout import flatten, parse_layout
    from ..models.registry import LETTERS
    letters = "".join(flatten(parse_layout(cfg.layout, LETTERS.keys())))
    if letters and letters == "AM" * (len(letters) // 2):
        hf = _llama(cfg, len(letters) // 2, **special)
    elif letters and set(letters) == {"S"}:
        hf = _mamba2(cfg, len(letters), **special)
        if cfg.pos_embedding == "rope":   # RoPE reaches attention only: an S-only model computes the same without
            cfg = cfg.replace(pos_embedding="none")
    else:
        raise ConfigError(f"--as-native: layout {cfg.layout!r} is neither a Llama '(AM)*n' nor a Mamba-2 'S*n'; "
                          "export without --as-native")
    fields = CONVERTERS[hf.model_type].config(hf)
    with quiet_unread():
        back = _normal(ModelConfig(**fields))
    ours, default = _normal(cfg), ModelConfig().to_dict()
    bad = [k for k in fields if k not in _IGNORED and ours[k] != back[k]]
    bad += [k for k in _MUST_BE_DEFAULT if k not in fields and ours[k] != default[k]]
    if bad:
        raise ConfigError(f"--as-native: this model is not exactly a {type(hf).__name__[:-6]}: "
                          + ", ".join(f"{k}={ours[k]!r}" for k in bad))
    return hf


class _Numbered(LazyTensor):
    """Positions [offset, offset + numel) of the native weights, shaped like one native tensor, made when the
    converter reads it (so only the index tensors the converter is holding exist at a time)."""

    def __init__(self, offset: int, shape: torch.Size, dtype: torch.dtype):
        self.offset, self.shape, self.dtype = offset, shape, dtype

    def load(self) -> torch.Tensor:
        return torch.arange(self.offset, self.offset + math.prod(self.shape), dtype=self.dtype).view(self.shape)


@contextmanager
def _parameters_on_meta():
    """Build a module with its parameters on the meta device and its buffers (rotary frequencies) real, as
    accelerate's init_empty_weights(include_buffers=False) does: each parameter lives on the CPU only while made."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:       # (a tie re-registers a meta one: keep it)
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def to_native(model: CausalLM, **special):
    """transformers' LlamaForCausalLM / Mamba2ForCausalLM with `model`'s weights (copied), in eval mode. Memory: one
    native copy of the weights, a bitmap and the index tensors of the converter's output (int32 below 2^31 weights),
    about 2.3x the model beside it (a 1.5B float32 model exports in 24 GB)."""
    from transformers import AutoModelForCausalLM
    hf_cfg = native_config(model.config, **special)
    dtype = next(model.parameters()).dtype
    with _parameters_on_meta():                   # shapes only: the weights are placed below, never initialised
        hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    theirs, seen = {}, set()
    for k, t in hf.state_dict(keep_vars=True).items():     # a tied lm_head is the embedding: number it once
        if id(t) not in seen:
            seen.add(id(t))
            theirs[k] = t
    sizes = [t.numel() for t in theirs.values()]
    offsets = torch.tensor([0, *sizes]).cumsum(0).tolist()
    index = torch.int32 if offsets[-1] < 2 ** 31 else torch.int64
    numbered = {k: _Numbered(o, t.shape, index) for (k, t), o in zip(theirs.items(), offsets)}
    placed = CONVERTERS[hf_cfg.model_type].weights(Tensors(numbered), model.config)
    flat = torch.empty(offsets[-1], dtype=dtype)  # the native weights, one buffer
    filled = torch.zeros(offsets[-1], dtype=torch.bool)
    ours = model.state_dict()
    for name in list(placed):
        idx = placed.pop(name).reshape(-1).long()
        flat[idx] = ours[name].detach().reshape(-1).to(dtype)
        filled[idx] = True
        del idx
    if not bool(filled.all()):
        raise ConfigError(f"--as-native: the converter leaves part of {type(hf).__name__}'s weights unset")
    del filled
    state = {k: flat[o:o + t.numel()].view(t.shape) for (k, t), o in zip(theirs.items(), offsets)}
    hf.load_state_dict(state, strict=False, assign=True)
    hf.tie_weights()
    return hf.eval()
