"""Named model configurations. A preset is only a config: one function of the depth returning fields.

    get("transformer++", n_layers=12, d_model=768) -> ModelConfig
`n_layers` counts the preset's repeating unit (a Transformer block = attention + MLP); every other
keyword overrides a ModelConfig field. A field given as a function of the other fields (e.g. heads from the width)
is resolved after the overrides, so `--d-model` moves it too.
"""
import dataclasses
from dataclasses import dataclass
from typing import Callable

from ..errors import ConfigError
from .config import ModelConfig, check_fields, quiet_unread, renamed, warn_unread
from .layout import fold_layout


@dataclass(frozen=True)
class Preset:
    doc: str
    n_layers: int
    fields: Callable[[int], dict]


PRESETS: dict[str, Preset] = {}


def register(name: str, doc: str, n_layers: int, fields: Callable[[int], dict]):
    PRESETS[name] = Preset(doc, n_layers, fields)


def spread(n: int, every: int, base: str, other: str) -> str:
    """n letters of `base` with about 1/`every` of them replaced by `other`, evenly spread
    (an SSD-attention hybrid with ~10% attention layers, the Mamba-2 paper section 9)."""
    k = max(1, round(n / every))
    at = {int((i + 0.5) * n / k) for i in range(k)}
    return "".join(other if i in at else base for i in range(n))


def names() -> list[str]:
    return sorted(PRESETS)


def get(name: str, **overrides) -> ModelConfig:
    """The config of preset `name`, with `n_layers` and any ModelConfig field overridden."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(names())}")
    p = PRESETS[name]
    n = overrides.pop("n_layers", None) or p.n_layers
    if n < 1:
        raise ConfigError(f"n_layers must be >= 1, got {n}")
    overrides = renamed(overrides)
    check_fields(overrides)
    fields = p.fields(n)
    fields.update(overrides)
    seen = {f.name: f.default for f in dataclasses.fields(ModelConfig)} | fields   # what the functions read
    with quiet_unread():             # a preset's fields serve all its depths (Kimi-Linear's MLA starts at 4 layers)
        cfg = ModelConfig(**{k: v(seen) if callable(v) else v for k, v in fields.items()})
    warn_unread(cfg, overrides)      # what the caller set, though
    return cfg


_llama_like = dict(norm="rms", pos_embedding="rope", mlp_gated=True, mlp_act="silu", attn_bias=False,
                   mlp_bias=False, tie_embeddings=False)

register("transformer++", "Llama-style Transformer: RoPE, SwiGLU, RMSNorm, no biases", 4,
         lambda n: dict(layout=f"(AM)*{n}", **_llama_like))
register("llama", "Transformer++ with grouped-query attention (4 query heads per key/value head)", 4,
         lambda n: dict(layout=f"(AM)*{n}", n_kv_heads=2, **_llama_like))
register("mamba2", "Mamba-2: SSD blocks only (no MLP), as in the paper", 4,
         lambda n: dict(layout=f"S*{n}", ssd_d_state=128, tie_embeddings=True, norm_eps=1e-5))
register("mamba2-attention", "Mamba-2 with ~10% attention layers spread through the stack", 10,
         lambda n: dict(layout=spread(n, 10, "S", "A"), ssd_d_state=128, tie_embeddings=True, norm_eps=1e-5))
register("gpt", "the Transformer tutorial's GPT TransformerLM (section 2.1): learned positions, LayerNorm, "
         "GELU MLP, biases, dropout", 4,
         lambda n: dict(layout=f"(AM)*{n}", pos_embedding="learned", norm="layer", norm_eps=1e-5, mlp_gated=False,
                        mlp_act="gelu", attn_bias=True, mlp_bias=True, dropout=0.1, tie_embeddings=False))
_deepseek = dict(norm="rms", norm_eps=1e-6, mlp_gated=True, mlp_act="silu", tie_embeddings=False)
register("deepseek-mla", "DeepSeek-V3-style: multi-head latent attention (latent + rope-key cache) and SwiGLU", 4,
         lambda n: dict(layout=f"(LM)*{n}", **_deepseek))
register("deepseek-mla-moe", "DeepSeek-V3-style: MLA; first block dense SwiGLU, then routed MoE (8 experts, top 2, "
         "one shared expert)", 4,
         lambda n: dict(layout="LM" + (f" (LO)*{n - 1}" if n > 1 else ""), moe_experts=8, moe_topk=2,
                        moe_shared=True, **_deepseek))
register("deepseek-sparse", "DeepSeek-V3.2-style: MLA restricted to the lightning indexer's top-k keys, SwiGLU", 4,
         lambda n: dict(layout=f"(IM)*{n}", dsa_topk=256, **_deepseek))
# Wonderful Matrices (Shi et al., 2024): Cheems (figure 4), Doge (section 5, transformers' DogeForCausalLM)
_doge = dict(wm_dyn_mask="dt", residual_scale=True, qk_norm=True, norm_eps=1e-6, tie_embeddings=False, mlp_gated=True,
             mlp_act="silu", wm_cdmoe_form="doge", wm_cdmoe_experts=16384, wm_cdmoe_topk=64)
register("cheems", "Cheems: 7 RoPE-SSD layers then 1 inner-function attention with dynamic mask, each followed by "
         "CDMoE (eq. 5 compose form), repeated", 3,
         lambda n: dict(layout=f"((SE)*7 FE)*{n}", wm_ssd_rope=True, ssd_expand=1, ssd_d_state=128,
                        wm_dyn_mask="position", wm_inner_values=8, wm_inner_topk=2, wm_cdmoe_form="compose",
                        wm_cdmoe_experts=4096, wm_cdmoe_heads=4, wm_cdmoe_topk=8, wm_cdmoe_dret=128,
                        mlp_gated=False, mlp_act="silu", tie_embeddings=False))
register("doge", "Doge: dynamic-mask attention, q/k norm, learnable residual weights, CDMoE (16384 experts, 64 per token)",
         4, lambda n: dict(layout=f"(AE)*{n}", **_doge))
register("doge-dense", "Doge as transformers ships it by default: dynamic-mask attention with a gated MLP", 4,
         lambda n: dict(layout=f"(AM)*{n}", **_doge))
register("jamba-ssd", "Jamba's plan with SSD (Mamba-2) in place of its Mamba-1: blocks of 7 SSD + 1 attention, routed "
         "MoE (16 experts, top 2) every other layer", 2,
         lambda n: dict(layout=f"(SM SO SM SO AM SO SM SO)*{n}", ssd_d_state=128, moe_experts=16, moe_topk=2,
                        tie_embeddings=False))


# Mamba-1 (letter B): Mamba and Jamba as transformers builds them (hf/convert_mamba1.py); the head dim, dt rank and
# widths are functions of d_model so `--d-model` moves them
def _dt_rank(f: dict) -> int:
    return -(-f["d_model"] // 16)


def _glu_width(f: dict) -> int:
    return 64 * -(-int(8 * f["d_model"] / 3) // 64)


register("mamba", "Mamba(-1): selective-scan blocks only (d_state 16, expand 2, dt rank d/16), no MLP", 4,
         lambda n: dict(layout=f"B*{n}", pos_embedding="none", norm_eps=1e-5, tie_embeddings=True,
                        max_seq_len=1 << 20, mamba1_dt_rank=_dt_rank))
register("jamba", "Jamba: blocks of 8 layers, Mamba-1 (RMSNorm on dt/B/C) with attention (no positional encoding, "
         "GQA 8/2) at layer 4; routed MoE (16 experts, softmax top 2, not renormalised) every other layer", 2,
         lambda n: dict(layout=f"(BM BO BM BO AM BO BM BO)*{n}", pos_embedding="none", norm_eps=1e-6,
                        tie_embeddings=False, n_heads=8, n_kv_heads=2, head_dim=lambda f: f["d_model"] // f["n_heads"],
                        mlp_hidden=_glu_width, mamba1_bcdt_norm="weight", mamba1_dt_rank=_dt_rank,
                        moe_experts=16, moe_topk=2, moe_hidden=_glu_width, moe_norm_topk=False))
# Zamba2 (transformers' Zamba2ForCausalLM, 2.7B/7B style: two shared blocks alternating every 6th layer, MLP adapters,
# no RoPE in the shared attention); n counts Mamba layers, hf/convert_zamba2.py's twin builds the same model


def zamba2_hybrid(n: int) -> list[bool]:
    """Which of n Zamba2 layers are hybrid (get a shared block): every 6th, as released; the last one when n < 6, so
    a small model still has its shared block."""
    return [i % 6 == 5 or (n < 6 and i == n - 1) for i in range(n)]


def zamba2_layout(hybrid: list[bool], blocks: int | None = 2) -> str:
    """One Mamba layer per entry of `hybrid`; a hybrid one is preceded by shared block Z@(k % blocks) (k counting hybrid
    layers; blocks None: an unshared Z each)."""
    tokens, k = [], 0
    for h in hybrid:
        if h:
            tokens.append("Z" if blocks is None else f"Z@{k % blocks}")
            k += 1
        tokens.append("S")
    return fold_layout(tokens)


register("zamba2", "Zamba2: Mamba-2 layers; every 6th also gets one of 2 alternating shared transformer blocks over "
         "concat(stream, embeddings), with per-occurrence LoRA adapters, feeding that layer's input", 12,
         lambda n: dict(layout=zamba2_layout(zamba2_hybrid(n)), n_heads=8, n_kv_heads=lambda f: f["n_heads"],
                        head_dim=lambda f: 2 * f["d_model"] // f["n_heads"], mlp_hidden=lambda f: 4 * f["d_model"],
                        mlp_act="gelu", pos_embedding="none", norm_eps=1e-5, tie_embeddings=True,
                        zamba_adapter_rank=lambda f: max(8, f["d_model"] // 16), ssd_dt_limit=(1e-3, float("inf"))))

# Rodimus* (He et al., 2025): n = 64, ℓ = max(d/64, 16), SW-SKA heads of 128 with a window of half the
# training context, the released code's GLU width 4/3·d (rounded up to 8) in Rodimus++ size presets.
_rodimus = dict(rodimus_d_state=64, tie_embeddings=True, norm_eps=1e-5)
_rodimus_pp = dict(attn_shared_key=True, **_rodimus)


def _released_heads(f: dict) -> int:
    """The released code's SW-SKA default: heads of 128."""
    return max(1, f["d_model"] // 128)


def _released_glu(f: dict) -> int:
    """The released code's GLU width: 4/3 · d rounded up to a multiple of 8."""
    return 8 * -(-int(f["d_model"] * 4 / 3) // 8)


def _rodimus_size(d: int, vocab: int, ctx: int, plus: bool, n: int = 64) -> Callable[[int], dict]:
    """Fields of a Rodimus (R*k) or Rodimus++ ([RWM]*k) size preset of width d."""
    def fields(k: int) -> dict:
        f = dict(_rodimus_pp if plus else _rodimus, d_model=d, vocab_size=vocab, max_seq_len=ctx, rodimus_d_state=n)
        if plus:
            f.update(layout=f"[RWM]*{k}", n_heads=_released_heads, swa_window=ctx // 2, mlp_hidden=_released_glu)
        else:
            f.update(layout=f"R*{k}")
        return f
    return fields


register("rodimus", "Rodimus: Rodimus blocks only (DDTS gated linear attention in a GLU), state n × 2d", 8,
         lambda n: dict(layout=f"R*{n}", **_rodimus))
register("rodimus++", "Rodimus++: two-hop blocks [Rodimus, sliding-window shared-key attention, gated MLP]; as "
         "released: SW-SKA heads of 128 (d/128), GLU 4/3·d", 4,
         lambda n: dict(layout=f"[RWM]*{n}", n_heads=_released_heads, mlp_hidden=_released_glu, swa_window=1024,
                        **_rodimus_pp))
# appendix E.1 (WikiText-103, table 1: n = 32, ~47M parameters, context 512) and E.2 (table 6, GPT-3 sizes on the
# Pile, context 2048, GPT-NeoX vocabulary; Rodimus doubles the GPT-3 layer count)
register("rodimus-wt103", "Rodimus on WikiText-103 (appendix E.1): d 512, n 32, 12 blocks, ≈46.7M parameters", 12,
         _rodimus_size(512, 50265, 512, plus=False, n=32))
register("rodimus++-wt103", "Rodimus++ on WikiText-103 (appendix E.1): d 512, n 32, 6 two-hop blocks, window 256",
         6, _rodimus_size(512, 50265, 512, plus=True, n=32))
for _name, (_gpt3_layers, _d) in {"125m": (12, 768), "350m": (24, 1024), "760m": (24, 1536),
                                  "1.3b": (24, 2048)}.items():
    register(f"rodimus-{_name}", f"Rodimus scaling size {_name} (appendix E.2): d {_d}, {2 * _gpt3_layers} blocks",
             2 * _gpt3_layers, _rodimus_size(_d, 50277, 2048, plus=False))
    register(f"rodimus++-{_name}", f"Rodimus++ scaling size {_name} (appendix E.2): d {_d}, {_gpt3_layers} two-hop "
             f"blocks, SW-SKA {_d // 128}×128, window 1024", _gpt3_layers, _rodimus_size(_d, 50277, 2048, plus=True))


# Kimi-Linear (transformers' kimi_linear, hf/convert_kimi_linear.py): 3 KDA layers : 1 NoPE MLA layer, the first
# channel mixer dense, then DeepSeek-style routed MoE (sigmoid router, correction bias, one shared expert, scaled
# by the release's routed_scaling_factor 2.446); heads of 64 (the release: 32 heads of 128 at d 2304)
def kimi_layout(n: int) -> str:
    """n layers, every 4th (1-based) MLA, the rest KDA; the first MLP dense, the rest routed MoE."""
    return fold_layout([("L" if (i + 1) % 4 == 0 else "K") + ("M" if i == 0 else "O") for i in range(n)])


def _kimi_heads(f: dict) -> int:
    return max(1, f["d_model"] // 64)


def _kimi_expert(f: dict) -> int:
    return max(8, f["d_model"] // 2)


register("kimi-linear", "Kimi-Linear: 3 Kimi Delta Attention : 1 NoPE MLA, first MLP dense then routed MoE "
         "(8 experts, top 2, sigmoid router, one shared expert)", 4,
         lambda n: dict(layout=kimi_layout(n), pos_embedding="none", norm_eps=1e-5, tie_embeddings=False,
                        n_heads=_kimi_heads, head_dim=64, mla_q_lora_rank=0, mla_kv_lora_rank=256,
                        mla_qk_nope_dim=64, mla_rope_dim=32, mla_v_dim=64,
                        mlp_hidden=lambda f: 64 * -(-int(8 * f["d_model"] / 3) // 64),
                        kda_heads=_kimi_heads, kda_head_dim=64, kda_rank=64, moe_experts=8, moe_topk=2,
                        moe_shared=True, moe_hidden=_kimi_expert, moe_shared_hidden=_kimi_expert,
                        moe_router="sigmoid", moe_router_bias=True, moe_scale=2.446))
# Qwen3-Next (transformers' Qwen3NextForCausalLM, converter hf/convert_qwen3_next.py): the released 3:1 pattern of
# Gated DeltaNet and gated attention (q/k norm, a quarter of each head rotated), every layer a routed MoE with a gated
# shared expert; heads of 64 here (released: 128 for G, 256 for A), 8 experts (released: 512, top 10). n counts layers,
# every 4th attention (transformers' full_attention_interval).
register("qwen3-next", "Qwen3-Next: layers of Gated DeltaNet, every 4th gated attention, each with a routed MoE "
         "(8 experts, top 2) plus a sigmoid-gated shared expert", 8,
         lambda n: dict(layout=fold_layout(["AO" if (i + 1) % 4 == 0 else "GO" for i in range(n)]),
                        n_heads=lambda f: 2 * max(1, f["d_model"] // 128), n_kv_heads=2,
                        head_dim=64, rope_base=10_000_000.0, rope_dim=16, qk_norm=True, attn_output_gate=True,
                        gdn_k_heads=lambda f: max(1, f["d_model"] // 128),
                        gdn_v_heads=lambda f: 2 * max(1, f["d_model"] // 128), gdn_k_dim=64, gdn_v_dim=64,
                        moe_experts=8, moe_topk=2, moe_hidden=lambda f: f["d_model"], moe_shared=True,
                        moe_shared_gate=True, norm_eps=1e-6, tie_embeddings=False))

# Mamba-2 hybrids converted from transformers (hf/convert_{bamba,nemotron_h,granitemoehybrid}.py), small: heads of 64,
# SSD heads of 64 (d_state 64); each has a transformers twin in hf.common.TWINS. n_layers counts transformers layers.
_m2h = dict(head_dim=64, n_heads=lambda f: f["d_model"] // 64, ssd_headdim=64, ssd_d_state=64, ssd_chunk_size=64,
            norm_eps=1e-5)


def _nemotron_h_layout(n: int) -> str:
    """n Nemotron-H layers: mixers (Mamba-2, attention where `spread` puts it) alternating with relu² MLPs."""
    mixers = spread((n + 1) // 2, 4, "S", "A")
    return fold_layout(list("".join(m + "M" for m in mixers)[:n]))


register("bamba", "Bamba: Mamba-2 layers with attention (partial RoPE, half the head) every ~8th, each followed by a "
         "SwiGLU MLP", 4,
         lambda n: dict(layout=fold_layout([c + "M" for c in spread(n, 8, "S", "A")]), n_kv_heads=lambda f: max(
             1, f["d_model"] // 128), rope_dim=32, mlp_hidden=lambda f: 3 * f["d_model"], tie_embeddings=False, **_m2h))
register("nemotron-h", "Nemotron-H: one mixer per layer: Mamba-2 (2 groups, dt ≥ time_step_min) or attention without "
         "positions (every ~4th mixer), alternating with non-gated relu² MLPs", 8,
         lambda n: dict(layout=_nemotron_h_layout(n), pos_embedding="none", n_kv_heads=lambda f: max(
             1, f["d_model"] // 256), mlp_hidden=lambda f: 4 * f["d_model"], mlp_act="relu2", mlp_gated=False,
             ssd_ngroups=2, ssd_dt_limit=(1e-3, float("inf")), tie_embeddings=False, **_m2h))
register("granite-hybrid", "Granite-4.0 hybrid, dense form: Mamba-2 layers with attention (no RoPE) every ~8th, each "
         "followed by a SwiGLU MLP; tied embeddings", 4,
         lambda n: dict(layout=fold_layout([c + "M" for c in spread(n, 8, "S", "A")]), pos_embedding="none",
                        n_kv_heads=lambda f: max(1, f["d_model"] // 256), mlp_hidden=lambda f: 3 * f["d_model"],
                        tie_embeddings=True, **_m2h))
# Falcon-H1 (transformers' FalconH1ForCausalLM; hf/convert_falcon_h1.py): attention beside Mamba-2 in one parallel
# block, then SwiGLU; as transformers' defaults: no norm in the SSD output (y·silu(z)), heads of 64, GQA 4:1 where
# the head count allows it
register("falcon-h1", "Falcon-H1: {attention ‖ Mamba-2} parallel blocks then SwiGLU; SSD width 2d in heads of 32, "
         "state 64", 4,
         lambda n: dict(layout=f"({{AS}}M)*{n}", norm="rms", norm_eps=1e-5, tie_embeddings=False,
                        n_heads=lambda f: max(1, f["d_model"] // 64),
                        n_kv_heads=lambda f: max(1, f["d_model"] // 256) if f["d_model"] // 64 % 4 == 0
                        else max(1, f["d_model"] // 64),
                        head_dim=lambda f: f["d_model"] // max(1, f["d_model"] // 64),
                        mlp_hidden=lambda f: 2 * f["d_model"], mlp_act="silu", mlp_gated=True,
                        ssd_d_inner=lambda f: 2 * f["d_model"], ssd_expand=2, ssd_headdim=32, ssd_d_state=64,
                        ssd_ngroups=1, ssd_chunk_size=64, ssd_norm="gate", ssd_bias=False, ssd_conv_bias=True))


def _lfm2_layout(n: int) -> str:
    """n LFM2 layers, every third one attention: "((CM)*2 AM)*k ..."."""
    return fold_layout(["AM" if i % 3 == 2 else "CM" for i in range(n)])


# LFM2 (transformers' Lfm2ForCausalLM; hf/convert_lfm2.py): gated short convolutions with attention every third layer
register("lfm2", "LFM2: gated short convolutions (C, 3 taps) with q/k-normed GQA attention every third layer, each "
         "followed by SwiGLU (3d)", 6,
         lambda n: dict(layout=_lfm2_layout(n), norm="rms", norm_eps=1e-5, tie_embeddings=True, rope_base=1e6,
                        n_heads=lambda f: max(1, f["d_model"] // 64),
                        n_kv_heads=lambda f: max(1, f["d_model"] // 128) if f["d_model"] // 64 % 2 == 0
                        else max(1, f["d_model"] // 64),
                        head_dim=lambda f: f["d_model"] // max(1, f["d_model"] // 64), qk_norm=True,
                        mlp_hidden=lambda f: 3 * f["d_model"], mlp_act="silu", mlp_gated=True,
                        d_conv=3, conv_bias=False))
