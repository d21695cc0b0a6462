"""Mixer letters of the layout language -> module builders.

A builder takes (config for this layer, layer index) and returns an nn.Module. Token mixers are called
as `m(x, ctx=..., cache=...)`, channel mixers as `m(x)`. New architectures register their letters here
(`register("R", build, token=True)`) instead of writing a new model class.
"""
from dataclasses import dataclass
from typing import Callable

from torch import nn

from ..errors import ConfigError


@dataclass(frozen=True)
class Letter:
    build: Callable[..., nn.Module]
    token: bool          # token mixer (sees the sequence, owns a cache slot) or channel mixer
    doc: str
    validate: Callable | None = None   # validate(cfg) raises ConfigError for impossible options


LETTERS: dict[str, Letter] = {}


def register(letter: str, build: Callable[..., nn.Module], *, token: bool, doc: str = "",
             validate: Callable | None = None):
    if len(letter) != 1 or not letter.isalpha() or not letter.isupper():
        raise ValueError(f"a mixer letter is one upper-case letter, got {letter!r}")
    LETTERS[letter] = Letter(build, token, doc, validate)


def need(cond: bool, msg: str):
    if not cond:
        raise ConfigError(msg)


def _validate_attention(cfg):
    need(cfg.n_heads >= 1 and cfg.kv_heads >= 1, "n_heads and n_kv_heads must be >= 1")
    need(cfg.n_heads % cfg.kv_heads == 0,
         f"n_heads ({cfg.n_heads}) must be a multiple of n_kv_heads ({cfg.kv_heads})")
    need(cfg.head_dim is not None or cfg.d_model % cfg.n_heads == 0,
         f"d_model ({cfg.d_model}) must be divisible by n_heads ({cfg.n_heads}), or set head_dim")
    rd = cfg.attn_head_dim if cfg.rope_dim is None else cfg.rope_dim
    need(rd % 2 == 0 and 0 <= rd <= cfg.attn_head_dim,
         f"rope_dim ({rd}) must be even and at most head_dim ({cfg.attn_head_dim})")
    need(cfg.window is None or cfg.window >= 1, f"window must be >= 1, got {cfg.window}")
    if cfg.n_k_heads is not None:
        need(cfg.n_k_heads >= 1 and cfg.kv_heads % cfg.n_k_heads == 0,
             f"n_k_heads ({cfg.n_k_heads}) must be >= 1 and divide the value heads n_kv_heads ({cfg.kv_heads})")


def _validate_ssd(cfg):
    d_inner = cfg.ssd_expand * cfg.d_model
    need(d_inner % cfg.ssd_headdim == 0,
         f"ssd_expand*d_model ({d_inner}) must be divisible by ssd_headdim ({cfg.ssd_headdim})")
    nheads = d_inner // cfg.ssd_headdim
    need(nheads % cfg.ssd_ngroups == 0, f"SSD heads ({nheads}) must be divisible by ssd_ngroups ({cfg.ssd_ngroups})")
    need(cfg.ssd_chunk_size >= 1 and cfg.ssd_d_conv >= 1, "ssd_chunk_size and ssd_d_conv must be >= 1")


def _attention(cfg, idx):
    from ..layers.attention import Attention
    return Attention(cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.attn_head_dim, layer_idx=idx, bias=cfg.attn_bias,
                     rope_dim=(cfg.rope_dim if cfg.rope_dim is not None else cfg.attn_head_dim)
                     if cfg.pos_embedding == "rope" else 0,
                     rope_base=cfg.rope_base, rope_interleaved=cfg.rope_interleaved, window=cfg.window,
                     qk_norm=cfg.qk_norm, norm_eps=cfg.norm_eps, dropout=cfg.dropout,
                     n_k_heads=cfg.n_k_heads or (1 if cfg.attn_shared_key else None))


def _mlp(cfg, idx):
    from ..layers.mlp import MLP
    return MLP(cfg.d_model, cfg.mlp_hidden_size, act=cfg.mlp_act, gated=cfg.mlp_gated, bias=cfg.mlp_bias,
               dropout=cfg.dropout)


def _ssd(cfg, idx):
    from ..layers.mamba2 import Mamba2
    return Mamba2(cfg.d_model, layer_idx=idx, d_state=cfg.ssd_d_state, d_conv=cfg.ssd_d_conv,
                  expand=cfg.ssd_expand, headdim=cfg.ssd_headdim, ngroups=cfg.ssd_ngroups,
                  chunk_size=cfg.ssd_chunk_size, bias=cfg.ssd_bias, conv_bias=cfg.ssd_conv_bias,
                  dt_min=cfg.ssd_dt_min, dt_max=cfg.ssd_dt_max, A_init_range=cfg.ssd_A_init_range,
                  norm_eps=cfg.norm_eps, dt_clamp_min=cfg.zamba_dt_floor)


register("A", _attention, token=True, doc="softmax attention (MHA/GQA/MQA, RoPE, optional window)",
         validate=_validate_attention)
register("S", _ssd, token=True, doc="SSD / Mamba-2 block", validate=_validate_ssd)
register("M", _mlp, token=False, doc="MLP or gated MLP (SwiGLU)")
