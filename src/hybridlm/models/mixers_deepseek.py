"""DeepSeek-family letters and options: `L` multi-head latent attention (MLA), `I` lightning-indexer sparse
attention, and the checks of the model-level `hyper_connections` option (the Transformer tutorial 3.2-3.5, 5)."""
from .registry import LETTERS, need


def mla_sizes(cfg) -> dict:
    """The MLA sizes a config resolves to (defaults follow DeepSeek-V3's ratios to the head dim)."""
    head = cfg.attn_head_dim
    kv = cfg.mla_kv_lora_rank if cfg.mla_kv_lora_rank is not None else 4 * head
    return dict(kv_lora_rank=kv,
                q_lora_rank=3 * kv if cfg.mla_q_lora_rank is None else cfg.mla_q_lora_rank,
                qk_nope_dim=head if cfg.mla_qk_nope_dim is None else cfg.mla_qk_nope_dim,
                rope_dim=head // 2 if cfg.mla_rope_dim is None else cfg.mla_rope_dim,
                v_dim=head if cfg.mla_v_dim is None else cfg.mla_v_dim)


def dsa_sizes(cfg) -> dict:
    head = cfg.dsa_head_dim if cfg.dsa_head_dim is not None else cfg.attn_head_dim
    rope = cfg.dsa_rope_dim if cfg.dsa_rope_dim is not None else mla_sizes(cfg)["rope_dim"]
    return dict(n_heads=cfg.dsa_n_heads, head_dim=head, rope_dim=rope, topk=cfg.dsa_topk)


def _validate_mla(cfg):
    need(cfg.n_heads >= 1, f"n_heads must be >= 1, got {cfg.n_heads}")
    need(cfg.head_dim is not None or cfg.d_model % cfg.n_heads == 0,
         f"d_model ({cfg.d_model}) must be divisible by n_heads ({cfg.n_heads}), or set head_dim")
    s = mla_sizes(cfg)
    need(s["kv_lora_rank"] >= 1, f"mla_kv_lora_rank must be >= 1, got {s['kv_lora_rank']}")
    need(s["q_lora_rank"] >= 0, f"mla_q_lora_rank must be >= 0 (0 = direct query projection), got {s['q_lora_rank']}")
    need(s["qk_nope_dim"] >= 0 and s["v_dim"] >= 1,
         f"mla_qk_nope_dim must be >= 0 and mla_v_dim >= 1, got {s['qk_nope_dim']} and {s['v_dim']}")
    if cfg.pos_embedding == "none":   # NoPE MLA (Kimi-Linear): the shared key part is never rotated
        need(s["rope_dim"] >= 0, f"mla_rope_dim must be >= 0, got {s['rope_dim']}")
    else:
        need(s["rope_dim"] >= 2 and s["rope_dim"] % 2 == 0,
             f"mla_rope_dim ({s['rope_dim']}) must be even and >= 2 (RoPE rotates pairs of channels)")


def _validate_indexed(cfg):
    need(cfg.dsa_attention in ("L", "A"), f"dsa_attention must be 'L' (MLA) or 'A', got {cfg.dsa_attention!r}")
    (_validate_mla if cfg.dsa_attention == "L" else LETTERS["A"].validate)(cfg)
    need(cfg.dsa_attention == "L" or cfg.window is None,
         "the lightning indexer selects among all previous keys: window must be None for I layers")
    need(cfg.dsa_topk >= 1, f"dsa_topk must be >= 1 (keys kept per query), got {cfg.dsa_topk}")
    need(cfg.dsa_kl_weight >= 0, f"dsa_kl_weight must be >= 0 (0 = an untrained indexer), got {cfg.dsa_kl_weight}")
    s = dsa_sizes(cfg)
    need(s["n_heads"] >= 1 and s["head_dim"] >= 1,
         f"dsa_n_heads and dsa_head_dim must be >= 1, got {s['n_heads']} and {s['head_dim']}")
    need(s["rope_dim"] >= 0 and s["rope_dim"] % 2 == 0 and s["rope_dim"] <= s["head_dim"],
         f"dsa_rope_dim ({s['rope_dim']}) must be even and at most dsa_head_dim ({s['head_dim']})")


def _check_hyper_connections(cfg, items):
    n = cfg.hyper_connections
    if n is None:
        return
    need(isinstance(n, int) and n >= 1, f"hyper_connections (number of residual streams) must be >= 1, got {n}")
    need(cfg.hc_sinkhorn_iters >= 1, f"hc_sinkhorn_iters must be >= 1, got {cfg.hc_sinkhorn_iters}")
    need(not cfg.residual_scale, "residual_scale and hyper_connections are two residual schemes: pick one")


def _mla(cfg, idx):
    from ..layers.mla import MLA
    return MLA(cfg.d_model, cfg.n_heads, layer_idx=idx, **mla_sizes(cfg), rope_base=cfg.rope_base,
               rope_interleaved=cfg.mla_rope_interleaved, bias=cfg.attn_bias, absorb=cfg.mla_absorb,
               dropout=cfg.dropout, rotate=cfg.pos_embedding != "none")


def _indexed(cfg, idx):
    from ..layers.indexer import IndexedAttention, LightningIndexer
    attn = _mla(cfg, idx) if cfg.dsa_attention == "L" else LETTERS["A"].build(cfg, idx)
    q_lora = mla_sizes(cfg)["q_lora_rank"] if cfg.dsa_attention == "L" else 0
    indexer = LightningIndexer(cfg.d_model, q_lora or cfg.d_model, **dsa_sizes(cfg), rope_base=cfg.rope_base)
    return IndexedAttention(attn, indexer, layer_idx=idx, distill=cfg.dsa_kl_weight > 0)
