"""The routed mixture-of-experts letter (generic: Wonderful Matrices' MoE and MoE-SEI, DeepSeek-V3, Jamba, Qwen3-Next,
Nemotron-H, Granite-4.0, Kimi-Linear; layers/routed_moe.py):

    O  top-k routed gated-MLP experts (softmax or sigmoid router, optional expert groups), optional shared expert;
       configured by the `moe_*` fields
"""
from ..layers.mlp import ACTIVATIONS
from .registry import need


def _validate_moe(cfg):
    E, k, G = cfg.moe_experts, cfg.moe_topk, cfg.moe_n_group
    need(E >= 1, f"moe_experts must be >= 1, got {E}")
    need(1 <= k <= E, f"moe_topk ({k}) must be between 1 and moe_experts ({E})")
    need(cfg.moe_router in ("softmax", "sigmoid"), f"moe_router must be softmax or sigmoid, got {cfg.moe_router!r}")
    need(G >= 1 and E % G == 0, f"moe_n_group ({G}) must be >= 1 and divide moe_experts ({E})")
    need(1 <= cfg.moe_topk_group <= G, f"moe_topk_group ({cfg.moe_topk_group}) must be between 1 and moe_n_group ({G})")
    need(k <= cfg.moe_topk_group * (E // G),
         f"moe_topk ({k}) exceeds the experts in moe_topk_group groups ({cfg.moe_topk_group * (E // G)})")
    need(cfg.mlp_act in ACTIVATIONS, f"mlp_act must be one of {', '.join(ACTIVATIONS)}, got {cfg.mlp_act!r}")


def _routed_moe(cfg, idx):
    from ..layers.routed_moe import RoutedMoE
    return RoutedMoE(cfg.d_model, cfg.moe_hidden or cfg.mlp_hidden_size, num_experts=cfg.moe_experts,
                     top_k=cfg.moe_topk, shared_expert=cfg.moe_shared, init_std=cfg.init_std,
                     act=cfg.mlp_act, gated=cfg.mlp_gated, router=cfg.moe_router, norm_topk=cfg.moe_norm_topk,
                     router_bias=cfg.moe_router_bias, n_group=cfg.moe_n_group, topk_group=cfg.moe_topk_group,
                     scale=cfg.moe_scale, shared_hidden=cfg.moe_shared_hidden, shared_gate=cfg.moe_shared_gate)
