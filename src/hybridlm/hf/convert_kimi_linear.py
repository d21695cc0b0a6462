"""Converter for transformers' Kimi-Linear (`KimiLinearForCausalLM`): each decoder layer is a token mixer, `K`
(Kimi Delta Attention, `linear_attention`) or `L` (MLA with no positional encoding, `full_attention`), then a
channel mixer, `M` (dense SwiGLU) or `O` (DeepSeek-style routed MoE, `sparse`). The released 48B-A3B model (full
attention at layers 4, 8, ..., 24 and 27) is "KM (KO KO LO KO)*6 KO LO". Kimi has no RoPE anywhere, so the model is
pos_embedding="none" (our MLA then leaves its shared key part unrotated, as transformers does).

Weights: q/k/v projections -> our fused `qkv` (rows [q; k; v], the order of transformers' concatenated conv),
conv1d [3HD, 1, K] -> [3HD, K], A_log [1, 1, H, 1] -> [H]; the MLA keeps transformers' row layouts (as for
DeepSeek-V3).
"""
import torch
from torch import Tensor

from ..models.config import ModelConfig
from .common import _activation, _decoder_layers, _gated_mlp, _get, _head, _need, _Tensors, _tied, register

ARCH = "KimiLinearForCausalLM"


def compress_layout(tokens: list[str]) -> str:
    """Per-layer tokens ("KM", "LO", ...) -> a layout string with the longest repeats folded as (...)*n."""
    out, i = [], 0
    while i < len(tokens):
        best = (1, 1)                                     # (period, repeats)
        for p in range(1, 9):
            r = 1
            while tokens[i + r * p: i + (r + 1) * p] == tokens[i: i + p] and i + (r + 1) * p <= len(tokens):
                r += 1
            if r > 1 and p * r > best[0] * best[1]:
                best = (p, r)
        p, r = best
        unit = " ".join(tokens[i: i + p])
        out.append(unit if r == 1 else (f"({unit})*{r}" if p > 1 or len(unit) > 1 else f"{unit}*{r}"))
        i += p * r
    return " ".join(out)


def _layer_types(hf) -> tuple[list[str], list[str]]:
    n = hf.num_hidden_layers
    mixers, mlps = list(hf.layer_types or []), list(hf.mlp_layer_types or [])
    _need(len(mixers) == n and len(mlps) == n, ARCH, "layer_types / mlp_layer_types not of num_hidden_layers entries")
    for t in mixers:
        _need(t in ("linear_attention", "full_attention"), ARCH, f"layer type {t!r}")
    for t in mlps:
        _need(t in ("dense", "sparse"), ARCH, f"mlp layer type {t!r}")
    return mixers, mlps


def kimi_config(hf) -> dict:
    mixers, mlps = _layer_types(hf)
    _need("sparse" not in mlps, ARCH, "routed-MoE (sparse) MLP layers")
    _need((_get(hf, "num_key_value_heads") or hf.num_attention_heads) == hf.num_attention_heads, ARCH,
          "num_key_value_heads != num_attention_heads (transformers' MLA expands every head)")
    _need(int(_get(hf, "pretraining_tp", 1) or 1) == 1, ARCH, f"pretraining_tp {_get(hf, 'pretraining_tp')}")
    act = _activation(ARCH, hf.hidden_act, "MLP and short-conv")
    tokens = [("K" if m == "linear_attention" else "L") + ("M" if f == "dense" else "O") for m, f in zip(mixers, mlps)]
    return dict(
        layout=compress_layout(tokens), vocab_size=hf.vocab_size, d_model=hf.hidden_size,
        max_seq_len=int(_get(hf, "max_position_embeddings", 1 << 20)), tie_embeddings=_tied(hf), norm="rms",
        norm_eps=float(hf.rms_norm_eps), pos_embedding="none", n_heads=hf.num_attention_heads,
        head_dim=hf.v_head_dim, attn_bias=bool(_get(hf, "attention_bias", False)),
        mlp_hidden=hf.intermediate_size, mlp_act=act, mlp_gated=True,
        mla_kv_lora_rank=hf.kv_lora_rank, mla_q_lora_rank=_get(hf, "q_lora_rank") or 0,
        mla_qk_nope_dim=hf.qk_nope_head_dim, mla_rope_dim=hf.qk_rope_head_dim, mla_v_dim=hf.v_head_dim,
        kda_heads=hf.linear_num_heads, kda_head_dim=hf.linear_head_dim, kda_d_conv=hf.linear_conv_kernel_dim,
        kda_rank=hf.linear_head_dim,
    )


_MLA = {"q_a_proj": "q_a", "q_a_layernorm": "q_norm", "q_b_proj": "q_b", "q_proj": "q_proj",
        "kv_a_proj_with_mqa": "kv_a", "kv_a_layernorm": "kv_norm", "kv_b_proj": "kv_b", "o_proj": "out"}
_KDA = {"forget_gate.f_a_proj.weight": "f_a.weight", "forget_gate.f_b_proj.weight": "f_b.weight",
        "forget_gate.dt_bias": "dt_bias", "b_proj.weight": "b_proj.weight", "g_a_proj.weight": "g_a.weight",
        "g_b_proj.weight": "g_b.weight", "o_norm.weight": "norm_weight", "o_proj.weight": "o_proj.weight"}


def kimi_weights(sd: _Tensors, cfg: ModelConfig) -> dict[str, Tensor]:
    out = _head(sd, cfg, "model.embed_tokens.weight", "model.norm.weight")
    for s, a, m in _decoder_layers(sd, out):
        at = _Tensors(s, "self_attn.")
        if "forget_gate.A_log" in at:                       # KDA
            out[a + "mixer.qkv.weight"] = torch.cat([at[f"{p}_proj.weight"] for p in "qkv"], 0)
            out[a + "mixer.conv_weight"] = at["conv1d.weight"].squeeze(1)
            out[a + "mixer.A_log"] = at["forget_gate.A_log"].reshape(-1)
            for theirs, ours in _KDA.items():
                out[a + "mixer." + ours] = at[theirs]
        else:                                              # MLA
            for key, t in at.items():
                module, param = key.rsplit(".", 1)
                out[f"{a}mixer.{_MLA[module]}.{param}"] = t
        _gated_mlp(out, m + "mixer.", s)
    return out


register("kimi_linear", ARCH, kimi_config, kimi_weights)
