"""Converter for transformers' Nemotron-H (`NemotronHForCausalLM`): each layer is ONE pre-norm block whose mixer is
Mamba-2, attention (no positional encoding at all), a squared-ReLU MLP (not gated) or a routed MoE, so the
`hybrid_override_pattern` maps letter for letter: M -> S, * -> A, - -> M, E -> O ("M-M*-" -> "SMSAM").

transformers' Nemotron-H clamps dt to (time_step_min, inf) in its chunked scan whatever `time_step_limit` says (and
not in its one-token step): we clamp in both (ssd_dt_limit), so our decoding equals our prefill. Its attention
and MLP linears ignore `attention_bias`; its lm_head is never tied; `residual_in_fp32` is not read by its forward;
multi-token-prediction layers (`num_nextn_predict_layers`) are not part of the model's logits and are not converted.
"""
from torch import Tensor

from ..models.config import ModelConfig
from .common import TWINS, _activation, _copy, _fused_attention, _get, _head, _mamba2_fields, _mamba2_mixer, _need, \
    _Tensors, register

ARCH = "NemotronHForCausalLM"
LETTERS = {"linear_attention": "S", "full_attention": "A", "mlp": "M", "moe": "O"}


def nemotron_h_config(hf) -> dict:
    types = list(hf.layers_block_type)
    bad = sorted(set(types) - set(LETTERS))
    _need(not bad, ARCH, f"layers_block_type {bad}")
    _need("moe" not in types, ARCH, "MoE layers ('E' in hybrid_override_pattern) before the MoE options land")
    _need(_get(hf, "sliding_window") is None, ARCH, f"sliding_window {_get(hf, 'sliding_window')}")
    _need(_get(hf, "moe_latent_size") is None, ARCH, f"moe_latent_size {_get(hf, 'moe_latent_size')}")
    for name in ("attention_dropout", "hidden_dropout"):
        _need(float(_get(hf, name, 0) or 0) == 0, ARCH, name)
    n_heads = hf.num_attention_heads
    return dict(
        layout="".join(LETTERS[t] for t in types), vocab_size=hf.vocab_size, d_model=hf.hidden_size,
        max_seq_len=int(_get(hf, "max_position_embeddings", 4096)), tie_embeddings=False, norm="rms",
        norm_eps=float(hf.layer_norm_epsilon), pos_embedding="none", n_heads=n_heads,
        n_kv_heads=_get(hf, "num_key_value_heads") or n_heads, head_dim=_get(hf, "head_dim") or hf.hidden_size // n_heads,
        mlp_hidden=hf.intermediate_size, mlp_act=_activation(ARCH, hf.mlp_hidden_act, "MLP"), mlp_gated=False,
        mlp_bias=bool(_get(hf, "mlp_bias", False)),
        ssd_dt_min=float(hf.time_step_min), ssd_dt_max=float(hf.time_step_max),
        **_mamba2_fields(ARCH, hf, d_model=hf.hidden_size, n_heads=hf.mamba_num_heads, head_dim=hf.mamba_head_dim,
                         n_groups=hf.n_groups, d_state=hf.ssm_state_size, d_conv=hf.conv_kernel,
                         chunk_size=hf.chunk_size, conv_bias=bool(hf.use_conv_bias), proj_bias=bool(hf.use_bias),
                         act=hf.mamba_hidden_act, dt_limit=(float(hf.time_step_min), float("inf"))),
    )


def nemotron_h_weights(sd: _Tensors, cfg: ModelConfig) -> dict[str, Tensor]:
    out = _head(sd, cfg, "model.embeddings.weight", "model.norm_f.weight")
    n_layers = sum(1 for k in sd if k.startswith("model.layers.") and k.endswith(".norm.weight")
                   and k.count(".") == 4)
    for i in range(n_layers):
        s, b = _Tensors(sd, f"model.layers.{i}."), f"blocks.{i}."
        _copy(out, b, s, {"norm.weight": "norm.weight"})
        if "mixer.A_log" in s:
            _mamba2_mixer(out, b + "mixer.", _Tensors(s, "mixer."))
        elif "mixer.q_proj.weight" in s:
            _fused_attention(out, b + "mixer.", s, name="mixer")
        else:                                               # non-gated MLP: up_proj -> w_in, down_proj -> w_out
            _copy(out, b + "mixer.", s, {"w_in.weight": "mixer.up_proj.weight", "w_out.weight": "mixer.down_proj.weight"})
            _copy(out, b + "mixer.", s, {"w_in.bias": "mixer.up_proj.bias", "w_out.bias": "mixer.down_proj.bias"},
                  optional=True)
    return out


def nemotron_h_twin(d_model: int, n_layers: int, vocab_size: int, max_seq_len: int):
    """The transformers config of presets.get("nemotron-h", ...): n (mixer, MLP) pairs, attention where
    `presets.spread` puts it."""
    from transformers import NemotronHConfig
    from ..models.presets import spread
    pattern = "".join(("*" if c == "A" else "M") + "-" for c in spread(n_layers, 4, "S", "A"))
    return NemotronHConfig(vocab_size=vocab_size, hidden_size=d_model, hybrid_override_pattern=pattern,
                           num_attention_heads=d_model // 64, num_key_value_heads=max(1, d_model // 256), head_dim=64,
                           max_position_embeddings=max_seq_len, intermediate_size=4 * d_model,
                           mamba_num_heads=2 * d_model // 64, mamba_head_dim=64, n_groups=2, ssm_state_size=64,
                           chunk_size=64, layer_norm_epsilon=1e-5, pad_token_id=None, bos_token_id=None,
                           eos_token_id=None)


register("nemotron_h", ARCH, nemotron_h_config, nemotron_h_weights)
TWINS["nemotron-h"] = nemotron_h_twin
