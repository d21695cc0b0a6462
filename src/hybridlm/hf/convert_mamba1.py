"""Converters for the Mamba-1 families (letter B):

  - `MambaForCausalLM` -> "B*n"; `FalconMambaForCausalLM` -> "B*n" with weightless RMSNorms on dt, B, C.
  - `JambaForCausalLM` -> one letter pair per decoder layer: the mixer (B, or A at i % attn_layer_period ==
    attn_layer_offset; Jamba's attention has no positional encoding) then the FFN (O, a routed MoE, at i %
    expert_layer_period == expert_layer_offset when num_experts > 1, else M), e.g. "(BM BO BM BO AM BO BM BO)*4".
    Its router is a softmax over all experts whose top-k weights are not renormalised (`moe_norm_topk=False`);
    its experts are read fused or per expert, as the files store them.
  Falcon-Mamba's dt/B/C norms have no weight: `mamba1_bcdt_norm="plain"`.

transformers' Mamba blocks keep the residual in float32 (`residual_in_fp32`); that matters only in half precision.
"""

import torch
from torch import Tensor

from ..models.config import ModelConfig
from ..models.layout import fold_layout
from ..models.mixers_mamba1 import MAMBA_NAMES, MAMBA_NAMES_OPTIONAL
from .common import (TWINS, Tensors, copy_renamed, decoder_layers, fused_attention, head_tensors, hf_get, hf_tied,
                     register, require, require_silu, routed_experts, stacked_experts)


def _mixer(out: dict, prefix: str, s: Tensors, has_norm_weights: bool):
    """Ours under `prefix` from transformers' mixer `s` (models/mixers_mamba1.py's names; the conv reshaped)."""
    copy_renamed(out, prefix, s, MAMBA_NAMES)
    opt = MAMBA_NAMES_OPTIONAL if has_norm_weights else \
        {k: v for k, v in MAMBA_NAMES_OPTIONAL.items() if "norm" not in k}
    copy_renamed(out, prefix, s, opt, optional=True)
    out[prefix + "conv.weight"] = s["conv1d.weight"].squeeze(1)           # [C, 1, K] -> [C, K]


def _expand(arch: str, hidden: int, inner: int) -> int:
    require(inner % hidden == 0, arch, f"intermediate size {inner} that is not a multiple of hidden_size {hidden}")
    return inner // hidden


# ---------------------------------------------------------------------------------------------------
# Mamba / Falcon-Mamba -> "B*n"

def _mamba_config(hf, arch: str, falcon: bool) -> dict:
    require_silu(arch, hf_get(hf, "hidden_act", "silu"), "hidden_act (conv)")
    inner = int(hf_get(hf, "intermediate_size", None) or hf.expand * hf.hidden_size)
    fields = dict(
        layout=f"B*{hf.num_hidden_layers}", vocab_size=hf.vocab_size, d_model=hf.hidden_size,
        max_seq_len=int(hf_get(hf, "max_position_embeddings", 1 << 20)),   # no positional limit unless set
        tie_embeddings=hf_tied(hf), norm="rms", norm_eps=float(hf.layer_norm_epsilon), pos_embedding="none",
        mamba1_d_state=hf.state_size, d_conv=hf.conv_kernel, mamba1_expand=_expand(arch, hf.hidden_size, inner),
        mamba1_dt_rank=int(hf.time_step_rank), mamba1_conv_bias=bool(hf_get(hf, "use_conv_bias", True)),
        mamba1_bias=bool(hf_get(hf, "use_bias", False)),
    )
    if falcon:
        fields.update(mamba1_bcdt_norm="plain", mamba1_norm_eps=float(hf_get(hf, "mixer_rms_eps", 1e-6)))
    return fields


def mamba_config(hf) -> dict:
    return _mamba_config(hf, "MambaForCausalLM", falcon=False)


def falcon_mamba_config(hf) -> dict:
    return _mamba_config(hf, "FalconMambaForCausalLM", falcon=True)


def mamba_weights(sd: Tensors, cfg: ModelConfig) -> dict[str, Tensor]:
    out = head_tensors(sd, cfg, "backbone.embeddings.weight", "backbone.norm_f.weight")
    n_layers = sum(1 for k in sd if k.startswith("backbone.layers.") and k.endswith(".mixer.A_log"))
    for i in range(n_layers):
        s, b = Tensors(sd, f"backbone.layers.{i}."), f"blocks.{i}."
        copy_renamed(out, b, s, {"norm.weight": "norm.weight"})
        _mixer(out, b + "mixer.", Tensors(s, "mixer."), has_norm_weights=False)
    return out


# ---------------------------------------------------------------------------------------------------
# Jamba -> e.g. "(BM BO BM BO AM BO BM BO)*4"

JAMBA = "JambaForCausalLM"


def jamba_layout(n: int, attn_period: int, attn_offset: int, expert_period: int, expert_offset: int,
                 moe: bool) -> str:
    """Jamba's layer plan as a layout string, e.g. "(BM BO BM BO AM BO BM BO)*4" for the released 52B."""
    return fold_layout([("A" if i % attn_period == attn_offset else "B") +
                        ("O" if moe and i % expert_period == expert_offset else "M") for i in range(n)])


def jamba_config(hf) -> dict:
    require(float(hf_get(hf, "attention_dropout", 0) or 0) == 0, JAMBA, "attention_dropout")
    act = require_silu(JAMBA, hf.hidden_act, "hidden_act (MLP and conv)")
    E = int(hf_get(hf, "num_experts", 1) or 1)
    n_heads = hf.num_attention_heads
    fields = dict(
        layout=jamba_layout(hf.num_hidden_layers, hf.attn_layer_period, hf.attn_layer_offset,
                            hf.expert_layer_period, hf.expert_layer_offset, moe=E > 1),
        vocab_size=hf.vocab_size, d_model=hf.hidden_size, max_seq_len=int(hf_get(hf, "max_position_embeddings", 2048)),
        tie_embeddings=hf_tied(hf), norm="rms", norm_eps=float(hf.rms_norm_eps), pos_embedding="none",
        n_heads=n_heads, n_kv_heads=hf_get(hf, "num_key_value_heads") or n_heads,
        head_dim=hf_get(hf, "head_dim") or hf.hidden_size // n_heads,
        mlp_hidden=hf.intermediate_size, mlp_act=act, mlp_gated=True,
        mamba1_d_state=hf.mamba_d_state, d_conv=hf.mamba_d_conv, mamba1_expand=int(hf.mamba_expand),
        mamba1_dt_rank=int(hf.mamba_dt_rank), mamba1_conv_bias=bool(hf.mamba_conv_bias),
        mamba1_bias=bool(hf.mamba_proj_bias), mamba1_bcdt_norm="weight",
    )
    if E > 1:   # softmax over all experts, top-k weights used as they are
        fields.update(moe_experts=E, moe_topk=int(hf.num_experts_per_tok), moe_hidden=hf.intermediate_size,
                      moe_shared=False, moe_router="softmax", moe_norm_topk=False)
    return fields


def jamba_weights(sd: Tensors, cfg: ModelConfig) -> dict[str, Tensor]:
    out = head_tensors(sd, cfg, "model.embed_tokens.weight", "model.final_layernorm.weight")
    for s, a, m in decoder_layers(sd, out, ff_norm="pre_ff_layernorm"):
        if "mamba.A_log" in s:
            _mixer(out, a + "mixer.", Tensors(s, "mamba."), has_norm_weights=True)
        else:
            fused_attention(out, a + "mixer.", s)
        f = Tensors(s, "feed_forward.")
        if "router.weight" in f:
            out[m + "mixer.router.weight"] = f["router.weight"]
            gate, up, down = stacked_experts(f, cfg.moe_experts, cfg.moe_hidden)
            routed_experts(out, m + "mixer.", gate=gate, up=up, down=down)
        else:
            out[m + "mixer.w_in.weight"] = torch.cat((f["gate_proj.weight"], f["up_proj.weight"]), 0)
            out[m + "mixer.w_out.weight"] = f["down_proj.weight"]
    return out


register("mamba", "MambaForCausalLM", mamba_config, mamba_weights)
register("falcon_mamba", "FalconMambaForCausalLM", falcon_mamba_config, mamba_weights)
register("jamba", JAMBA, jamba_config, jamba_weights)


# ---------------------------------------------------------------------------------------------------
# twins of the presets (bench: the same model in transformers)

def _mamba_twin(d_model: int, n_layers: int, vocab_size: int, max_seq_len: int):
    """max_position_embeddings is no MambaConfig field: an extra attribute the converter reads as max_seq_len."""
    from transformers import MambaConfig
    return MambaConfig(vocab_size=vocab_size, hidden_size=d_model, num_hidden_layers=n_layers, state_size=16,
                       expand=2, max_position_embeddings=max_seq_len, conv_kernel=4, layer_norm_epsilon=1e-5,
                       tie_word_embeddings=True, pad_token_id=None, bos_token_id=None, eos_token_id=None)


def _jamba_twin(d_model: int, n_layers: int, vocab_size: int, max_seq_len: int):
    """`n_layers` counts the preset's unit: 8 decoder layers (one attention, four MoE)."""
    from transformers import JambaConfig
    return JambaConfig(vocab_size=vocab_size, hidden_size=d_model, num_hidden_layers=8 * n_layers,
                       intermediate_size=64 * -(-int(8 * d_model / 3) // 64), num_attention_heads=8,
                       num_key_value_heads=2, max_position_embeddings=max_seq_len, rms_norm_eps=1e-6,
                       num_experts=16, num_experts_per_tok=2, mamba_d_state=16, tie_word_embeddings=False,
                       pad_token_id=None, bos_token_id=None, eos_token_id=None)


TWINS["mamba"] = _mamba_twin
TWINS["jamba"] = _jamba_twin
