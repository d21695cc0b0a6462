"""The Mamba-1 letter:

    B  the Mamba-1 block (selective scan with per-channel diagonal A, input-dependent dt/B/C, conv, SiLU gate);
       its cache is the conv tail + the float32 state [B, d_inner, d_state]
"""
from .registry import need

# our Mamba1's parameters -> transformers' MambaMixer names (Mamba, Falcon-Mamba, Jamba; vLLM's MambaMixer keeps them,
# reading A_log as A = -exp(A_log)); the conv kernel [C, K] is theirs [C, 1, K], reshaped by each converter
MAMBA_NAMES = {"in_proj.weight": "in_proj.weight", "x_proj.weight": "x_proj.weight", "dt_proj.weight": "dt_proj.weight",
               "dt_proj.bias": "dt_proj.bias", "A_log": "A_log", "D": "D", "out_proj.weight": "out_proj.weight"}
MAMBA_NAMES_OPTIONAL = {"in_proj.bias": "in_proj.bias", "out_proj.bias": "out_proj.bias", "conv.bias": "conv1d.bias",
                        "dt_norm": "dt_layernorm.weight", "b_norm": "b_layernorm.weight", "c_norm": "c_layernorm.weight"}


def _validate_mamba1(cfg):
    need(cfg.mamba1_d_state >= 1, f"mamba1_d_state must be >= 1, got {cfg.mamba1_d_state}")
    need(cfg.d_conv >= 1, f"d_conv must be >= 1, got {cfg.d_conv}")
    need(cfg.mamba1_expand >= 1, f"mamba1_expand must be >= 1, got {cfg.mamba1_expand}")
    need(cfg.mamba1_dt_rank is None or cfg.mamba1_dt_rank >= 1,
         f"mamba1_dt_rank must be >= 1 (or None for ceil(d_model/16)), got {cfg.mamba1_dt_rank}")
    need(cfg.mamba1_bcdt_norm in ("none", "weight", "plain"),
         f"mamba1_bcdt_norm must be none|weight|plain, got {cfg.mamba1_bcdt_norm!r}")
    need(cfg.mamba1_norm_eps is None or cfg.mamba1_norm_eps > 0,
         f"mamba1_norm_eps must be > 0, got {cfg.mamba1_norm_eps}")
    need(cfg.mamba1_chunk_size >= 1, f"mamba1_chunk_size must be >= 1, got {cfg.mamba1_chunk_size}")


def _mamba1(cfg, idx):
    from ..layers.mamba1 import Mamba1
    return Mamba1(cfg.d_model, layer_idx=idx, d_state=cfg.mamba1_d_state, d_conv=cfg.d_conv,
                  expand=cfg.mamba1_expand, dt_rank=cfg.mamba1_dt_rank, conv_bias=cfg.mamba1_conv_bias,
                  bias=cfg.mamba1_bias, bcdt_norm=cfg.mamba1_bcdt_norm,
                  norm_eps=cfg.mamba1_norm_eps if cfg.mamba1_norm_eps is not None else cfg.norm_eps,
                  chunk_size=cfg.mamba1_chunk_size)
