"""Converter for transformers' Doge (`DogeForCausalLM` -> layout "(AM)*n", or "(AE)*n" with is_moe): attention
with the dt dynamic mask, q/k RMSNorm, learnable per-channel residual weights (transformers 5.23's design).

The dense form computes exactly the same function. The MoE form copies every weight, but transformers'
DogeCDMoE views its router logits as (2, tokens, √N), mixing tokens (its routing then depends on other,
even later, tokens); our CDMoE splits each token's own logits, so the two agree only for a single token.
"""
import math

from torch import Tensor

from ..models.config import ModelConfig
from .common import (Tensors, copy_renamed, decoder_layers, fused_attention, gated_mlp, head_tensors, hf_activation,
                     hf_get, hf_rope_base, hf_tied, register, require)

ARCH = "DogeForCausalLM"
# ours (under the attention block's mixer) -> theirs; the names match, only the self_attn. prefix differs
_DOGE_ATTN = {n: "self_attn." + n for n in ("q_norm.weight", "k_norm.weight", "dt_proj.weight", "dt_proj.bias", "A")}
# ours (under the CDMoE block's mixer) -> theirs: the router and expert embeddings
_DOGE_MOE = {"router.weight": "mlp.router_gate.weight", "down_embed.weight": "mlp.down_embed.weight",
             "up_embed.weight": "mlp.up_embed.weight"}


def doge_config(hf) -> dict:
    n, max_pos = hf.num_hidden_layers, int(hf_get(hf, "max_position_embeddings", 2048))
    require(float(hf_get(hf, "hidden_dropout", 0) or 0) == 0 and float(hf_get(hf, "attention_dropout", 0) or 0) == 0,
          ARCH, "dropout")
    keep = int(hf_get(hf, "keep_window_size", 2048))
    fields = dict(
        layout=f"(A{'E' if hf.is_moe else 'M'})*{n}", vocab_size=hf.vocab_size, d_model=hf.hidden_size,
        max_seq_len=max_pos, tie_embeddings=hf_tied(hf), norm="rms", norm_eps=float(hf.rms_norm_eps),
        pos_embedding="rope", residual_scale=True, n_heads=hf.num_attention_heads,
        n_kv_heads=hf_get(hf, "num_key_value_heads") or hf.num_attention_heads,
        head_dim=hf.hidden_size // hf.num_attention_heads, rope_base=hf_rope_base(ARCH, hf), qk_norm=True,
        attn_bias=bool(hf_get(hf, "attention_bias", False)), window=hf_get(hf, "sliding_window"),
        mlp_hidden=hf.intermediate_size, mlp_act=hf_activation(ARCH, hf.hidden_act, "MLP"), mlp_gated=True,
        mlp_bias=bool(hf_get(hf, "mlp_bias", False)),
        # transformers selects keys only when there are more than keep_window_size of them
        wm_dyn_mask="dt", wm_keep_window=keep if keep < max_pos else None,
    )
    if hf.is_moe:
        E = hf.num_experts
        require(math.isqrt(E) ** 2 == E, ARCH, f"num_experts {E} that is not a perfect square")
        fields.update(wm_cdmoe_form="doge", wm_cdmoe_experts=E, wm_cdmoe_topk=hf.num_experts_per_tok,
                      wm_cdmoe_heads=1, wm_cdmoe_hidden=hf.intermediate_size)
    return fields


def doge_weights(sd: Tensors, cfg: ModelConfig) -> dict[str, Tensor]:
    out = head_tensors(sd, cfg, "model.embed_tokens.weight", "model.norm.weight")
    for s, a, m in decoder_layers(sd, out):                 # attention block, then MLP / CDMoE block
        copy_renamed(out, a, s, {"res_weight": "input_residual"})
        copy_renamed(out, m, s, {"res_weight": "post_attention_residual"})
        fused_attention(out, a + "mixer.", s)
        copy_renamed(out, a + "mixer.", s, _DOGE_ATTN, optional=True)
        moe = "mlp.router_gate.weight" in s
        gated_mlp(out, m + ("mixer.shared." if moe else "mixer."), s)   # the CDMoE's shared expert is Doge's MLP
        if moe:
            copy_renamed(out, m + "mixer.", s, _DOGE_MOE)
    return out


register("doge", ARCH, doge_config, doge_weights)
