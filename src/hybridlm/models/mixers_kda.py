"""The `K` letter: Kimi Delta Attention (layers/kda.py), the linear-attention layer of Kimi-Linear."""
from .registry import need

# our KimiDeltaAttention's parameters -> Kimi-Linear's names (transformers' kimi_linear and vLLM's use the same ones);
# q/k/v, the conv and A_log are fused or shaped differently on each side: hf/convert_kimi_linear.py and the vLLM plugin
# cut those themselves
KIMI_LINEAR_NAMES = {"f_a.weight": "f_a_proj.weight", "f_b.weight": "f_b_proj.weight", "dt_bias": "dt_bias",
                     "b_proj.weight": "b_proj.weight", "g_a.weight": "g_a_proj.weight", "g_b.weight": "g_b_proj.weight",
                     "norm_weight": "o_norm.weight", "o_proj.weight": "o_proj.weight"}


def kda_sizes(cfg) -> tuple[int, int, int]:
    """(heads, head dim, gate rank) a config resolves to."""
    heads = cfg.n_heads if cfg.kda_heads is None else cfg.kda_heads
    dim = cfg.kda_head_dim if cfg.kda_head_dim is not None else (cfg.d_model // heads if heads >= 1 else 0)
    return heads, dim, dim if cfg.kda_rank is None else cfg.kda_rank


def _validate_kda(cfg):
    heads = kda_sizes(cfg)[0]
    need(heads >= 1, f"kda_heads must be >= 1, got {heads}")
    need(cfg.kda_head_dim is not None or cfg.d_model % heads == 0,
         f"d_model ({cfg.d_model}) must be divisible by kda_heads ({heads}), or set kda_head_dim")
    _, dim, rank = kda_sizes(cfg)
    need(dim >= 1, f"kda_head_dim must be >= 1, got {dim}")
    need(rank >= 1, f"kda_rank must be >= 1, got {rank}")
    need(cfg.d_conv >= 1, f"d_conv must be >= 1, got {cfg.d_conv}")


def _kda(cfg, idx):
    from ..layers.kda import KimiDeltaAttention
    heads, dim, rank = kda_sizes(cfg)
    return KimiDeltaAttention(cfg.d_model, layer_idx=idx, n_heads=heads, head_dim=dim, d_conv=cfg.d_conv,
                              rank=rank, norm_eps=cfg.norm_eps)
