"""The families `hybridlm convert --to-hf --as-native` can write (hf/native.py does the writing): per transformers
family, how our layout's blocks group into its decoder layers (`grammar`) and its config from ours (`config`). Each
config is checked by reading it back through our own converter (hf/convert*.py), so a builder here only names the
fields: anything the class cannot mirror shows up in that round trip."""
import math
from dataclasses import dataclass
from typing import Callable

from ..errors import ConfigError
from ..models.config import ModelConfig
from ..models.layout import Hop, Parallel, parse_layout
from ..models.registry import LETTERS
from .convert import CONVERTERS   # (importing convert registers every converter)

_INF = float("inf")


class NotExpressed(Exception):
    """Why a family does not express the model: `reach` (how far it got: layers expressed, then fewer mismatched
    options) orders the families for the error; `what` names the obstacle."""

    def __init__(self, reach: tuple, what: str):
        super().__init__(what)
        self.reach, self.what = reach, what


# ---------------------------------------------------------------------------------------------------
# the layout as tokens, and the grammars that group them into decoder layers

def layout_tokens(cfg: ModelConfig) -> list[tuple[str, int]]:
    """(token, index of its first layer) per top-level block: "A", "{AS}" (parallel), "Z@0" (shared), "[RWM]"."""
    out, at = [], 0
    for it in parse_layout(cfg.layout, LETTERS.keys()):
        if isinstance(it, (Parallel, Hop)):
            tok, size = ("{%s}" if isinstance(it, Parallel) else "[%s]") % "".join(it), len(it)
        else:
            tok, size = str(it) + (f"@{it.tag}" if getattr(it, "tag", None) is not None else ""), 1
        out.append((tok, at))
        at += size
    return out


def _stop(tokens, i: int, why: str = ""):
    """The family stops at token i (or at the layout's end): NotExpressed naming it and its layer."""
    if i >= len(tokens):
        raise NotExpressed((tokens[-1][1] + 1, 0), f"the end of the layout{why}")
    tok, at = tokens[i]
    raise NotExpressed((at, 0), f"{'block' if tok[0] in '{[' else 'letter'} {tok!r} at layer {at}{why}")


def layers_of(mixers: dict[str, str], channels: dict[str, str] | None = None) -> Callable:
    """A grammar: a decoder layer is a token of `mixers` (one block: NemotronH, Mamba2), or one of `mixers` then one
    of `channels` (a token mixer then a channel mixer: Llama, Bamba, Jamba, ...). Gives the (mixer, channel) values
    per layer; the first token that fits nowhere stops it."""
    def grammar(tokens) -> list:
        out, i = [], 0
        while i < len(tokens):
            if tokens[i][0] not in mixers:
                _stop(tokens, i)
            if channels is None:
                out.append(mixers[tokens[i][0]])
                i += 1
                continue
            if i + 1 >= len(tokens) or tokens[i + 1][0] not in channels:
                _stop(tokens, i + 1, f" (a layer's {tokens[i][0]} is followed by {' or '.join(channels)})")
            out.append((mixers[tokens[i][0]], channels[tokens[i + 1][0]]))
            i += 2
        return out
    return grammar


def _zamba2_layers(tokens) -> list:
    """Zamba2: a Mamba layer "S", or a hybrid one "Z S" / "Z@k S" (the shared block feeding that Mamba layer)."""
    out, i = [], 0
    while i < len(tokens):
        tok = tokens[i][0]
        if tok == "S":
            out.append(None)
        elif tok.split("@")[0] == "Z" and i + 1 < len(tokens) and tokens[i + 1][0] == "S":
            out.append(int(tok.split("@")[1]) if "@" in tok else -1)
            i += 1
        else:
            _stop(tokens, i + (tok.startswith("Z")), " (its layers are S or Z S)")
        i += 1
    return out


def _uniform(tokens, layers: list, k: int, what: str):
    """Families whose channel mixer is one kind throughout (Granite): the first layer unlike layer 0 stops."""
    for i, layer in enumerate(layers):
        if layer[k] != layers[0][k]:
            _stop(tokens, 2 * i + k, f" ({what})")


# ---------------------------------------------------------------------------------------------------
# each family's config from ours (the converter reads it back; whatever it cannot mirror shows up there)

def _rope(cfg: ModelConfig, partial: bool = False) -> dict:
    params = {"rope_type": "default", "rope_theta": cfg.rope_base}
    if partial:
        rotary = cfg.attn_head_dim if cfg.rope_dim is None else cfg.rope_dim
        params["partial_rotary_factor"] = rotary / cfg.attn_head_dim
    return {"rope_parameters": params}


def _attn(cfg: ModelConfig) -> dict:
    return {"num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.attn_head_dim,
            "attention_bias": cfg.attn_bias}


def _ssd(cfg: ModelConfig, prefix: str = "mamba_") -> dict:
    """Mamba-2 sizes under the names Bamba / Granite / Falcon-H1 use (prefix "mamba_")."""
    d_inner = cfg.ssd_d_inner or cfg.ssd_expand * cfg.d_model
    p = prefix
    return {f"{p}n_heads": d_inner // cfg.ssd_headdim, f"{p}d_head": cfg.ssd_headdim, f"{p}n_groups": cfg.ssd_ngroups,
            f"{p}d_state": cfg.ssd_d_state, f"{p}d_conv": cfg.d_conv, f"{p}chunk_size": cfg.ssd_chunk_size,
            f"{p}expand": d_inner // cfg.d_model if d_inner % cfg.d_model == 0 else None,
            f"{p}conv_bias": cfg.ssd_conv_bias, f"{p}proj_bias": cfg.ssd_bias,
            "time_step_limit": cfg.ssd_dt_limit or (0.0, _INF)}


def _common(cfg: ModelConfig, n: int, eps: str = "rms_norm_eps") -> dict:
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": n,
            "max_position_embeddings": cfg.max_seq_len, eps: cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def _moe_router(cfg: ModelConfig) -> dict:
    """DeepSeek-V3's router (Nemotron-H, Kimi-Linear)."""
    return {"num_experts_per_tok": cfg.moe_topk, "norm_topk_prob": cfg.moe_norm_topk, "n_group": cfg.moe_n_group,
            "topk_group": cfg.moe_topk_group, "routed_scaling_factor": cfg.moe_scale}


def _mla(cfg: ModelConfig) -> dict:
    from ..models.mixers_deepseek import mla_sizes
    s = mla_sizes(cfg)
    return {"num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads, "kv_lora_rank": s["kv_lora_rank"],
            "q_lora_rank": s["q_lora_rank"] or None, "qk_rope_head_dim": s["rope_dim"],
            "qk_nope_head_dim": s["qk_nope_dim"], "v_head_dim": s["v_dim"], "attention_bias": cfg.attn_bias,
            "intermediate_size": cfg.mlp_hidden_size, "hidden_act": cfg.mlp_act}


def _llama(cfg, layers, tokens):
    from transformers import LlamaConfig
    return LlamaConfig(**_common(cfg, len(layers)), **_attn(cfg), **_rope(cfg), intermediate_size=cfg.mlp_hidden_size,
                       hidden_act=cfg.mlp_act, mlp_bias=cfg.mlp_bias)


def _mamba2(cfg, layers, tokens):
    from transformers import Mamba2Config
    s = _ssd(cfg, "")
    return Mamba2Config(**_common(cfg, len(layers), "layer_norm_epsilon"), state_size=s["d_state"],
                        conv_kernel=s["d_conv"], expand=s["expand"], head_dim=s["d_head"], num_heads=s["n_heads"],
                        n_groups=s["n_groups"], chunk_size=s["chunk_size"], use_bias=s["proj_bias"],
                        use_conv_bias=s["conv_bias"], time_step_limit=s["time_step_limit"])


def _bamba(cfg, layers, tokens):
    from transformers import BambaConfig
    return BambaConfig(**_common(cfg, len(layers)), **_attn(cfg), **_rope(cfg, partial=True), **_ssd(cfg),
                       attn_layer_indices=[i for i, (m, _) in enumerate(layers) if m == "A"],
                       intermediate_size=cfg.mlp_hidden_size, hidden_act=cfg.mlp_act, mlp_bias=cfg.mlp_bias)


def _granite(cfg, layers, tokens):
    from transformers import GraniteMoeHybridConfig
    _uniform(tokens, layers, 1, "its layers are all dense or all MoE")
    moe = layers[0][1] == "O"
    shared = (cfg.moe_shared_hidden or cfg.moe_hidden or cfg.mlp_hidden_size) if moe else cfg.mlp_hidden_size
    # the converter scales the queries by attention_multiplier · √head_dim: the multiplier that makes it exactly 1
    mult = 1 / math.sqrt(cfg.attn_head_dim)
    mult = next((m for m in (mult, math.nextafter(mult, 0), math.nextafter(mult, 1))
                 if m * math.sqrt(cfg.attn_head_dim) == 1.0), mult)
    return GraniteMoeHybridConfig(
        **_common(cfg, len(layers)), **_attn(cfg), **_rope(cfg), **_ssd(cfg),
        layer_types=["mamba" if m == "S" else "attention" for m, _ in layers],
        position_embedding_type="rope" if cfg.pos_embedding == "rope" else "nope", hidden_act=cfg.mlp_act,
        embedding_multiplier=cfg.embed_scale, attention_multiplier=mult, residual_multiplier=1.0, logits_scaling=1.0,
        shared_intermediate_size=shared, num_local_experts=cfg.moe_experts if moe else 0,
        num_experts_per_tok=cfg.moe_topk, intermediate_size=(cfg.moe_hidden or cfg.mlp_hidden_size) if moe else shared)


def _nemotron_h(cfg, layers, tokens):
    from transformers import NemotronHConfig
    s, lim = _ssd(cfg), cfg.ssd_dt_limit or (0.0, _INF)
    return NemotronHConfig(
        **_common(cfg, len(layers), "layer_norm_epsilon"), **_attn(cfg), layers_block_type=layers,
        intermediate_size=cfg.mlp_hidden_size, mlp_hidden_act=cfg.mlp_act, mlp_bias=cfg.mlp_bias,
        ssm_state_size=s["mamba_d_state"], mamba_num_heads=s["mamba_n_heads"], mamba_head_dim=s["mamba_d_head"],
        n_groups=s["mamba_n_groups"], conv_kernel=s["mamba_d_conv"], expand=s["mamba_expand"] or 2,   # (unread)
        chunk_size=s["mamba_chunk_size"], use_conv_bias=s["mamba_conv_bias"], use_bias=s["mamba_proj_bias"],
        mamba_proj_bias=s["mamba_proj_bias"], mamba_hidden_act="silu",
        time_step_min=lim[0], time_step_limit=(lim[0], _INF),          # it clamps dt to (time_step_min, inf)
        n_routed_experts=cfg.moe_experts, moe_intermediate_size=cfg.moe_hidden or cfg.mlp_hidden_size,
        moe_shared_expert_intermediate_size=cfg.moe_shared_hidden or cfg.moe_hidden or cfg.mlp_hidden_size,
        **_moe_router(cfg))


def _falcon_h1(cfg, layers, tokens):
    from transformers import FalconH1Config
    s = _ssd(cfg)
    d_ssm = s["mamba_n_heads"] * s["mamba_d_head"]
    return FalconH1Config(
        **_common(cfg, len(layers)), **_attn(cfg), **_rope(cfg), **s, mamba_d_ssm=d_ssm,
        mamba_rms_norm=cfg.ssd_norm != "gate", mamba_norm_before_gate=cfg.ssd_norm == "norm_gate",
        projectors_bias=cfg.ssd_bias, intermediate_size=cfg.mlp_hidden_size, hidden_act=cfg.mlp_act,
        mlp_bias=cfg.mlp_bias, embedding_multiplier=cfg.embed_scale if cfg.tie_embeddings else 1.0,
        lm_head_multiplier=1.0, attention_in_multiplier=1.0, attention_out_multiplier=1.0, key_multiplier=1.0,
        ssm_in_multiplier=1.0, ssm_out_multiplier=1.0, ssm_multipliers=[1.0] * 5, mlp_multipliers=[1.0, 1.0])


def _period(tokens, layers: list[bool], k: int) -> tuple[int, int]:
    """Jamba's (period, offset): layers i with i % period == offset are marked; the first layer off that plan stops."""
    marked = [i for i, m in enumerate(layers) if m]
    if not marked:
        return len(layers) + 1, len(layers)
    period = marked[1] - marked[0] if len(marked) > 1 else max(len(layers), marked[0] + 1)
    offset = marked[0] % period
    for i, m in enumerate(layers):
        if m != (i % period == offset):
            _stop(tokens, 2 * i + k, f" (it places them every {period} layers from layer {offset})")
    return period, offset


def _jamba(cfg, layers, tokens):
    from transformers import JambaConfig
    attn = _period(tokens, [m == "A" for m, _ in layers], 0)
    moe = _period(tokens, [c == "O" for _, c in layers], 1)
    experts = cfg.moe_experts if any(c == "O" for _, c in layers) else 1
    return JambaConfig(
        **_common(cfg, len(layers)), num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
        intermediate_size=(cfg.moe_hidden or cfg.mlp_hidden_size) if experts > 1 else cfg.mlp_hidden_size,
        hidden_act=cfg.mlp_act, attn_layer_period=attn[0], attn_layer_offset=attn[1], expert_layer_period=moe[0],
        expert_layer_offset=moe[1], num_experts=experts, num_experts_per_tok=cfg.moe_topk,
        mamba_d_state=cfg.mamba1_d_state, mamba_d_conv=cfg.d_conv, mamba_expand=cfg.mamba1_expand,
        mamba_dt_rank=cfg.mamba1_dt_rank or math.ceil(cfg.d_model / 16), mamba_conv_bias=cfg.mamba1_conv_bias,
        mamba_proj_bias=cfg.mamba1_bias, use_mamba_kernels=False)


def _mamba1(falcon: bool):
    def config(cfg, layers, tokens):
        import transformers
        cls = transformers.FalconMambaConfig if falcon else transformers.MambaConfig
        extra = dict(mixer_rms_eps=cfg.norm_eps if cfg.mamba1_norm_eps is None else cfg.mamba1_norm_eps) if falcon \
            else {}
        return cls(**_common(cfg, len(layers), "layer_norm_epsilon"), state_size=cfg.mamba1_d_state,
                   expand=cfg.mamba1_expand, conv_kernel=cfg.d_conv, use_bias=cfg.mamba1_bias,
                   use_conv_bias=cfg.mamba1_conv_bias, time_step_rank=cfg.mamba1_dt_rank or math.ceil(cfg.d_model / 16),
                   **extra)
    return config


def _zamba2(cfg, layers, tokens):
    from transformers import Zamba2Config
    tags = [t for t in layers if t is not None]
    acts = {"gelu": "gelu", "silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}
    s, lim = _ssd(cfg), cfg.ssd_dt_limit or (0.0, _INF)
    return Zamba2Config(
        **_common(cfg, len(layers)), layers_block_type=["mamba" if t is None else "hybrid" for t in layers],
        num_mem_blocks=max(1, len(set(tags) - {-1})), num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
        use_mem_rope=cfg.pos_embedding == "rope", **_rope(cfg), intermediate_size=cfg.mlp_hidden_size,
        hidden_act=acts.get(cfg.mlp_act, cfg.mlp_act), add_bias_linear=cfg.mlp_bias, mamba_d_state=cfg.ssd_d_state,
        mamba_d_conv=cfg.d_conv, mamba_expand=s["mamba_expand"], n_mamba_heads=s["mamba_n_heads"],
        mamba_ngroups=cfg.ssd_ngroups, chunk_size=cfg.ssd_chunk_size, time_step_min=lim[0],
        adapter_rank=cfg.zamba_adapter_rank, use_shared_attention_adapter=cfg.zamba_attn_adapter,
        use_mamba_kernels=False)


def _qwen3_next(cfg, layers, tokens):
    from transformers import Qwen3NextConfig
    from ..models.mixers_delta import gdn_sizes
    hk, hv, dk, dv = gdn_sizes(cfg)
    moe = [c == "O" for _, c in layers]
    return Qwen3NextConfig(
        **_common(cfg, len(layers)), **_attn(cfg), **_rope(cfg, partial=True),
        layer_types=["linear_attention" if m == "G" else "full_attention" for m, _ in layers],
        intermediate_size=cfg.mlp_hidden_size, hidden_act=cfg.mlp_act, linear_num_key_heads=hk,
        linear_num_value_heads=hv, linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=cfg.d_conv,
        num_experts=cfg.moe_experts if any(moe) else 0, num_experts_per_tok=cfg.moe_topk,
        moe_intermediate_size=cfg.moe_hidden or cfg.mlp_hidden_size,
        shared_expert_intermediate_size=cfg.moe_shared_hidden or cfg.moe_hidden or cfg.mlp_hidden_size,
        norm_topk_prob=cfg.moe_norm_topk, decoder_sparse_step=1,
        mlp_only_layers=[i for i, o in enumerate(moe) if not o])


def _kimi_linear(cfg, layers, tokens):
    from transformers import KimiLinearConfig
    from ..models.mixers_kda import kda_sizes
    heads, dim, _ = kda_sizes(cfg)
    h = cfg.moe_hidden or cfg.mlp_hidden_size
    shared = (cfg.moe_shared_hidden or h) / h if cfg.moe_shared else 0
    # also the released config.json's fields, which vLLM's kimi_linear reads instead of transformers' layer types:
    # KDA and MLA layers numbered from 1, NoPE MLA, and the MLPs dense for the first k layers, routed after (the only
    # MLP pattern it has: written where ours is one)
    mlps = [c for _, c in layers]
    k = next((i for i, c in enumerate(mlps) if c == "O"), len(mlps))
    released = dict(linear_attn_config={"kda_layers": [i + 1 for i, (m, _) in enumerate(layers) if m == "K"],
                                        "full_attn_layers": [i + 1 for i, (m, _) in enumerate(layers) if m == "L"],
                                        "num_heads": heads, "head_dim": dim, "short_conv_kernel_size": cfg.d_conv},
                    mla_use_nope=True, **(dict(first_k_dense_replace=k, moe_layer_freq=1)
                                          if all(c == "O" for c in mlps[k:]) else {}))
    return KimiLinearConfig(
        **_common(cfg, len(layers)), **_mla(cfg), layer_types=["linear_attention" if m == "K" else "full_attention"
                                                               for m, _ in layers],
        mlp_layer_types=["sparse" if c == "O" else "dense" for _, c in layers], moe_intermediate_size=h,
        num_local_experts=cfg.moe_experts, n_shared_experts=int(shared) if shared == int(shared) else shared,
        linear_num_heads=heads, linear_head_dim=dim, linear_conv_kernel_dim=cfg.d_conv, **_moe_router(cfg), **released)


def _lfm2(cfg, layers, tokens):
    from transformers import Lfm2Config
    return Lfm2Config(**_common(cfg, len(layers), "norm_eps"), **_attn(cfg), **_rope(cfg),
                      layer_types=["conv" if m == "C" else "full_attention" for m, _ in layers],
                      intermediate_size=cfg.mlp_hidden_size, block_auto_adjust_ff_dim=False,
                      conv_L_cache=cfg.d_conv, conv_bias=cfg.conv_bias)


def _doge(cfg, layers, tokens):
    from transformers import DogeConfig
    keep = cfg.wm_keep_window or cfg.max_seq_len
    # (its converter reads no head_dim: hidden_size / num_attention_heads)
    return DogeConfig(**_common(cfg, len(layers)), num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
                      attention_bias=cfg.attn_bias, **_rope(cfg), intermediate_size=cfg.mlp_hidden_size,
                      hidden_act=cfg.mlp_act, mlp_bias=cfg.mlp_bias, sliding_window=cfg.window,
                      keep_window_size=keep, is_moe=False)


def _deepseek(v32: bool):
    def config(cfg, layers, tokens):
        import transformers
        n = len(layers)
        if v32:
            from ..models.mixers_deepseek import dsa_sizes
            d = dsa_sizes(cfg)
            return transformers.DeepseekV32Config(
                **_common(cfg, n), **_mla(cfg), **_rope(cfg), index_n_heads=d["n_heads"], index_head_dim=d["head_dim"],
                index_topk=d["topk"], mlp_layer_types=["dense"] * n)
        return transformers.DeepseekV3Config(**_common(cfg, n), **_mla(cfg), **_rope(cfg), first_k_dense_replace=n,
                                             rope_interleave=cfg.mla_rope_interleaved)
    return config


@dataclass(frozen=True)
class Family:
    model_type: str                                    # transformers' model_type (the converter's key)
    grammar: Callable[[list], list]                    # our tokens -> its decoder layers (or NotExpressed)
    config: Callable                                   # (our config, its layers, tokens) -> its config


# in the order `auto` tries them: the first that computes the model exactly is written (the ones vLLM's CPU build
# was seen to serve exactly come first)
FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", layers_of({"A": "A"}, {"M": "M"}), _llama),
    Family("mamba2", layers_of({"S": "S"}), _mamba2),
    Family("granitemoehybrid", layers_of({"S": "S", "A": "A"}, {"M": "M", "O": "O"}), _granite),
    Family("nemotron_h", layers_of({"S": "linear_attention", "A": "full_attention", "M": "mlp", "O": "moe"}),
           _nemotron_h),
    Family("bamba", layers_of({"S": "S", "A": "A"}, {"M": "M"}), _bamba),
    Family("falcon_h1", layers_of({"{AS}": "AS"}, {"M": "M"}), _falcon_h1),
    Family("jamba", layers_of({"B": "B", "A": "A"}, {"M": "M", "O": "O"}), _jamba),
    Family("mamba", layers_of({"B": "B"}), _mamba1(False)),
    Family("falcon_mamba", layers_of({"B": "B"}), _mamba1(True)),
    Family("zamba2", _zamba2_layers, _zamba2),
    Family("qwen3_next", layers_of({"G": "G", "A": "A"}, {"M": "M", "O": "O"}), _qwen3_next),
    Family("kimi_linear", layers_of({"K": "K", "L": "L"}, {"M": "M", "O": "O"}), _kimi_linear),
    Family("lfm2", layers_of({"C": "C", "A": "A"}, {"M": "M"}), _lfm2),
    Family("doge", layers_of({"A": "A"}, {"M": "M"}), _doge),
    Family("deepseek_v3", layers_of({"L": "L"}, {"M": "M"}), _deepseek(False)),
    Family("deepseek_v32", layers_of({"I": "I"}, {"M": "M"}), _deepseek(True)),
)}


def class_name(name: str) -> str:
    """A FAMILIES key -> its class, less "ForCausalLM" ("nemotron_h" -> "NemotronH")."""
    return CONVERTERS[name].hf_class.removesuffix("ForCausalLM")


def family_name(name: str) -> str:
    """`--as-native` argument -> a FAMILIES key: the model_type or the class ("GraniteMoeHybrid", "NemotronH")."""
    key = name.lower().replace("-", "").replace("_", "").removesuffix("forcausallm")
    for k in FAMILIES:
        if key in (k.replace("_", ""), class_name(k).lower()):
            return k
    raise ConfigError(f"--as-native {name!r}: not a family; choose auto or one of "
                      + ", ".join(class_name(k) for k in FAMILIES))
