"""Delta-rule letters (ops/delta_rule.py):

    G  Gated DeltaNet, as in Qwen3-Next (layers/gated_deltanet.py): scalar decay per value head

(K, Kimi Delta Attention, the per-channel-decay form, is built by models/mixers_kda.py.)
"""
from .registry import need


# --- G: Gated DeltaNet -------------------------------------------------------------------------------------------
def gdn_sizes(cfg) -> tuple[int, int, int, int]:
    """(key heads, value heads, key head dim, value head dim) of a G layer, defaults resolved."""
    hk = cfg.gdn_k_heads or cfg.n_heads
    dk = cfg.gdn_k_dim or cfg.attn_head_dim
    return hk, cfg.gdn_v_heads or hk, dk, cfg.gdn_v_dim or dk


def _validate_gdn(cfg):
    for name in ("gdn_k_heads", "gdn_v_heads", "gdn_k_dim", "gdn_v_dim"):
        v = getattr(cfg, name)
        need(v is None or (isinstance(v, int) and v >= 1), f"{name} must be None or >= 1, got {v!r}")
    hk, hv, _, _ = gdn_sizes(cfg)
    need(hv % hk == 0, f"gdn_v_heads ({hv}) must be a multiple of gdn_k_heads ({hk}): each key head serves a group "
         f"of value heads")
    need(cfg.d_conv >= 1, f"d_conv must be >= 1, got {cfg.d_conv}")
    need(cfg.gdn_chunk_size >= 1, f"gdn_chunk_size must be >= 1, got {cfg.gdn_chunk_size}")


def _gated_deltanet(cfg, idx):
    from ..layers.gated_deltanet import GatedDeltaNet
    hk, hv, dk, dv = gdn_sizes(cfg)
    return GatedDeltaNet(cfg.d_model, layer_idx=idx, k_heads=hk, v_heads=hv, k_dim=dk, v_dim=dv, d_conv=cfg.d_conv,
                         chunk_size=cfg.gdn_chunk_size, norm_eps=cfg.norm_eps)
