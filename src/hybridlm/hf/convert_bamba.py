"""Converter for transformers' Bamba (`BambaForCausalLM`): every decoder layer is a Mamba-2 mixer or, at
`attn_layer_indices`, attention with partial RoPE (`partial_rotary_factor`, 0.5 in transformers' config), each
followed by a SwiGLU MLP, both pre-norm. Layer i -> our blocks 2i (S or A) and 2i+1 (M): "SM SM AM ...".
z_loss_coefficient only adds a training loss term (logits are unchanged) and is not mirrored."""
from torch import Tensor

from ..models.config import ModelConfig
from ..models.layout import fold_layout
from .common import (TWINS, Tensors, decoder_layers, fused_attention, gated_mlp, head_tensors, hf_activation, hf_get,
                     hf_rope_partial, hf_tied, mamba2_fields, mamba2_mixer, register, require)

ARCH = "BambaForCausalLM"


def bamba_layout(n_layers: int, attn: set[int]) -> str:
    """The layout of n Bamba layers with attention at `attn`: e.g. "(SM)*2 AM SM"."""
    return fold_layout([("A" if i in attn else "S") + "M" for i in range(n_layers)])


def bamba_config(hf) -> dict:
    n = hf.num_hidden_layers
    attn = set(hf_get(hf, "attn_layer_indices") or ())
    require(all(0 <= i < n for i in attn), ARCH, f"attn_layer_indices {sorted(attn)} outside {n} layers")
    require(float(hf_get(hf, "attention_dropout", 0) or 0) == 0, ARCH, "attention_dropout")
    n_heads = hf.num_attention_heads
    head_dim = hf_get(hf, "head_dim") or hf.hidden_size // n_heads
    base, rope_dim = hf_rope_partial(ARCH, hf, head_dim)
    act = hf_activation(ARCH, hf.hidden_act, "MLP")
    return dict(
        layout=bamba_layout(n, attn), vocab_size=hf.vocab_size, d_model=hf.hidden_size,
        max_seq_len=int(hf_get(hf, "max_position_embeddings", 262144)), tie_embeddings=hf_tied(hf), norm="rms",
        norm_eps=float(hf.rms_norm_eps), pos_embedding="rope", n_heads=n_heads,
        n_kv_heads=hf_get(hf, "num_key_value_heads") or n_heads, head_dim=head_dim, rope_base=base, rope_dim=rope_dim,
        attn_bias=bool(hf_get(hf, "attention_bias", False)), mlp_hidden=hf.intermediate_size, mlp_act=act,
        mlp_gated=True, mlp_bias=bool(hf_get(hf, "mlp_bias", False)),
        **mamba2_fields(ARCH, hf, d_model=hf.hidden_size, n_heads=hf.mamba_n_heads, head_dim=hf.mamba_d_head,
                         n_groups=hf.mamba_n_groups, d_state=hf.mamba_d_state, d_conv=hf.mamba_d_conv,
                         chunk_size=hf.mamba_chunk_size, conv_bias=bool(hf.mamba_conv_bias),
                         proj_bias=bool(hf.mamba_proj_bias), act=hf.hidden_act),
    )


def bamba_weights(sd: Tensors, cfg: ModelConfig) -> dict[str, Tensor]:
    out = head_tensors(sd, cfg, "model.embed_tokens.weight", "model.final_layernorm.weight")
    for s, a, m in decoder_layers(sd, out, "input_layernorm", "pre_ff_layernorm"):
        if "mamba.A_log" in s:
            mamba2_mixer(out, a + "mixer.", Tensors(s, "mamba."))
        else:
            fused_attention(out, a + "mixer.", s)
        gated_mlp(out, m + "mixer.", s, name="feed_forward")
    return out


def bamba_twin(d_model: int, n_layers: int, vocab_size: int, max_seq_len: int):
    """The transformers config of presets.get("bamba", ...) (attention in layers `presets.spread` picks)."""
    from transformers import BambaConfig

    from ..models.presets import spread
    attn = [i for i, c in enumerate(spread(n_layers, 8, "S", "A")) if c == "A"]
    return BambaConfig(vocab_size=vocab_size, hidden_size=d_model, intermediate_size=3 * d_model,
                       num_hidden_layers=n_layers, num_attention_heads=d_model // 64,
                       num_key_value_heads=max(1, d_model // 128),
                       max_position_embeddings=max_seq_len, attn_layer_indices=attn, mamba_n_heads=2 * d_model // 64,
                       mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64, mamba_chunk_size=64,
                       rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=None, bos_token_id=None,
                       eos_token_id=None)


register("bamba", ARCH, bamba_config, bamba_weights)
TWINS["bamba"] = bamba_twin
