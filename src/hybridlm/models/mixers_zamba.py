"""Zamba2's letter (transformers' Zamba2ForCausalLM; hf/convert_zamba2.py):

    Z  the shared transformer block over concat(stream, embeddings) (layers/zamba.py). Its output feeds the next
       letter's input instead of the stream, so a Z and the letter after it form one block
       (causal_lm.fold_feeds -> layers/residual.Fed): out = x + S(norm(x + Z(x, e))). Zamba2's shared blocks are
       `Z@0`, `Z@1`, ... (weight sharing, models/layout.py); the adapters and output projection stay per occurrence.
       Z takes the raw stream (it norms concat(x, e) itself) and is added nowhere: its table entry (models/registry.py)
       has residual=False, and `_check_feeds` is its whole-layout check.
"""
from ..layers.zamba import ZambaBlock
from .registry import need


def _validate_zamba(cfg):
    need(cfg.n_heads >= 1 and cfg.kv_heads >= 1 and cfg.n_heads % cfg.kv_heads == 0,
         f"n_heads ({cfg.n_heads}) must be a positive multiple of n_kv_heads ({cfg.kv_heads})")
    need(cfg.head_dim is not None or (2 * cfg.d_model) % cfg.n_heads == 0,
         f"Z: 2·d_model ({2 * cfg.d_model}) must be divisible by n_heads ({cfg.n_heads}), or set head_dim")
    need(cfg.zamba_adapter_rank >= 0, f"zamba_adapter_rank must be >= 0, got {cfg.zamba_adapter_rank}")
    need(not cfg.zamba_attn_adapter or cfg.zamba_adapter_rank >= 1,
         "zamba_attn_adapter needs zamba_adapter_rank >= 1")
    need(cfg.pos_embedding in ("rope", "none"), f"Z: pos_embedding must be rope or none, got {cfg.pos_embedding!r}")
    hd = _head_dim(cfg)
    need(cfg.pos_embedding != "rope" or hd % 2 == 0, f"Z: RoPE needs an even head_dim, got {hd}")
    need(cfg.window is None, "Z: window (sliding attention) is not supported")


def _head_dim(cfg) -> int:
    return cfg.head_dim or 2 * cfg.d_model // cfg.n_heads


def _zamba(cfg, idx):
    hd = _head_dim(cfg)
    return ZambaBlock(cfg.d_model, cfg.n_heads, cfg.kv_heads, hd, cfg.mlp_hidden or 4 * cfg.d_model, layer_idx=idx,
                      act=cfg.mlp_act, mlp_bias=cfg.mlp_bias, adapter_rank=cfg.zamba_adapter_rank,
                      attn_adapter=cfg.zamba_attn_adapter, rope_dim=hd if cfg.pos_embedding == "rope" else 0,
                      rope_base=cfg.rope_base, norm_eps=cfg.norm_eps)


def _check_feeds(cfg, items):
    """Every Z stands on its own (not inside a two-hop or parallel block, where it would sit behind a norm and add to
    the stream) and is followed by a letter of its own (which its output feeds)."""
    for i, it in enumerate(items):
        need(isinstance(it, str) or "Z" not in it,
             f"layout {cfg.layout!r}: Z cannot sit inside a block ('[...]' or '{{...}}'): its output feeds the next "
             "letter's input")
        if it == "Z":
            nxt = items[i + 1] if i + 1 < len(items) else None
            need(isinstance(nxt, str) and nxt != "Z",
                 f"layout {cfg.layout!r}: each Z must be followed by a letter (not a block, another Z or the end): "
                 "its output is added to that layer's input")
