"""Wonderful Matrices letters and options (Shi et al., 2024): Cheems and Doge.

  F  inner-function attention (section 3.2, eq. 3)            E  CDMoE (section 3.3, eq. 5; Doge's form)
and the builders of two options of other letters, chosen by the config: `wm_dyn_mask` on A (and F) layers builds
the dynamic-mask attention (layers/wm_attention.py); `wm_ssd_rope` on S layers builds Cheems' SSD with RoPE on
C and B (layers/rope_ssd.py). The entries of all five letters, options included, are declared in models/registry.py.
"""
import math

from .registry import LETTERS, need

DYN_MASKS = ("none", "position", "dt")
CDMOE_FORMS = ("doge", "sum", "compose")


# --- validators -----------------------------------------------------------------------------------------------
def _validate_dyn_mask(cfg):
    need(cfg.wm_dyn_mask in DYN_MASKS, f"wm_dyn_mask must be one of {', '.join(DYN_MASKS)}, got {cfg.wm_dyn_mask!r}")
    if cfg.wm_keep_window is not None:
        need(cfg.wm_dyn_mask == "dt", "wm_keep_window selects keys by the dynamic-mask bias: it needs wm_dyn_mask='dt'")
        need(1 <= cfg.wm_keep_window <= cfg.max_seq_len,
             f"wm_keep_window must be between 1 and max_seq_len ({cfg.max_seq_len}), got {cfg.wm_keep_window}")
    if cfg.wm_dyn_mask != "none":
        need(not getattr(cfg, "attn_shared_key", False), "wm_dyn_mask does not support attn_shared_key")
        need(not cfg.attn_output_gate, "attn_output_gate does not support wm_dyn_mask")


def _validate_inner(cfg):
    LETTERS["A"].validate(cfg)                    # heads, head_dim, rope and the dynamic-mask options
    need(not getattr(cfg, "attn_shared_key", False), "F (inner-function attention) does not support attn_shared_key")
    need(cfg.kv_heads * cfg.attn_head_dim == cfg.d_model,
         f"F (inner-function attention) multiplies x into its values, so n_kv_heads*head_dim "
         f"({cfg.kv_heads}*{cfg.attn_head_dim}) must equal d_model ({cfg.d_model})")
    need(cfg.wm_inner_values >= 1 and cfg.wm_inner_dret >= 1, "wm_inner_values and wm_inner_dret must be >= 1")
    need(1 <= cfg.wm_inner_topk <= cfg.wm_inner_values,
         f"wm_inner_topk ({cfg.wm_inner_topk}) must be between 1 and wm_inner_values ({cfg.wm_inner_values})")


def _validate_cdmoe(cfg):
    E, k = cfg.wm_cdmoe_experts, cfg.wm_cdmoe_topk
    need(cfg.wm_cdmoe_form in CDMOE_FORMS,
         f"wm_cdmoe_form must be one of {', '.join(CDMOE_FORMS)}, got {cfg.wm_cdmoe_form!r}")
    need(E >= 1 and math.isqrt(E) ** 2 == E,
         f"wm_cdmoe_experts ({E}) must be a perfect square: product keys use √N keys per side "
         f"(nearest: {math.isqrt(E) ** 2} or {(math.isqrt(E) + 1) ** 2})")
    need(1 <= k <= E, f"wm_cdmoe_topk ({k}) must be between 1 and wm_cdmoe_experts ({E})")
    need(cfg.wm_cdmoe_heads >= 1, f"wm_cdmoe_heads must be >= 1, got {cfg.wm_cdmoe_heads}")
    if cfg.wm_cdmoe_form != "doge":
        need(cfg.wm_cdmoe_dret >= 2 and cfg.wm_cdmoe_dret % 2 == 0,
             f"wm_cdmoe_dret must be even and >= 2 (two product-key halves), got {cfg.wm_cdmoe_dret}")


def _validate_rope_ssd(cfg):
    if not cfg.wm_ssd_rope:
        return
    need(cfg.ssd_d_state % 2 == 0, f"wm_ssd_rope rotates B and C: ssd_d_state must be even, got {cfg.ssd_d_state}")
    need(cfg.wm_ssd_position in ("rope", "conv"), f"wm_ssd_position must be rope or conv, got {cfg.wm_ssd_position!r}")


# --- builders -------------------------------------------------------------------------------------------------
def _wm_attention(cfg, idx, inner: bool):
    from ..layers.wm_attention import WMAttention
    return WMAttention(cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.attn_head_dim, layer_idx=idx,
                       max_seq_len=cfg.max_seq_len, bias=cfg.attn_bias,
                       rope_dim=(cfg.rope_dim if cfg.rope_dim is not None else cfg.attn_head_dim)
                       if cfg.pos_embedding == "rope" else 0,
                       rope_base=cfg.rope_base, rope_interleaved=cfg.rope_interleaved, window=cfg.window,
                       qk_norm=cfg.qk_norm, norm_eps=cfg.norm_eps, dropout=cfg.dropout,
                       inner_values=cfg.wm_inner_values if inner else None, inner_topk=cfg.wm_inner_topk,
                       inner_dret=cfg.wm_inner_dret, dyn_mask=cfg.wm_dyn_mask, keep_window=cfg.wm_keep_window)


def _rope_ssd(cfg, idx):
    from ..layers.rope_ssd import RopeSSD
    return RopeSSD(cfg.d_model, layer_idx=idx, d_state=cfg.ssd_d_state, expand=cfg.ssd_expand,
                   headdim=cfg.ssd_headdim, ngroups=cfg.ssd_ngroups, chunk_size=cfg.ssd_chunk_size,
                   bias=cfg.ssd_bias, dt_min=cfg.ssd_dt_min, dt_max=cfg.ssd_dt_max,
                   A_init_range=cfg.ssd_A_init_range, rope_base=cfg.rope_base,
                   rope_interleaved=cfg.rope_interleaved, position=cfg.wm_ssd_position, d_conv=cfg.d_conv)


def _cdmoe(cfg, idx):
    from ..layers.cdmoe import CDMoE
    return CDMoE(cfg.d_model, cfg.wm_cdmoe_hidden or cfg.mlp_hidden_size, num_experts=cfg.wm_cdmoe_experts,
                 top_k=cfg.wm_cdmoe_topk, heads=cfg.wm_cdmoe_heads, d_ret=cfg.wm_cdmoe_dret,
                 form=cfg.wm_cdmoe_form, act=cfg.mlp_act, bias=cfg.mlp_bias)


def dyn_mask_attention(cfg, idx):
    """A with wm_dyn_mask set."""
    return _wm_attention(cfg, idx, inner=False)


def inner_attention(cfg, idx):
    """F."""
    return _wm_attention(cfg, idx, inner=True)
