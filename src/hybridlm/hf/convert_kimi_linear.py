"""Converter for transformers' Kimi-Linear (`KimiLinearForCausalLM`): each decoder layer is a token mixer, `K`
(Kimi Delta Attention, `linear_attention`) or `L` (MLA with no positional encoding, `full_attention`), then a
channel mixer, `M` (dense SwiGLU) or `O` (DeepSeek-style routed MoE, `sparse`). The released 48B-A3B model (full
attention at layers 4, 8, ..., 24 and 27) is "KM (KO KO LO KO)*6 KO LO". Kimi has no RoPE anywhere, so the model is
pos_embedding="none" (our MLA then leaves its shared key part unrotated, as transformers does).

Weights: q/k/v projections -> our fused `qkv` (rows [q; k; v], the order of transformers' concatenated conv),
conv1d [3HD, 1, K] -> [3HD, K], A_log [1, 1, H, 1] -> [H]; experts.gate_up_proj [E, 2h, d] -> w_gate, w_up
[E, d, h]; the MLA keeps transformers' row layouts (as for DeepSeek-V3). The weights function also reads the
released files' names (flat forget-gate tensors, q/k/v_conv1d, block_sparse_moe.experts.{e}.w1/w2/w3), which
transformers renames and stacks only on load: `convert_kimi_dir` converts such a directory.
"""
import torch
from torch import Tensor

from ..models.config import ModelConfig
from ..models.layout import fold_layout
from ..models.mixers_kda import KIMI_LINEAR_NAMES
from .common import (TWINS, Tensors, decoder_layers, head_tensors, hf_get, hf_tied, register, require, require_silu,
                     routed_experts, stacked_experts)

ARCH = "KimiLinearForCausalLM"


def _layer_types(hf) -> tuple[list[str], list[str]]:
    n = hf.num_hidden_layers
    mixers, mlps = list(hf.layer_types or []), list(hf.mlp_layer_types or [])
    require(len(mixers) == n and len(mlps) == n, ARCH, "layer_types / mlp_layer_types not of num_hidden_layers entries")
    for t in mixers:
        require(t in ("linear_attention", "full_attention"), ARCH, f"layer type {t!r}")
    for t in mlps:
        require(t in ("dense", "sparse"), ARCH, f"mlp layer type {t!r}")
    return mixers, mlps


def kimi_config(hf) -> dict:
    mixers, mlps = _layer_types(hf)
    require((hf_get(hf, "num_key_value_heads") or hf.num_attention_heads) == hf.num_attention_heads, ARCH,
          "num_key_value_heads != num_attention_heads (transformers' MLA expands every head)")
    require(int(hf_get(hf, "pretraining_tp", 1) or 1) == 1, ARCH, f"pretraining_tp {hf_get(hf, 'pretraining_tp')}")
    act = require_silu(ARCH, hf.hidden_act, "hidden_act (MLP and short-conv)")
    # options of the released config.json that transformers reads past (it always runs NoPE MLA and sigmoid routing)
    require(hf_get(hf, "mla_use_nope", True) is not False, ARCH, "mla_use_nope false (MLA with RoPE)")
    router = hf_get(hf, "moe_router_activation_func", "sigmoid")
    require(router == "sigmoid", ARCH, f"moe_router_activation_func {router!r} (only sigmoid)")
    tokens = [("K" if m == "linear_attention" else "L") + ("M" if f == "dense" else "O") for m, f in zip(mixers, mlps)]
    fields = dict(
        layout=fold_layout(tokens), vocab_size=hf.vocab_size, d_model=hf.hidden_size,
        max_seq_len=int(hf_get(hf, "max_position_embeddings", 1 << 20)), tie_embeddings=hf_tied(hf), norm="rms",
        norm_eps=float(hf.rms_norm_eps), pos_embedding="none", n_heads=hf.num_attention_heads,
        head_dim=hf.v_head_dim, attn_bias=bool(hf_get(hf, "attention_bias", False)),
        mlp_hidden=hf.intermediate_size, mlp_act=act, mlp_gated=True,
        mla_kv_lora_rank=hf.kv_lora_rank, mla_q_lora_rank=hf_get(hf, "q_lora_rank") or 0,
        mla_qk_nope_dim=hf.qk_nope_head_dim, mla_rope_dim=hf.qk_rope_head_dim, mla_v_dim=hf.v_head_dim,
        kda_heads=hf.linear_num_heads, kda_head_dim=hf.linear_head_dim, d_conv=hf.linear_conv_kernel_dim,
        kda_rank=hf.linear_head_dim,
    )
    # DeepSeek-V3's router: sigmoid scores, correction bias, groups, renormalised, scaled (set even when every layer
    # is dense, so a config round-trips whatever its mlp_layer_types)
    shared = int(hf_get(hf, "n_shared_experts", 0) or 0)
    topk_group = hf_get(hf, "topk_group")
    require(isinstance(topk_group, int) or "sparse" not in mlps, ARCH, f"topk_group {topk_group!r} (not an integer)")
    fields.update(moe_experts=hf.num_local_experts, moe_topk=hf.num_experts_per_tok or 1,
                  moe_hidden=hf.moe_intermediate_size, moe_shared=shared > 0,
                  moe_shared_hidden=hf.moe_intermediate_size * shared if shared else None,
                  moe_router="sigmoid", moe_norm_topk=bool(hf.norm_topk_prob), moe_router_bias=True,
                  moe_n_group=int(hf.n_group or 1), moe_topk_group=topk_group or 1,
                  moe_scale=float(hf.routed_scaling_factor))
    return fields


_MLA = {"q_a_proj": "q_a", "q_a_layernorm": "q_norm", "q_b_proj": "q_b", "q_proj": "q_proj",
        "kv_a_proj_with_mqa": "kv_a", "kv_a_layernorm": "kv_norm", "kv_b_proj": "kv_b", "o_proj": "out"}
_KDA = {theirs: ours for ours, theirs in KIMI_LINEAR_NAMES.items()}
_FORGET = ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log")   # under forget_gate. in the loaded model


def _kda_weights(out: dict, prefix: str, at: Tensors):
    """Loaded-model names (forget_gate.*, one stacked conv1d) or the released files' names (flat, q/k/v_conv1d)."""
    def get(name):
        return at[f"forget_gate.{name}"] if name in _FORGET and f"forget_gate.{name}" in at else at[name]
    out[prefix + "qkv.weight"] = torch.cat([at[f"{p}_proj.weight"] for p in "qkv"], 0)
    conv = at["conv1d.weight"] if "conv1d.weight" in at else torch.cat([at[f"{p}_conv1d.weight"] for p in "qkv"], 0)
    out[prefix + "conv.weight"] = conv.squeeze(1)                       # [3HD, 1, K] -> [3HD, K]
    out[prefix + "A_log"] = get("A_log").reshape(-1)                     # [1, 1, H, 1] -> [H]
    for theirs, ours in _KDA.items():
        out[prefix + ours] = get(theirs)


def _moe_weights(out: dict, prefix: str, mo: Tensors, cfg: ModelConfig):
    """experts.gate_up_proj [E, 2h, d] / down_proj [E, d, h] (loaded model) or experts.{e}.w1/w3/w2 (files)."""
    gate, up, down = stacked_experts(mo, cfg.moe_experts, cfg.moe_hidden, ("w1", "w3", "w2"))
    routed_experts(out, prefix, gate=gate, up=up, down=down)
    out[prefix + "router.weight"] = mo["gate.weight"]
    out[prefix + "router_bias"] = mo["gate.e_score_correction_bias"]
    if cfg.moe_shared:
        out[prefix + "shared.w_in.weight"] = torch.cat((mo["shared_experts.gate_proj.weight"],
                                                        mo["shared_experts.up_proj.weight"]), 0)
        out[prefix + "shared.w_out.weight"] = mo["shared_experts.down_proj.weight"]


def kimi_weights(sd: Tensors, cfg: ModelConfig) -> dict[str, Tensor]:
    out = head_tensors(sd, cfg, "model.embed_tokens.weight", "model.norm.weight")
    for s, a, m in decoder_layers(sd, out):
        at = Tensors(s, "self_attn.")
        if "A_log" in at or "forget_gate.A_log" in at:
            _kda_weights(out, a + "mixer.", at)
        else:                                              # MLA
            for key, t in at.items():
                module, param = key.rsplit(".", 1)
                out[f"{a}mixer.{_MLA[module]}.{param}"] = t
        mlp = "mlp." if any(k.startswith("mlp.") for k in s) else "block_sparse_moe."   # the files' name for both
        if f"{mlp}gate.weight" in s:
            _moe_weights(out, m + "mixer.", Tensors(s, mlp), cfg)
        else:
            ms = Tensors(s, mlp)
            out[m + "mixer.w_in.weight"] = torch.cat((ms["gate_proj.weight"], ms["up_proj.weight"]), 0)
            out[m + "mixer.w_out.weight"] = ms["down_proj.weight"]
    return out


def convert_kimi_dir(src_dir: str, out_dir: str, dtype: str | torch.dtype | None = None) -> str:
    """A transformers-format Kimi-Linear directory (the released files' tensor names, which transformers renames and
    stacks on load) -> a hybridlm checkpoint. Shapes are checked when the converted weights are loaded."""
    from transformers import AutoConfig

    from .convert import config_from_transformers
    from .directory import read_tensors, save_converted
    hf_config = AutoConfig.from_pretrained(src_dir)
    cfg = config_from_transformers(hf_config)
    sd = kimi_weights(Tensors(read_tensors(src_dir)[0]), cfg)
    if dtype is not None:
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        sd = {k: v.to(dtype) for k, v in sd.items()}
    return save_converted(out_dir, cfg, sd, src_dir)


register("kimi_linear", ARCH, kimi_config, kimi_weights)


def kimi_twin(d_model: int, n_layers: int, vocab_size: int, max_seq_len: int):
    """The transformers KimiLinearConfig of `presets.get("kimi-linear", ...)` at these sizes."""
    from transformers import KimiLinearConfig

    from ..models import presets
    from ..models.mixers_deepseek import mla_sizes
    cfg = presets.get("kimi-linear", d_model=d_model, n_layers=n_layers, vocab_size=vocab_size,
                      max_seq_len=max_seq_len)
    mla = mla_sizes(cfg)
    return KimiLinearConfig(
        vocab_size=vocab_size, hidden_size=d_model, intermediate_size=cfg.mlp_hidden_size,
        moe_intermediate_size=cfg.moe_hidden, num_hidden_layers=n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads, n_shared_experts=1, routed_scaling_factor=cfg.moe_scale,
        kv_lora_rank=mla["kv_lora_rank"], q_lora_rank=None, qk_rope_head_dim=mla["rope_dim"],
        v_head_dim=mla["v_dim"], qk_nope_head_dim=mla["qk_nope_dim"], n_group=1, topk_group=1,
        num_experts_per_tok=cfg.moe_topk, norm_topk_prob=True, hidden_act="silu",
        max_position_embeddings=max_seq_len, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=False,
        num_local_experts=cfg.moe_experts, linear_head_dim=cfg.kda_head_dim, linear_num_heads=cfg.n_heads,
        linear_conv_kernel_dim=cfg.d_conv,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n_layers)],
        mlp_layer_types=["dense" if i == 0 else "sparse" for i in range(n_layers)],
        pad_token_id=None, bos_token_id=None, eos_token_id=None)


TWINS["kimi-linear"] = kimi_twin
