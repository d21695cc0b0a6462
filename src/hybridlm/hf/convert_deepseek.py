"""Converters for transformers' DeepSeek-V3 (`DeepseekV3ForCausalLM` -> layout "(LM)*n") and DeepSeek-V3.2
(`DeepseekV32ForCausalLM` -> "(IM)*n": MLA under the lightning indexer). Dense MLP layers only: routed-MoE
layers are refused. Our MLA keeps transformers' row layouts (q_b rows [head, (nope, rope)], kv_a rows
[latent, rope], kv_b rows [head, (k_nope, v)]), so every weight is copied as is.
"""
from torch import Tensor

from ..models.config import ModelConfig
from .common import (Tensors, decoder_layers, gated_mlp, head_tensors, hf_activation, hf_get, hf_rope_base, hf_tied,
                     register, require)

_ARCH = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM"}


def deepseek_config(hf) -> dict:
    arch = _ARCH[hf.model_type]
    v32 = hf.model_type == "deepseek_v32"
    n = hf.num_hidden_layers
    mlp_types = hf_get(hf, "mlp_layer_types")
    dense = all(t == "dense" for t in mlp_types) if mlp_types else (hf_get(hf, "first_k_dense_replace") or 0) >= n
    require(dense, arch, "routed-MoE MLP layers (only dense layers: first_k_dense_replace >= num_hidden_layers)")
    require((hf_get(hf, "num_key_value_heads") or hf.num_attention_heads) == hf.num_attention_heads, arch,
          "num_key_value_heads != num_attention_heads")
    require(int(hf_get(hf, "pretraining_tp", 1) or 1) == 1, arch, f"pretraining_tp {hf_get(hf, 'pretraining_tp')}")
    fields = dict(
        layout=f"({'I' if v32 else 'L'}M)*{n}", vocab_size=hf.vocab_size, d_model=hf.hidden_size,
        max_seq_len=int(hf_get(hf, "max_position_embeddings", 4096)), tie_embeddings=hf_tied(hf), norm="rms",
        norm_eps=float(hf.rms_norm_eps), pos_embedding="rope", n_heads=hf.num_attention_heads,
        head_dim=hf.v_head_dim, rope_base=hf_rope_base(arch, hf), attn_bias=bool(hf_get(hf, "attention_bias", False)),
        mlp_hidden=hf.intermediate_size, mlp_act=hf_activation(arch, hf.hidden_act, "MLP"), mlp_gated=True,
        mla_kv_lora_rank=hf.kv_lora_rank, mla_q_lora_rank=hf_get(hf, "q_lora_rank") or 0,
        mla_qk_nope_dim=hf.qk_nope_head_dim, mla_rope_dim=hf.qk_rope_head_dim, mla_v_dim=hf.v_head_dim,
        # V3.2's attention always rotates interleaved pairs; V3 follows its `rope_interleave` flag
        mla_rope_interleaved=True if v32 else bool(hf_get(hf, "rope_interleave", True)),
    )
    if v32:
        fields.update(dsa_n_heads=hf.index_n_heads, dsa_head_dim=hf.index_head_dim,
                      dsa_rope_dim=hf.qk_rope_head_dim, dsa_topk=hf.index_topk, dsa_attention="L")
    return fields


def deepseek_weights(sd: Tensors, cfg: ModelConfig) -> dict[str, Tensor]:
    out = head_tensors(sd, cfg, "model.embed_tokens.weight", "model.norm.weight")
    indexed = cfg.layout.startswith("(I")
    names = {"q_a_proj": "q_a", "q_a_layernorm": "q_norm", "q_b_proj": "q_b", "q_proj": "q_proj",
             "kv_a_proj_with_mqa": "kv_a", "kv_a_layernorm": "kv_norm", "kv_b_proj": "kv_b", "o_proj": "out",
             "indexer.wq_b": "indexer.wq", "indexer.wk": "indexer.wk", "indexer.k_norm": "indexer.k_norm",
             "indexer.weights_proj": "indexer.w"}
    for s, a, m in decoder_layers(sd, out):                 # attention block, then MLP block
        for key, t in Tensors(s, "self_attn.").items():
            module, param = key.rsplit(".", 1)
            ours = names[module]
            if indexed and not ours.startswith("indexer."):
                ours = "attn." + ours                       # I wraps the MLA as `attn`
            out[f"{a}mixer.{ours}.{param}"] = t
        gated_mlp(out, m + "mixer.", s)
    return out


register("deepseek_v3", _ARCH["deepseek_v3"], deepseek_config, deepseek_weights)
register("deepseek_v32", _ARCH["deepseek_v32"], deepseek_config, deepseek_weights)
