"""Converter for transformers' LFM2 (`Lfm2ForCausalLM`): each layer is a gated short convolution (our `C`) or
attention with q/k RMSNorm (`A`, `qk_norm`), then a SwiGLU MLP, so the layout is its `layer_types` as "CM"/"AM" units,
runs of equal units written `(CM)*k`. The model's `embedding_norm` is applied after the last layer: our final norm.
The MLP width is transformers' (`block_auto_adjust_ff_dim`: int(2/3 · intermediate_size), times
`block_ffn_dim_multiplier`, rounded up to `block_multiple_of`).
"""
import torch
from torch import Tensor

from ..models.config import ModelConfig
from ..models.layout import fold_layout
from .common import (TWINS, Tensors, copy_renamed, decoder_layers, head_tensors, hf_get, hf_rope_base, hf_tied,
                     register, unsupported)

ARCH = "Lfm2ForCausalLM"
_UNIT = {"conv": "CM", "full_attention": "AM"}


def lfm2_mlp_width(hf) -> int:
    """The SwiGLU width transformers' Lfm2MLP builds from the config."""
    width = hf.intermediate_size
    if hf_get(hf, "block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        mult = hf_get(hf, "block_ffn_dim_multiplier")
        if mult is not None:
            width = int(mult * width)
            k = hf.block_multiple_of
            width = k * ((width + k - 1) // k)
    return width


def lfm2_config(hf) -> dict:
    types = list(hf.layer_types)
    for t in types:
        if t not in _UNIT:
            unsupported(ARCH, f"layer type {t!r} (supported: {', '.join(_UNIT)})")
    d, heads = hf.hidden_size, hf.num_attention_heads
    return dict(
        layout=fold_layout([_UNIT[t] for t in types]), vocab_size=hf.vocab_size, d_model=d,
        max_seq_len=int(hf_get(hf, "max_position_embeddings", 128_000)), tie_embeddings=hf_tied(hf), norm="rms",
        norm_eps=float(hf.norm_eps), pos_embedding="rope", n_heads=heads,
        n_kv_heads=hf_get(hf, "num_key_value_heads") or heads, head_dim=hf_get(hf, "head_dim") or d // heads,
        rope_base=hf_rope_base(ARCH, hf), qk_norm=True, attn_bias=False,
        mlp_hidden=lfm2_mlp_width(hf), mlp_act="silu", mlp_gated=True, mlp_bias=False,
        d_conv=int(hf.conv_L_cache), conv_bias=bool(hf_get(hf, "conv_bias", False)),
    )


_ATTN = {"out.weight": "self_attn.out_proj.weight", "q_norm.weight": "self_attn.q_layernorm.weight",
         "k_norm.weight": "self_attn.k_layernorm.weight"}
_CONV = {"in_proj.weight": "conv.in_proj.weight", "out_proj.weight": "conv.out_proj.weight"}
_CONV_BIASES = {"in_proj.bias": "conv.in_proj.bias", "out_proj.bias": "conv.out_proj.bias",
                "conv.bias": "conv.conv.bias"}


def lfm2_weights(sd: Tensors, cfg: ModelConfig) -> dict[str, Tensor]:
    # its "embedding_norm" is the final norm
    out = head_tensors(sd, cfg, "model.embed_tokens.weight", "model.embedding_norm.weight")
    for s, a, m in decoder_layers(sd, out, "operator_norm", "ffn_norm"):
        if "conv.in_proj.weight" in s:
            copy_renamed(out, a + "mixer.", s, _CONV)
            copy_renamed(out, a + "mixer.", s, _CONV_BIASES, optional=True)
            out[a + "mixer.conv.weight"] = s["conv.conv.weight"].squeeze(1)     # [d, 1, K] -> [d, K]
        else:
            out[a + "mixer.qkv.weight"] = torch.cat([s[f"self_attn.{p}_proj.weight"] for p in "qkv"])
            copy_renamed(out, a + "mixer.", s, _ATTN)
        out[m + "mixer.w_in.weight"] = torch.cat((s["feed_forward.w1.weight"], s["feed_forward.w3.weight"]))
        copy_renamed(out, m + "mixer.", s, {"w_out.weight": "feed_forward.w2.weight"})
    return out


register("lfm2", ARCH, lfm2_config, lfm2_weights)


def lfm2_twin(d_model: int, n_layers: int, vocab_size: int, max_seq_len: int):
    """transformers' config of `presets.get("lfm2", d_model=..., n_layers=..., ...)`."""
    from transformers import Lfm2Config
    heads = max(1, d_model // 64)
    return Lfm2Config(vocab_size=vocab_size, hidden_size=d_model, intermediate_size=3 * d_model,
                      block_auto_adjust_ff_dim=False, num_hidden_layers=n_layers, num_attention_heads=heads,
                      num_key_value_heads=max(1, heads // 2) if heads % 2 == 0 else heads,
                      max_position_embeddings=max_seq_len, norm_eps=1e-5, conv_L_cache=3, conv_bias=False,
                      layer_types=[_lfm2_type(i) for i in range(n_layers)], tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                      pad_token_id=None, bos_token_id=None, eos_token_id=None)


def _lfm2_type(i: int) -> str:
    """The preset's pattern: two conv layers, then attention (LFM2-350M puts 6 attention layers among 16)."""
    return "full_attention" if i % 3 == 2 else "conv"


TWINS["lfm2"] = lfm2_twin
