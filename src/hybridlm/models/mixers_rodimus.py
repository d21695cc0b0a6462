"""Rodimus* letters and blocks (He et al., 2025):

    R  the Rodimus block (DDTS gated linear attention inside a GLU)
    W  sliding-window attention (each query sees its last `swa_window` keys, itself included); with
       attn_shared_key it is Rodimus++'s SW-SKA. Its cache is a ring buffer of `swa_window` tokens. The released
       code's `attn_cfg.window_size = W` is flash-attn's window (W // 2, 0): swa_window = W // 2 + 1.
    [R W M]  two-hop residual block of Rodimus++ (eq. 13), built by causal_lm.BLOCKS["hop"] (_build_hop)
"""
import copy

from ..layers.norm import make_norm
from ..layers.residual import TwoHopResidual
from .layout import Hop
from .registry import LETTERS, _attention, _validate_attention, need


def _validate_rodimus(cfg):
    m = cfg.rodimus_d_inner or cfg.rodimus_expand * cfg.d_model
    need(cfg.rodimus_d_inner is None or cfg.rodimus_d_inner >= 1,
         f"rodimus_d_inner (m) must be >= 1, got {cfg.rodimus_d_inner}")
    need(cfg.rodimus_d_state >= 1, f"rodimus_d_state (n) must be >= 1, got {cfg.rodimus_d_state}")
    need(cfg.rodimus_expand >= 1, f"rodimus_expand must be >= 1, got {cfg.rodimus_expand}")
    need(cfg.d_conv >= 1 and cfg.rodimus_chunk_size >= 1, "d_conv and rodimus_chunk_size must be >= 1")
    if cfg.rodimus_rank is not None:
        need(1 <= cfg.rodimus_rank <= m, f"rodimus_rank (ℓ = {cfg.rodimus_rank}) must be between 1 and the Rodimus "
             f"width m = {m}")
    need(not cfg.rodimus_product_decay or cfg.rodimus_use_beta_hat,
         "rodimus_product_decay (β_t = 1 - β̂_t) needs rodimus_use_beta_hat=True")


def _validate_window_attention(cfg):
    _validate_attention(cfg)
    need(isinstance(cfg.swa_window, int) and cfg.swa_window >= 1,
         f"swa_window must be >= 1 (keys each W query sees, itself included), got {cfg.swa_window}")


def _rodimus(cfg, idx, cls=None, **extra):
    """The Rodimus of layer `idx`; `cls` a subclass to build instead (with `extra` arguments: the vLLM plugin's)."""
    from ..layers.rodimus import Rodimus
    return (cls or Rodimus)(cfg.d_model, layer_idx=idx, d_state=cfg.rodimus_d_state, expand=cfg.rodimus_expand,
                   d_inner=cfg.rodimus_d_inner, d_conv=cfg.d_conv, rank=cfg.rodimus_rank,
                   chunk_size=cfg.rodimus_chunk_size,
                   use_g=cfg.rodimus_use_g, use_tau=cfg.rodimus_use_tau, use_beta_hat=cfg.rodimus_use_beta_hat,
                   product_decay=cfg.rodimus_product_decay, norm_eps=cfg.norm_eps, **extra)


def _window_attention(cfg, idx):
    c = copy.copy(cfg)             # the A builder with the W window (no re-validation needed)
    c.window = cfg.swa_window
    return _attention(c, idx)


def _build_hop(cfg, letters: tuple, idx: int) -> TwoHopResidual:
    """[token mixer, attention, channel mixer] at layer indices idx, idx+1, idx+2 (one cache slot each)."""
    cfgs = [cfg.for_layer(idx + j) for j in range(len(letters))]
    mods = [LETTERS[letter].build(c, idx + j) for j, (letter, c) in enumerate(zip(letters, cfgs))]
    norms = [make_norm(c.norm, c.d_model, c.norm_eps) for c in cfgs]
    return TwoHopResidual(norms, *mods)


def _check_hops(cfg, items):
    """Every `[...]` must be [token mixer, attention-like token mixer, channel mixer], e.g. [RWM]."""
    for it in items:
        if not isinstance(it, Hop):
            continue
        name = "[" + "".join(it) + "]"
        shape = "a two-hop block is [token mixer, attention, channel mixer], e.g. [RWM]"
        token = [LETTERS[letter].token for letter in it]
        need(any(LETTERS[letter].attention for letter in it[1:]),
             f"two-hop block {name} is missing its attention: {shape}")
        need(not all(token), f"two-hop block {name} is missing its MLP (channel mixer): {shape}")
        need(len(it) == 3 and token[0] and LETTERS[it[1]].attention and not token[2],
             f"two-hop block {name} has the wrong structure: {shape}")
        need(not cfg.residual_scale, "residual_scale (learnable residual weights) is not supported in two-hop blocks")
