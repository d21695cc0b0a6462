"""Converter for transformers' Falcon-H1 (`FalconH1ForCausalLM` -> layout "({AS}M)*n"): in every layer attention and a
Mamba-2 mixer read the same normed input and their outputs are summed (the parallel block `{AS}`), then a SwiGLU MLP.

Falcon-H1's muP multipliers are constants around linear maps, so they are folded into the converted weights (exact up
to float32 rounding) instead of becoming model options: embedding (into the embedding, or `embed_scale` when the
embedding is tied to the LM head), lm_head, attention in (q/k/v weights), key (k weights and bias), attention out,
ssm in, `ssm_multipliers` (the in_proj output segments z, x, B, C, dt: rows of in_proj), ssm out, MLP gate and down.
Products are formed in float64 and rounded once. The multipliers live in the transformers config, not in tensors,
so the converter registers `with_config=True` and its weights function takes that config. Falcon-H1's in_proj and
out_proj biases are separate options, ours one: a missing one is converted as zeros.
"""
import torch
from torch import Tensor

from ..models.config import ModelConfig
from .common import (TWINS, Tensors, copy_renamed, decoder_layers, hf_get, hf_rope_base, hf_tied, register, require,
                     require_silu, scaled)

ARCH = "FalconH1ForCausalLM"


def _d_ssm(hf) -> int:
    return int(hf.mamba_d_ssm) if hf_get(hf, "mamba_d_ssm") is not None else int(hf.mamba_expand * hf.hidden_size)


def falcon_h1_config(hf) -> dict:
    n, d = hf.num_hidden_layers, hf.hidden_size
    act = require_silu(ARCH, hf.hidden_act, "hidden_act (MLP and conv)")
    require(float(hf_get(hf, "attention_dropout", 0) or 0) == 0, ARCH, "attention_dropout")
    lim = tuple(float(v) for v in (hf_get(hf, "time_step_limit") or (0.0, float("inf"))))
    require(lim == (0.0, float("inf")), ARCH, f"time_step_limit {lim} (only (0, inf))")
    d_ssm, heads = _d_ssm(hf), int(hf.mamba_n_heads)
    require(heads * int(hf.mamba_d_head) == d_ssm, ARCH,
          f"mamba_n_heads*mamba_d_head ({heads}*{hf.mamba_d_head}) != mamba_d_ssm ({d_ssm})")
    expand = hf_get(hf, "mamba_expand", 2)
    em, lm = float(hf_get(hf, "embedding_multiplier", 1.0)), float(hf_get(hf, "lm_head_multiplier", 1.0))
    return dict(
        layout=f"({{AS}}M)*{n}", vocab_size=hf.vocab_size, d_model=d,
        max_seq_len=int(hf_get(hf, "max_position_embeddings", 8192)), tie_embeddings=hf_tied(hf), norm="rms",
        norm_eps=float(hf.rms_norm_eps), pos_embedding="rope",
        # tied: the shared matrix carries the lm_head multiplier, the embedding the ratio
        embed_scale=em / lm if hf_tied(hf) else 1.0,
        n_heads=hf.num_attention_heads, n_kv_heads=hf_get(hf, "num_key_value_heads") or hf.num_attention_heads,
        head_dim=hf_get(hf, "head_dim") or d // hf.num_attention_heads, rope_base=hf_rope_base(ARCH, hf),
        attn_bias=bool(hf_get(hf, "attention_bias", False)),
        mlp_hidden=hf.intermediate_size, mlp_act=act, mlp_gated=True, mlp_bias=bool(hf_get(hf, "mlp_bias", False)),
        ssd_d_state=int(hf.mamba_d_state), d_conv=int(hf.mamba_d_conv),
        ssd_expand=int(expand) if float(expand).is_integer() else 2, ssd_d_inner=d_ssm,
        ssd_headdim=int(hf.mamba_d_head), ssd_ngroups=int(hf.mamba_n_groups),
        ssd_chunk_size=int(hf_get(hf, "mamba_chunk_size", 256)),
        # in_proj and out_proj biases are separate options there: a missing one is converted as zeros
        ssd_bias=bool(hf_get(hf, "mamba_proj_bias", False)) or bool(hf_get(hf, "projectors_bias", False)),
        ssd_conv_bias=bool(hf_get(hf, "mamba_conv_bias", True)),
        ssd_norm=("norm_gate" if hf_get(hf, "mamba_norm_before_gate", True) else "gated")
        if hf_get(hf, "mamba_rms_norm", False) else "gate",
    )


def _mup_vector(hf, d_ssm: int) -> Tensor:
    """Per-row multipliers of the in_proj output [z (d_ssm), x (d_ssm), B (g·n), C (g·n), dt (heads)]."""
    gn = int(hf.mamba_n_groups) * int(hf.mamba_d_state)
    sizes = (d_ssm, d_ssm, gn, gn, int(hf.mamba_n_heads))
    mults = list(hf_get(hf, "ssm_multipliers") or [1.0] * 5)
    return torch.cat([torch.full((s,), float(m), dtype=torch.float64) for s, m in zip(sizes, mults)])


def _linear(out: dict, ours: str, s: Tensors, theirs: str, w_scale, b_scale=None, *, zero_bias: int | None = None):
    """out[ours.weight/bias] = their linear's weight · w_scale, bias · b_scale (w_scale by default); with
    `zero_bias` (rows) a missing bias becomes zeros."""
    out[ours + ".weight"] = scaled(s[theirs + ".weight"], w_scale)
    bias = s.get(theirs + ".bias")
    if bias is not None:
        out[ours + ".bias"] = scaled(bias, w_scale if b_scale is None else b_scale)
    elif zero_bias is not None:
        out[ours + ".bias"] = s[theirs + ".weight"].new_zeros(zero_bias)


def falcon_h1_weights(sd: Tensors, cfg: ModelConfig, hf) -> dict[str, Tensor]:
    """Falcon-H1's state dict -> ours, the muP multipliers of `hf` (config values, not tensors) folded in."""
    g = lambda name, default=1.0: float(hf_get(hf, name, default))  # noqa: E731
    em, lm, ai, ao = g("embedding_multiplier"), g("lm_head_multiplier"), g("attention_in_multiplier"), \
        g("attention_out_multiplier")
    km, si, so = g("key_multiplier"), g("ssm_in_multiplier"), g("ssm_out_multiplier")
    gm, dm = (float(v) for v in (hf_get(hf, "mlp_multipliers") or [1.0, 1.0]))

    emb = sd["model.embed_tokens.weight"]
    out = {"norm.weight": sd["model.final_layernorm.weight"]}
    if cfg.tie_embeddings:   # one matrix: the lm_head multiplier in it, em / lm as embed_scale
        out["embed.weight"] = out["lm_head.weight"] = scaled(emb, lm)
    else:
        out["embed.weight"], out["lm_head.weight"] = scaled(emb, em), scaled(sd["lm_head.weight"], lm)
    mup = _mup_vector(hf, cfg.ssd_d_inner)
    for s, p, m in decoder_layers(sd, out, ff_norm="pre_ff_layernorm"):
        # attention (mixer.0): input multiplier into q/k/v, key multiplier into k (RoPE is linear)
        parts = {}
        for name, w, b in (("q", ai, 1.0), ("k", ai * km, km), ("v", ai, 1.0)):
            _linear(parts, name, s, f"self_attn.{name}_proj", w, b)
        out[p + "mixer.0.qkv.weight"] = torch.cat([parts[f"{n}.weight"] for n in "qkv"])
        if "q.bias" in parts:
            out[p + "mixer.0.qkv.bias"] = torch.cat([parts[f"{n}.bias"] for n in "qkv"])
        _linear(out, p + "mixer.0.out", s, "self_attn.o_proj", ao)
        # Mamba-2 (mixer.1): ssm_in and the per-segment muP vector into in_proj's rows, ssm_out into out_proj
        bias = cfg.ssd_bias
        _linear(out, p + "mixer.1.in_proj", s, "mamba.in_proj", mup * si, mup,
                zero_bias=len(mup) if bias else None)
        _linear(out, p + "mixer.1.out_proj", s, "mamba.out_proj", so, zero_bias=cfg.d_model if bias else None)
        out[p + "mixer.1.conv.weight"] = s["mamba.conv1d.weight"].squeeze(1)     # [C, 1, K] -> [C, K]
        copy_renamed(out, p + "mixer.1.", s, {"conv.bias": "mamba.conv1d.bias"}, optional=True)
        copy_renamed(out, p + "mixer.1.", s, {"dt_bias": "mamba.dt_bias", "A_log": "mamba.A_log", "D": "mamba.D"})
        if cfg.ssd_norm != "gate":
            copy_renamed(out, p + "mixer.1.", s, {"norm_weight": "mamba.norm.weight"})
        # SwiGLU: gate multiplier into gate_proj, down multiplier into down_proj
        mlp = {}
        _linear(mlp, "gate", s, "feed_forward.gate_proj", gm)
        _linear(mlp, "up", s, "feed_forward.up_proj", 1.0)
        out[m + "mixer.w_in.weight"] = torch.cat((mlp["gate.weight"], mlp["up.weight"]))
        if "gate.bias" in mlp:
            out[m + "mixer.w_in.bias"] = torch.cat((mlp["gate.bias"], mlp["up.bias"]))
        _linear(out, m + "mixer.w_out", s, "feed_forward.down_proj", dm)
    return out


register("falcon_h1", ARCH, falcon_h1_config, falcon_h1_weights, with_config=True)


def falcon_h1_twin(d_model: int, n_layers: int, vocab_size: int, max_seq_len: int):
    """transformers' config of `presets.get("falcon-h1", d_model=..., n_layers=..., ...)` (all multipliers 1)."""
    from transformers import FalconH1Config
    heads = max(1, d_model // 64)
    kv = max(1, d_model // 256) if heads % 4 == 0 else heads
    return FalconH1Config(vocab_size=vocab_size, hidden_size=d_model, intermediate_size=2 * d_model,
                          num_hidden_layers=n_layers, num_attention_heads=heads, num_key_value_heads=kv,
                          head_dim=d_model // heads, max_position_embeddings=max_seq_len, rms_norm_eps=1e-5,
                          mamba_d_ssm=2 * d_model, mamba_n_heads=2 * d_model // 32, mamba_d_head=32,
                          mamba_d_state=64, mamba_n_groups=1, mamba_chunk_size=64, mamba_rms_norm=False,
                          tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None)


TWINS["falcon-h1"] = falcon_h1_twin
