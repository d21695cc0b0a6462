"""Converter for transformers' Nemotron-H (`NemotronHForCausalLM`): each layer is ONE pre-norm block whose mixer is
Mamba-2, attention (no positional encoding at all), a squared-ReLU MLP (not gated) or a routed MoE, so the
`hybrid_override_pattern` maps letter for letter: M -> S, * -> A, - -> M, E -> O ("M-M*-" -> "SMSAM").

transformers' Nemotron-H clamps dt to (time_step_min, inf) in its chunked scan whatever `time_step_limit` says (and
not in its one-token step): we clamp in both (ssd_dt_limit), so our decoding equals our prefill. Its attention
and MLP linears ignore `attention_bias`; its lm_head is never tied; `residual_in_fp32` is not read by its forward;
multi-token-prediction layers (`num_nextn_predict_layers`) are not part of the model's logits and are not converted.
"""
import torch
from torch import Tensor

from ..models.config import ModelConfig
from ..models.layout import fold_layout
from .common import (TWINS, Tensors, copy_renamed, fused_attention, head_tensors, hf_activation, hf_get, mamba2_fields,
                     mamba2_mixer, register, require, routed_experts)

ARCH = "NemotronHForCausalLM"
LETTERS = {"linear_attention": "S", "full_attention": "A", "mlp": "M", "moe": "O"}


def nemotron_h_config(hf) -> dict:
    types = list(hf.layers_block_type)
    bad = sorted(set(types) - set(LETTERS))
    require(not bad, ARCH, f"layers_block_type {bad}")
    require(hf_get(hf, "sliding_window") is None, ARCH, f"sliding_window {hf_get(hf, 'sliding_window')}")
    require(hf_get(hf, "moe_latent_size") is None, ARCH, f"moe_latent_size {hf_get(hf, 'moe_latent_size')}")
    for name in ("attention_dropout", "hidden_dropout"):
        require(float(hf_get(hf, name, 0) or 0) == 0, ARCH, name)
    n_heads = hf.num_attention_heads
    fields = dict(
        layout=fold_layout([LETTERS[t] for t in types]), vocab_size=hf.vocab_size, d_model=hf.hidden_size,
        max_seq_len=int(hf_get(hf, "max_position_embeddings", 4096)), tie_embeddings=False, norm="rms",
        norm_eps=float(hf.layer_norm_epsilon), pos_embedding="none", n_heads=n_heads,
        n_kv_heads=hf_get(hf, "num_key_value_heads") or n_heads,
        head_dim=hf_get(hf, "head_dim") or hf.hidden_size // n_heads,
        mlp_hidden=hf.intermediate_size, mlp_act=hf_activation(ARCH, hf.mlp_hidden_act, "MLP"), mlp_gated=False,
        mlp_bias=bool(hf_get(hf, "mlp_bias", False)),
        ssd_dt_min=float(hf.time_step_min), ssd_dt_max=float(hf.time_step_max),
        **mamba2_fields(ARCH, hf, d_model=hf.hidden_size, n_heads=hf.mamba_num_heads, head_dim=hf.mamba_head_dim,
                         n_groups=hf.n_groups, d_state=hf.ssm_state_size, d_conv=hf.conv_kernel,
                         chunk_size=hf.chunk_size, conv_bias=bool(hf.use_conv_bias), proj_bias=bool(hf.use_bias),
                         act=hf.mamba_hidden_act, dt_limit=(float(hf.time_step_min), float("inf"))),
    )
    require("moe" not in types or not fields["mlp_bias"], ARCH, "mlp_bias with MoE layers (our experts have no bias)")
    if "moe" in types:  # DeepSeek-V3's router (sigmoid, correction bias, groups); experts and shared expert as the MLP
        fields.update(moe_experts=hf.n_routed_experts, moe_topk=hf.num_experts_per_tok,
                      moe_hidden=hf.moe_intermediate_size, moe_shared=True,
                      moe_shared_hidden=hf.moe_shared_expert_intermediate_size, moe_router="sigmoid",
                      moe_norm_topk=bool(hf.norm_topk_prob), moe_router_bias=True, moe_n_group=int(hf.n_group),
                      moe_topk_group=int(hf.topk_group), moe_scale=float(hf.routed_scaling_factor))
    return fields


def nemotron_h_weights(sd: Tensors, cfg: ModelConfig) -> dict[str, Tensor]:
    """Tensors as transformers holds them (model.*, stacked experts) or as checkpoints store them (backbone.*, one
    tensor per expert)."""
    root = "backbone." if "backbone.embeddings.weight" in sd else "model."
    out = head_tensors(sd, cfg, root + "embeddings.weight", root + "norm_f.weight")
    n_layers = sum(1 for k in sd if k.startswith(root + "layers.") and k.endswith(".norm.weight")
                   and k.count(".") == 4)
    for i in range(n_layers):
        s, b = Tensors(sd, f"{root}layers.{i}."), f"blocks.{i}."
        copy_renamed(out, b, s, {"norm.weight": "norm.weight"})
        if "mixer.A_log" in s:
            mamba2_mixer(out, b + "mixer.", Tensors(s, "mixer."))
        elif "mixer.q_proj.weight" in s:
            fused_attention(out, b + "mixer.", s, name="mixer")
        elif "mixer.gate.weight" in s:
            copy_renamed(out, b + "mixer.", s, {"router.weight": "mixer.gate.weight",
                                         "router_bias": "mixer.gate.e_score_correction_bias"})
            routed_experts(out, b + "mixer.", up=_stacked(s, "up_proj"), down=_stacked(s, "down_proj"))
            _relu2_mlp(out, b + "mixer.shared.", Tensors(s, "mixer.shared_experts."))
        else:
            _relu2_mlp(out, b + "mixer.", Tensors(s, "mixer."))
    return out


def _stacked(s: Tensors, proj: str) -> Tensor:
    """mixer.experts.{proj} [E, out, in], stacked from mixer.experts.{j}.{proj}.weight when stored per expert."""
    if f"mixer.experts.{proj}" in s:
        return s[f"mixer.experts.{proj}"]
    n = sum(1 for k in s if k.startswith("mixer.experts.") and k.endswith(f".{proj}.weight"))
    return torch.stack([s[f"mixer.experts.{j}.{proj}.weight"] for j in range(n)])


def _relu2_mlp(out: dict[str, Tensor], prefix: str, s: Tensors):
    """A non-gated MLP: up_proj -> w_in, down_proj -> w_out (biases where present)."""
    copy_renamed(out, prefix, s, {"w_in.weight": "up_proj.weight", "w_out.weight": "down_proj.weight"})
    copy_renamed(out, prefix, s, {"w_in.bias": "up_proj.bias", "w_out.bias": "down_proj.bias"}, optional=True)


def nemotron_h_twin(d_model: int, n_layers: int, vocab_size: int, max_seq_len: int):
    """The transformers config of presets.get("nemotron-h", ...): n (mixer, MLP) pairs, attention where
    `presets.spread` puts it."""
    from transformers import NemotronHConfig
    from ..models.presets import spread
    pattern = "".join(("*" if c == "A" else "M") + "-" for c in spread((n_layers + 1) // 2, 4, "S", "A"))[:n_layers]
    return NemotronHConfig(vocab_size=vocab_size, hidden_size=d_model, hybrid_override_pattern=pattern,
                           num_attention_heads=d_model // 64, num_key_value_heads=max(1, d_model // 256), head_dim=64,
                           max_position_embeddings=max_seq_len, intermediate_size=4 * d_model,
                           mamba_num_heads=2 * d_model // 64, mamba_head_dim=64, n_groups=2, ssm_state_size=64,
                           chunk_size=64, layer_norm_epsilon=1e-5, pad_token_id=None, bos_token_id=None,
                           eos_token_id=None)


register("nemotron_h", ARCH, nemotron_h_config, nemotron_h_weights)
TWINS["nemotron-h"] = nemotron_h_twin
