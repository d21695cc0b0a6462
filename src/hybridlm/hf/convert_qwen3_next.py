"""Converter for transformers' Qwen3-Next (`Qwen3NextForCausalLM`): per layer, `linear_attention` -> G (Gated
DeltaNet) or `full_attention` -> A with Qwen3-Next's gated attention (q/k RMSNorm, partial RoPE, sigmoid output
gate), then a sparse MoE block -> O (softmax top-k, shared expert with a sigmoid gate) or a dense gated MLP -> M
(`mlp_only_layers`, `decoder_sparse_step`, num_experts = 0). The released 3:1 pattern is "(GO GO GO AO)*12".

Qwen3-Next's RMSNorms (layer, final and q/k norms) are zero-centred, x·(1 + w): converted to our weight 1 + w,
computed in float32 as transformers does (a bfloat16 model rounds 1 + w to bfloat16). The G layer's gated norm is
a plain weight. Projection layouts are kept, so G's fused in_proj_qkvz / in_proj_ba copy without reordering.
Experts are read fused (a model in memory) or per expert (saved checkpoints).
"""
import torch
from torch import Tensor

from ..models.config import ModelConfig
from ..models.layout import fold_layout
from .common import (TWINS, Tensors, copy_renamed, decoder_layers, fused_attention, gated_mlp, head_tensors, hf_get,
                     hf_rope_partial, hf_tied, register, require, require_silu, routed_experts, stacked_experts)

ARCH = "Qwen3NextForCausalLM"
# ours (under a G block's mixer) -> theirs
_GDN = {"in_proj_qkvz.weight": "linear_attn.in_proj_qkvz.weight", "in_proj_ba.weight": "linear_attn.in_proj_ba.weight",
        "dt_bias": "linear_attn.dt_bias", "A_log": "linear_attn.A_log", "norm_weight": "linear_attn.norm.weight",
        "out_proj.weight": "linear_attn.out_proj.weight"}


def _is_moe(hf, i: int) -> bool:
    """transformers' rule for a sparse MoE block at layer i."""
    only = hf_get(hf, "mlp_only_layers") or []
    step = hf_get(hf, "decoder_sparse_step", 1) or 1
    return i not in only and (hf_get(hf, "num_experts", 0) or 0) > 0 and (i + 1) % step == 0


def qwen3_next_config(hf) -> dict:
    n = hf.num_hidden_layers
    types = list(hf_get(hf, "layer_types") or [])
    require(len(types) == n, ARCH, f"layer_types of length {len(types)} for {n} layers")
    bad = sorted(set(types) - {"linear_attention", "full_attention"})
    require(not bad, ARCH, f"layer_types {bad}")
    require(float(hf_get(hf, "attention_dropout", 0) or 0) == 0, ARCH, "attention_dropout")
    act = require_silu(ARCH, hf_get(hf, "hidden_act", "silu"), "hidden_act (MLP, expert and conv)")
    sparse = [_is_moe(hf, i) for i in range(n)]
    blocks = [("G" if t == "linear_attention" else "A") + ("O" if s else "M") for t, s in zip(types, sparse)]
    head_dim = hf_get(hf, "head_dim") or hf.hidden_size // hf.num_attention_heads
    rope_base, rope_dim = hf_rope_partial(ARCH, hf, head_dim)
    fields = dict(
        layout=fold_layout(blocks), vocab_size=hf.vocab_size, d_model=hf.hidden_size,
        max_seq_len=int(hf_get(hf, "max_position_embeddings", 2048)), tie_embeddings=hf_tied(hf), norm="rms",
        norm_eps=float(hf.rms_norm_eps), pos_embedding="rope",
        n_heads=hf.num_attention_heads, n_kv_heads=hf_get(hf, "num_key_value_heads") or hf.num_attention_heads,
        head_dim=head_dim, rope_base=rope_base, rope_dim=rope_dim, attn_bias=bool(hf_get(hf, "attention_bias", False)),
        qk_norm=True, attn_output_gate=True, mlp_act=act, mlp_gated=True,
        gdn_k_heads=hf.linear_num_key_heads, gdn_v_heads=hf.linear_num_value_heads,
        gdn_k_dim=hf.linear_key_head_dim, gdn_v_dim=hf.linear_value_head_dim, d_conv=hf.linear_conv_kernel_dim,
    )
    if not all(sparse):                      # the dense MLP's width matters only where a layer has one
        fields["mlp_hidden"] = hf.intermediate_size
    if any(sparse):
        h, shared = hf.moe_intermediate_size, hf_get(hf, "shared_expert_intermediate_size", 0) or 0
        require(shared > 0, ARCH, f"shared_expert_intermediate_size {shared} (a shared expert is always built)")
        fields.update(moe_experts=hf.num_experts, moe_topk=hf.num_experts_per_tok, moe_hidden=h,
                      moe_shared=True, moe_shared_hidden=shared if shared != h else None, moe_shared_gate=True,
                      moe_router="softmax", moe_norm_topk=bool(hf_get(hf, "norm_topk_prob", True)))
    return fields


def _plus_one(w: Tensor) -> Tensor:
    """Zero-centred RMSNorm weight w (x·(1 + w)) -> our gain 1 + w, in float32 as transformers computes it (float64
    stays float64: native export numbers weights in it)."""
    return 1.0 + w.to(torch.promote_types(w.dtype, torch.float32))


def _moe(out: dict[str, Tensor], prefix: str, s: Tensors, cfg: ModelConfig):
    """Qwen3-Next's sparse block -> RoutedMoE: experts gate_up_proj [E, 2h, d] -> w_gate, w_up [E, d, h];
    down_proj [E, d, h] -> w_down [E, h, d] (or, as checkpoints store them, experts.{e}.gate/up/down_proj.weight);
    the shared expert -> `shared`, its gate -> `shared_gate`."""
    gate, up, down = stacked_experts(Tensors(s, "mlp."), cfg.moe_experts, cfg.moe_hidden)
    routed_experts(out, prefix, gate=gate, up=up, down=down)
    out[prefix + "router.weight"] = s["mlp.gate.weight"]
    shared = Tensors(s, "mlp.shared_expert.")
    out[prefix + "shared.w_in.weight"] = torch.cat((shared["gate_proj.weight"], shared["up_proj.weight"]))
    out[prefix + "shared.w_out.weight"] = shared["down_proj.weight"]
    out[prefix + "shared_gate.weight"] = s["mlp.shared_expert_gate.weight"]


def qwen3_next_weights(sd: Tensors, cfg: ModelConfig) -> dict[str, Tensor]:
    out = head_tensors(sd, cfg, "model.embed_tokens.weight", "model.norm.weight")
    out["norm.weight"] = _plus_one(out["norm.weight"])
    for s, a, m in decoder_layers(sd, out):
        for b in (a, m):
            out[b + "norm.weight"] = _plus_one(out[b + "norm.weight"])
        if "linear_attn.A_log" in s:
            copy_renamed(out, a + "mixer.", s, _GDN)
            out[a + "mixer.conv.weight"] = s["linear_attn.conv1d.weight"].squeeze(1)      # [C, 1, K] -> [C, K]
        else:                                 # q_proj rows per head: [query | gate], as our output-gated qkv
            fused_attention(out, a + "mixer.", s)
            for n in ("q_norm", "k_norm"):
                out[f"{a}mixer.{n}.weight"] = _plus_one(s[f"self_attn.{n}.weight"])
        if "mlp.gate.weight" in s:
            _moe(out, m + "mixer.", s, cfg)
        else:
            gated_mlp(out, m + "mixer.", s)
    return out


def qwen3_next_twin(d_model: int, n_layers: int, vocab_size: int, max_seq_len: int):
    """The transformers config of presets.get("qwen3-next", d_model=..., n_layers=...): every 4th layer attention."""
    from transformers import Qwen3NextConfig
    hk = max(1, d_model // 128)
    return Qwen3NextConfig(
        vocab_size=vocab_size, hidden_size=d_model, num_hidden_layers=n_layers, max_position_embeddings=max_seq_len,
        num_attention_heads=2 * max(1, d_model // 128), num_key_value_heads=2, head_dim=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        linear_num_key_heads=hk, linear_num_value_heads=2 * hk, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=d_model,
        shared_expert_intermediate_size=d_model, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        intermediate_size=d_model, rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu")


register("qwen3_next", ARCH, qwen3_next_config, qwen3_next_weights)
TWINS["qwen3-next"] = qwen3_next_twin
