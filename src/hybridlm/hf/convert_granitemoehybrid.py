"""Converter for transformers' Granite-4.0 hybrid (`GraniteMoeHybridForCausalLM`): each decoder layer is a Mamba-2
mixer or attention (RoPE when position_embedding_type is "rope", none otherwise), then the channel block: the
shared SwiGLU MLP alone (num_local_experts 0) or plus a routed MoE (top-k of the router logits, softmax over the
chosen) as our O with its shared expert. Layer i -> our blocks 2i (S or A) and 2i+1 (M or O).

Granite's constant multipliers are folded into the weights (exact up to float32 rounding), so they need no model
option: attention_multiplier (the softmax scale) into the query rows as multiplier · √head_dim, residual_multiplier
(each branch's output) into every output projection, 1/logits_scaling into the final norm's weight (works tied or
not); embedding_multiplier is our embed_scale.
"""
import math

import torch
from torch import Tensor

from ..models.config import ModelConfig
from ..models.layout import fold_layout
from .common import (TWINS, Tensors, decoder_layers, fused_attention, head_tensors, hf_activation, hf_get,
                     hf_rope_base, hf_tied, mamba2_fields, mamba2_mixer, register, require, routed_experts, scaled)

ARCH = "GraniteMoeHybridForCausalLM"
_MIXERS = {"linear_attention": "S", "mamba": "S", "full_attention": "A", "attention": "A"}
# MoE tensors: the name transformers holds, then the name checkpoints store
_MOE = {"router": ("block_sparse_moe.router.weight", "block_sparse_moe.router.layer.weight"),
        "gate_up": ("block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.input_linear.weight"),
        "down": ("block_sparse_moe.experts.down_proj", "block_sparse_moe.output_linear.weight")}


def granite_config(hf) -> dict:
    n, types = hf.num_hidden_layers, list(hf.layer_types)
    bad = sorted(set(types) - set(_MIXERS))
    require(not bad, ARCH, f"layer_types {bad}")
    require(len(types) == n, ARCH, f"{len(types)} layer_types for {n} layers")
    require(float(hf_get(hf, "attention_dropout", 0) or 0) == 0, ARCH, "attention_dropout")
    pos = hf_get(hf, "position_embedding_type")
    require(pos in (None, "nope", "rope"), ARCH, f"position_embedding_type {pos!r}")
    experts = int(hf_get(hf, "num_local_experts", 0) or 0)
    n_heads = hf.num_attention_heads
    head_dim = hf_get(hf, "head_dim") or hf.hidden_size // n_heads
    # (its rotary embedding always rotates the whole head, whatever partial_rotary_factor says: refused)
    base = hf_rope_base(ARCH, hf) if pos == "rope" else 10000.0
    fields = dict(
        layout=fold_layout([_MIXERS[t] + ("O" if experts else "M") for t in types]), vocab_size=hf.vocab_size,
        d_model=hf.hidden_size, max_seq_len=int(hf_get(hf, "max_position_embeddings", 2048)),
        tie_embeddings=hf_tied(hf),
        norm="rms", norm_eps=float(hf.rms_norm_eps), pos_embedding="rope" if pos == "rope" else "none",
        embed_scale=float(hf_get(hf, "embedding_multiplier", 1.0)), n_heads=n_heads,
        n_kv_heads=hf_get(hf, "num_key_value_heads") or n_heads, head_dim=head_dim, rope_base=base,
        attn_bias=bool(hf_get(hf, "attention_bias", False)),
        mlp_hidden=hf.shared_intermediate_size, mlp_act=hf_activation(ARCH, hf.hidden_act, "MLP"), mlp_gated=True,
        **mamba2_fields(ARCH, hf, d_model=hf.hidden_size, n_heads=hf.mamba_n_heads, head_dim=hf.mamba_d_head,
                         n_groups=hf.mamba_n_groups, d_state=hf.mamba_d_state, d_conv=hf.mamba_d_conv,
                         chunk_size=hf.mamba_chunk_size, conv_bias=bool(hf.mamba_conv_bias),
                         proj_bias=bool(hf.mamba_proj_bias), act=hf.hidden_act),
    )
    if experts:  # softmax over the top-k logits = softmax over all, top-k, renormalised
        fields.update(moe_experts=experts, moe_topk=hf.num_experts_per_tok, moe_hidden=hf.intermediate_size,
                      moe_shared=True, moe_shared_hidden=hf.shared_intermediate_size, moe_router="softmax",
                      moe_norm_topk=True)
    return fields


def granite_weights(sd: Tensors, cfg: ModelConfig, hf) -> dict[str, Tensor]:
    """Granite's state dict -> ours, folding attention_multiplier, residual_multiplier and 1/logits_scaling."""
    res = float(hf_get(hf, "residual_multiplier", 1.0))
    out = head_tensors(sd, cfg, "model.embed_tokens.weight", "model.norm.weight")
    out["norm.weight"] = scaled(out["norm.weight"], 1.0 / float(hf_get(hf, "logits_scaling", 1.0)))
    q_rows = cfg.n_heads * cfg.attn_head_dim
    q_scale = float(hf_get(hf, "attention_multiplier", 1.0)) * math.sqrt(cfg.attn_head_dim)  # ours scales by 1/√D
    for s, a, m in decoder_layers(sd, out):
        a, m = a + "mixer.", m + "mixer."
        if "mamba.A_log" in s:
            mamba2_mixer(out, a, Tensors(s, "mamba."), scale=res)
        else:
            fused_attention(out, a, s)
            for p in ("weight", "bias"):
                if a + f"qkv.{p}" in out:
                    t = out[a + f"qkv.{p}"]
                    out[a + f"qkv.{p}"] = torch.cat((scaled(t[:q_rows], q_scale), t[q_rows:]))
                if a + f"out.{p}" in out:
                    out[a + f"out.{p}"] = scaled(out[a + f"out.{p}"], res)
        moe = {ours: next((n for n in names if n in s), None) for ours, names in _MOE.items()}
        shared = m + ("shared." if moe["router"] else "")
        out[shared + "w_in.weight"] = s["shared_mlp.input_linear.weight"]          # rows [gate; up], as ours
        out[shared + "w_out.weight"] = scaled(s["shared_mlp.output_linear.weight"], res)
        if moe["router"]:
            gate, up = s[moe["gate_up"]].chunk(2, dim=1)
            out[m + "router.weight"] = s[moe["router"]]
            routed_experts(out, m, gate=gate, up=up, down=s[moe["down"]], scale=res)
    return out


def granite_twin(d_model: int, n_layers: int, vocab_size: int, max_seq_len: int):
    """The transformers config of presets.get("granite-hybrid", ...): Mamba-2 layers with attention (no RoPE) where
    `presets.spread` puts it, each followed by the shared SwiGLU MLP."""
    from transformers import GraniteMoeHybridConfig

    from ..models.presets import spread
    types = ["full_attention" if c == "A" else "linear_attention" for c in spread(n_layers, 8, "S", "A")]
    return GraniteMoeHybridConfig(vocab_size=vocab_size, hidden_size=d_model, num_hidden_layers=n_layers,
                                  layer_types=types, num_attention_heads=d_model // 64,
                                  num_key_value_heads=max(1, d_model // 256), max_position_embeddings=max_seq_len,
                                  num_local_experts=0, shared_intermediate_size=3 * d_model,
                                  mamba_n_heads=2 * d_model // 64, mamba_d_head=64, mamba_d_state=64,
                                  mamba_chunk_size=64, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                  pad_token_id=None, bos_token_id=None, eos_token_id=None)


register("granitemoehybrid", ARCH, granite_config, granite_weights, with_config=True)
TWINS["granite-hybrid"] = granite_twin
