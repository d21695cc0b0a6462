"""Converter for transformers' Zamba2 (`Zamba2ForCausalLM`): Mamba-2 layers (`S`) and, before the Mamba layer of each
hybrid layer, the shared transformer block (`Z`, layers/zamba.py) whose output is added to that Mamba layer's input.

Layer i of `layers_block_type` becomes "S" (mamba) or "Z@b S" (hybrid, b = the hybrid layer's rank modulo
`num_mem_blocks`): 1.2B-style configs give "S*6 Z@0 S S*5 Z@0 S ...". The shared blocks' weights come from the first
hybrid layer using each of them; every occurrence has its own q/k/v and MLP adapters (index = its rank among hybrid
layers in transformers' adapter lists) and its own output `linear`. transformers 5.23 ties the shared blocks only
when `tie_word_embeddings` is true (its tie list is applied with the embedding tie); with it false every hybrid layer
has its own block, and so does the converted model (plain `Z`, no tags). Its Mamba decode step does not apply the
`time_step_min` floor that its prefill applies; ours applies it in both.
"""
import torch
from torch import Tensor

from ..models import presets
from ..models.config import ModelConfig
from ..models.layout import parse_layout
from ..models.registry import LETTERS
from .common import TWINS, Tensors, copy_renamed, head_tensors, hf_get, hf_rope_base, hf_tied, register, require

ARCH = "Zamba2ForCausalLM"
_ACTS = {"gelu": "gelu", "silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
# ours (under a Mamba block) -> theirs (under the Mamba decoder layer); in_proj rows are [gate, xBC, dt] in both
_MAMBA = {"norm.weight": "input_layernorm.weight", "mixer.in_proj.weight": "mamba.in_proj.weight",
          "mixer.conv.bias": "mamba.conv1d.bias", "mixer.dt_bias": "mamba.dt_bias", "mixer.A_log": "mamba.A_log",
          "mixer.D": "mamba.D", "mixer.norm_weight": "mamba.norm.weight", "mixer.out_proj.weight": "mamba.out_proj.weight"}
_MAMBA_BIASES = {"mixer.in_proj.bias": "mamba.in_proj.bias", "mixer.out_proj.bias": "mamba.out_proj.bias"}
# ours (under Z) -> theirs (under shared_transformer.)
_SHARED = {"norm_in.weight": "input_layernorm.weight", "out.weight": "self_attn.o_proj.weight",
           "norm_ff.weight": "pre_ff_layernorm.weight", "w_in.weight": "feed_forward.gate_up_proj.weight",
           "w_out.weight": "feed_forward.down_proj.weight"}
_SHARED_BIASES = {"w_in.bias": "feed_forward.gate_up_proj.bias", "w_out.bias": "feed_forward.down_proj.bias"}


def zamba2_layout(hf) -> str:
    """layers_block_type -> layout (presets.zamba2_layout: runs of S written S*n)."""
    return presets.zamba2_layout([t == "hybrid" for t in hf.layers_block_type],
                                 int(hf.num_mem_blocks) if hf_tied(hf) else None)


def zamba2_config(hf) -> dict:
    types = list(hf.layers_block_type)
    bad = sorted({t for t in types if t not in ("hybrid", "linear_attention", "mamba")})
    require(not bad, ARCH, f"layers_block_type {bad} (only mamba / hybrid layers)")
    require(not hf_get(hf, "use_long_context", False), ARCH, "use_long_context")
    require(float(hf_get(hf, "attention_dropout", 0) or 0) == 0, ARCH, "attention_dropout")
    act = hf_get(hf, "hidden_act", "gelu")
    require(act in _ACTS, ARCH, f"hidden_act {act!r} (supported: {', '.join(sorted(_ACTS))})")
    eps = float(hf.rms_norm_eps)
    require(eps == 1e-5, ARCH, f"rms_norm_eps {eps} (the Mamba layers' gated norm uses 1e-5 whatever it is)")
    expand = hf.mamba_expand
    require(float(expand).is_integer(), ARCH, f"non-integer mamba_expand {expand}")
    d_inner = int(expand) * hf.hidden_size
    require(d_inner % hf.n_mamba_heads == 0, ARCH,
          f"mamba_expand*hidden_size ({d_inner}) not divisible by n_mamba_heads ({hf.n_mamba_heads})")
    require(int(hf_get(hf, "mamba_headdim", d_inner // hf.n_mamba_heads)) == d_inner // hf.n_mamba_heads, ARCH,
          f"mamba_headdim {hf_get(hf, 'mamba_headdim')} (the Mamba heads are mamba_expand*hidden_size / n_mamba_heads "
          f"= {d_inner // hf.n_mamba_heads} wide)")
    n_kv = hf_get(hf, "num_key_value_heads") or hf.num_attention_heads
    adapters = bool(hf_get(hf, "use_shared_attention_adapter", False))
    require(not adapters or n_kv == hf.num_attention_heads, ARCH,
          f"use_shared_attention_adapter with num_key_value_heads {n_kv} != num_attention_heads "
          "(the adapters are as wide as the query)")
    require(int(hf.num_mem_blocks) >= 1, ARCH, f"num_mem_blocks {hf.num_mem_blocks}")
    rope = bool(hf_get(hf, "use_mem_rope", False))
    return dict(
        layout=zamba2_layout(hf), vocab_size=hf.vocab_size, d_model=hf.hidden_size,
        max_seq_len=int(hf_get(hf, "max_position_embeddings", 4096)), tie_embeddings=hf_tied(hf), norm="rms",
        norm_eps=eps, pos_embedding="rope" if rope else "none", rope_base=hf_rope_base(ARCH, hf) if rope else 10000.0,
        n_heads=hf.num_attention_heads, n_kv_heads=n_kv, head_dim=hf.attention_head_dim,
        mlp_hidden=hf.intermediate_size, mlp_act=_ACTS[act], mlp_bias=bool(hf.add_bias_linear),
        ssd_d_state=hf.mamba_d_state, d_conv=hf.mamba_d_conv, ssd_expand=int(expand),
        ssd_headdim=d_inner // hf.n_mamba_heads, ssd_ngroups=hf.mamba_ngroups, ssd_chunk_size=int(hf.chunk_size),
        ssd_bias=bool(hf.add_bias_linear), ssd_conv_bias=True,     # Zamba2's conv1d always has a bias
        ssd_dt_min=float(hf.time_step_min), ssd_dt_max=float(hf.time_step_max),
        zamba_adapter_rank=int(hf.adapter_rank), zamba_attn_adapter=adapters,
        ssd_dt_limit=(float(hf.time_step_min), float("inf")),
    )


def _mamba(out: dict, prefix: str, s: Tensors):
    copy_renamed(out, prefix, s, _MAMBA)
    copy_renamed(out, prefix, s, _MAMBA_BIASES, optional=True)
    out[prefix + "mixer.conv.weight"] = s["mamba.conv1d.weight"].squeeze(1)     # [C, 1, K] -> [C, K]


def zamba2_weights(sd: Tensors, cfg: ModelConfig) -> dict[str, Tensor]:
    out = head_tensors(sd, cfg, "model.embed_tokens.weight", "model.final_layernorm.weight")
    n = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("model.layers."))
    hybrid = [i for i in range(n) if f"model.layers.{i}.linear.weight" in sd]
    tags = [getattr(it, "tag", None) for it in parse_layout(cfg.layout, LETTERS.keys()) if it == "Z"]
    # a tagged occurrence reads the shared weights (and its adapters) where the first of its tag lives
    source = [tags.index(t) if t is not None else r for r, t in enumerate(tags)]
    block = 0
    for i in range(n):
        if i not in hybrid:
            _mamba(out, f"blocks.{block}.", Tensors(sd, f"model.layers.{i}."))
            block += 1
            continue
        rank = hybrid.index(i)
        z, m = f"blocks.{block}.feed.", f"blocks.{block}.block."
        layer = Tensors(sd, f"model.layers.{i}.")
        # the shared weights and this occurrence's adapters live in the first hybrid layer of its shared block
        s = Tensors(sd, f"model.layers.{hybrid[source[rank]]}.shared_transformer.")
        copy_renamed(out, z, s, _SHARED)
        copy_renamed(out, z, s, _SHARED_BIASES, optional=True)
        out[z + "qkv.weight"] = torch.cat([s[f"self_attn.{p}_proj.weight"] for p in "qkv"], 0)
        if cfg.zamba_attn_adapter:
            for j, p in enumerate("qkv"):
                lora = f"self_attn.linear_{p}_adapter_list.{rank}"
                copy_renamed(out, f"{z}qkv_adapters.{j}.", s, {"down.weight": f"{lora}.0.weight",
                                                                "up.weight": f"{lora}.1.weight"})
        if cfg.zamba_adapter_rank:
            lora = f"feed_forward.gate_up_proj_adapter_list.{rank}"
            copy_renamed(out, z + "mlp_adapter.", s, {"down.weight": f"{lora}.0.weight", "up.weight": f"{lora}.1.weight"})
        out[z + "proj.weight"] = layer["linear.weight"]
        _mamba(out, m, Tensors(layer, "mamba_decoder."))
        block += 1
    return out


register("zamba2", ARCH, zamba2_config, zamba2_weights)


def zamba2_twin(d_model: int, n_layers: int, vocab_size: int, max_seq_len: int):
    """The transformers config of `presets.get("zamba2", d_model=..., n_layers=..., ...)`."""
    from transformers import Zamba2Config
    types = ["hybrid" if h else "mamba" for h in presets.zamba2_hybrid(n_layers)]
    return Zamba2Config(vocab_size=vocab_size, hidden_size=d_model, num_hidden_layers=n_layers, layers_block_type=types,
                        max_position_embeddings=max_seq_len, mamba_d_state=64, mamba_expand=2,
                        n_mamba_heads=2 * d_model // 64, chunk_size=64, num_attention_heads=8, intermediate_size=4 * d_model,
                        hidden_act="gelu", num_mem_blocks=2, use_shared_attention_adapter=False,
                        adapter_rank=max(8, d_model // 16), use_mem_rope=False, rms_norm_eps=1e-5,
                        tie_word_embeddings=True, pad_token_id=None, bos_token_id=None, eos_token_id=None)


TWINS["zamba2"] = zamba2_twin
