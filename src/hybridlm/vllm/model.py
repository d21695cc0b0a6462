"""`HybridLMForCausalLM` for vLLM: one model class for any servable layout, built from vLLM's own layers where vLLM
has the mixer and from ours where it has none (see config.SERVED; anything else is refused at load, named).

    A, W   vLLM's Attention (its backends; `window` / `swa_window` as its per-layer sliding window; a shared key,
           Rodimus++'s SW-SKA, is expanded to the value heads), rotary embedding from get_rope, tensor parallel
           QKV / output projections
    S      vLLM's MambaMixer2 (its SSD kernels and mamba state)
    C      vLLM's ShortConv (LFM2's gated short convolution, its conv state)
    M      vLLM's merged gate/up and row-parallel down projections
    R      hybridlm's Rodimus with its state in vLLM's cache (rodimus.py)
    E      hybridlm's CDMoE (a channel mixer: no state; replicated under tensor parallelism)
    [R W M]  Rodimus++'s two-hop block, as layers/residual.py's TwoHopResidual

Module and parameter names follow hybridlm's CausalLM (`embed`, `blocks.i.norm`, `blocks.i.mixer`, ...), so a run's
weights load by name; only the tensors vLLM's layers shape differently are re-cut in `load_weights` (fused QKV into
vLLM's shards, the conv kernel's [C, K] into [C, 1, K], A_log into vLLM's A). vLLM gives continuous batching, chunked
prefill, prefix caching (its mamba "align" mode) and tensor parallelism (A, S, C, M shard; R and E are replicated).
"""
import json
import os
from collections.abc import Iterable
from types import SimpleNamespace

import torch
from torch import Tensor, nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                               ReplicatedLinear, RowParallelLinear)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.layers.mamba.short_conv import ShortConv
from vllm.model_executor.layers.mamba.mamba_utils import (MambaStateCopyFuncCalculator, MambaStateDtypeCalculator,
                                                          MambaStateShapeCalculator, get_temporal_copy_spec)
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid, SupportsMambaPrefixCaching
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from ..layers.mlp import ACTIVATIONS
from ..layers.norm import make_norm
from ..models.config import ModelConfig
from ..models.layout import Hop, parse_layout
from ..models.registry import LETTERS
from .config import check_servable
from .rodimus import BACKEND, VLLMRodimus, state_shapes


class VLLMAttention(nn.Module):
    """A / W: x [N, d], positions [N] -> [N, d]. Keys of `n_k_heads` < value heads (shared-key attention) are
    computed once (replicated) and expanded to this rank's value heads: vLLM's Attention pairs each value head with
    a key head."""

    def __init__(self, cfg: ModelConfig, window: int | None, prefix: str, vllm_config: VllmConfig):
        super().__init__()
        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        H, Hv, D = cfg.n_heads, cfg.kv_heads, cfg.attn_head_dim
        Hk = cfg.n_k_heads or (1 if cfg.attn_shared_key else Hv)
        self.shared_key = Hk != Hv
        self.H, self.Hv, self.Hk, self.D = H, Hv, Hk, D
        if self.shared_key:     # q and v sharded by head, the shared key replicated
            self.qv = MergedColumnParallelLinear(cfg.d_model, [H * D, Hv * D], bias=cfg.attn_bias,
                                                 prefix=f"{prefix}.qv")
            self.k = ReplicatedLinear(cfg.d_model, Hk * D, bias=cfg.attn_bias, prefix=f"{prefix}.k")
            hv = Hv // tp
            self.register_buffer("key_of_head", (rank * hv + torch.arange(hv)) // (Hv // Hk), persistent=False)
        else:
            self.qkv = QKVParallelLinear(cfg.d_model, D, H, Hv, bias=cfg.attn_bias, prefix=f"{prefix}.qkv")
        self.out = RowParallelLinear(H * D, cfg.d_model, bias=cfg.attn_bias, prefix=f"{prefix}.out")
        self.q_norm = make_norm("rms", D, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = make_norm("rms", D, cfg.norm_eps) if cfg.qk_norm else None
        rope_dim = (cfg.rope_dim if cfg.rope_dim is not None else D) if cfg.pos_embedding == "rope" else 0
        self.rotary = get_rope(D, max_position=cfg.max_seq_len, is_neox_style=not cfg.rope_interleaved,
                               rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base,
                                                "rope_dim": rope_dim}) if rope_dim else None
        self.h, self.hv = H // tp, Hv // tp
        self.attn = Attention(self.h, D, D ** -0.5, num_kv_heads=max(1, self.hv),
                              cache_config=vllm_config.cache_config, quant_config=vllm_config.quant_config,
                              per_layer_sliding_window=window, prefix=f"{prefix}.attn")

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        N, D = x.shape[0], self.D
        if self.shared_key:
            qv, _ = self.qv(x)
            q, v = qv.split((self.h * D, self.hv * D), dim=-1)
            k = self.k(x)[0].view(N, self.Hk, D)
        else:
            qkv, _ = self.qkv(x)
            q, k, v = qkv.split((self.h * D, self.hv * D, self.hv * D), dim=-1)
            k = k.view(N, self.hv, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q.view(N, self.h, D)).flatten(1), self.k_norm(k)
        if self.shared_key:
            k = k[:, self.key_of_head]
        k = k.reshape(N, -1)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        return self.out(self.attn(q, k, v))[0]


class VLLMMLP(nn.Module):
    """M: gated (gate and up in one merged column-parallel matmul, then act(gate) * up) or plain."""

    def __init__(self, cfg: ModelConfig, prefix: str):
        super().__init__()
        d, h = cfg.d_model, cfg.mlp_hidden_size
        self.gated = cfg.mlp_gated
        if self.gated:
            self.w_in = MergedColumnParallelLinear(d, [h, h], bias=cfg.mlp_bias, prefix=f"{prefix}.w_in")
            self.act = SiluAndMul() if cfg.mlp_act == "silu" else \
                GeluAndMul(approximate="tanh" if cfg.mlp_act == "gelu_tanh" else "none")
        else:
            self.w_in = ColumnParallelLinear(d, h, bias=cfg.mlp_bias, prefix=f"{prefix}.w_in")
            self.act = ACTIVATIONS[cfg.mlp_act]       # elementwise: the same on every shard
        self.w_out = RowParallelLinear(h, d, bias=cfg.mlp_bias, prefix=f"{prefix}.w_out")

    def forward(self, x: Tensor) -> Tensor:
        return self.w_out(self.act(self.w_in(x)[0]))[0]


class VLLMMamba2(MambaMixer2):
    """S: vLLM's MambaMixer2 sized from our config."""

    def __init__(self, cfg: ModelConfig, prefix: str, vllm_config: VllmConfig):
        d_inner = cfg.ssd_d_inner or cfg.ssd_expand * cfg.d_model
        super().__init__(hidden_size=cfg.d_model, ssm_state_size=cfg.ssd_d_state, conv_kernel_size=cfg.d_conv,
                         intermediate_size=d_inner, use_conv_bias=cfg.ssd_conv_bias, use_bias=cfg.ssd_bias,
                         n_groups=cfg.ssd_ngroups, num_heads=d_inner // cfg.ssd_headdim, head_dim=cfg.ssd_headdim,
                         rms_norm_eps=cfg.norm_eps, activation="silu", model_config=vllm_config.model_config,
                         cache_config=vllm_config.cache_config, quant_config=vllm_config.quant_config,
                         prefix=prefix)


class VLLMShortConv(ShortConv):
    """C: vLLM's ShortConv (in_proj -> B, C, x; out_proj(C ⊙ conv(B ⊙ x)), as layers/gated_conv.py)."""

    def __init__(self, cfg: ModelConfig, idx: int, prefix: str, vllm_config: VllmConfig):
        super().__init__(SimpleNamespace(conv_L_cache=cfg.d_conv, conv_bias=cfg.conv_bias), cfg.d_model, idx,
                         model_config=vllm_config.model_config, cache_config=vllm_config.cache_config,
                         quant_config=vllm_config.quant_config, prefix=prefix)


def _mixer(letter: str, cfg: ModelConfig, idx: int, prefix: str, vllm_config: VllmConfig) -> nn.Module:
    if letter == "A":
        return VLLMAttention(cfg, cfg.window, prefix, vllm_config)
    if letter == "W":
        return VLLMAttention(cfg, cfg.swa_window, prefix, vllm_config)
    if letter == "S":
        return VLLMMamba2(cfg, prefix, vllm_config)
    if letter == "M":
        return VLLMMLP(cfg, prefix)
    if letter == "C":
        return VLLMShortConv(cfg, idx, prefix, vllm_config)
    if letter == "E":           # no vLLM counterpart and no state: our module as it is
        return LETTERS["E"].build(cfg, idx)
    if letter == "R":           # our layer, our builder's sizes, a vLLM state
        return LETTERS["R"].builder(cfg, idx, cls=VLLMRodimus, prefix=prefix,
                                    model_dtype=vllm_config.model_config.dtype)
    raise AssertionError(letter)    # check_servable refused it


def _call(mixer: nn.Module, h: Tensor, positions: Tensor) -> Tensor:
    if isinstance(mixer, VLLMAttention):
        return mixer(h, positions)
    if isinstance(mixer, (VLLMRodimus, VLLMShortConv)):     # they write into `out` (behind a custom op)
        out = torch.empty_like(h)
        (mixer.serve if isinstance(mixer, VLLMRodimus) else mixer)(h, out)
        return out
    return mixer(h)


class Block(nn.Module):
    """x + mixer(norm(x)) (layers/residual.py's Residual)."""

    def __init__(self, cfg: ModelConfig, letter: str, idx: int, prefix: str, vllm_config: VllmConfig):
        super().__init__()
        self.norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.mixer = _mixer(letter, cfg, idx, f"{prefix}.mixer", vllm_config)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        return x + _call(self.mixer, self.norm(x), positions)


class HopBlock(nn.Module):
    """Rodimus++'s two-hop block (layers/residual.py's TwoHopResidual):
    h = mixer(norm1(x)); r = x + h; a = attn(norm2(r)); out = r + ffn(norm3(a + r))."""

    def __init__(self, cfgs: list[ModelConfig], letters: tuple, idx: int, prefix: str, vllm_config: VllmConfig):
        super().__init__()
        self.norm1, self.norm2, self.norm3 = (make_norm(c.norm, c.d_model, c.norm_eps) for c in cfgs)
        self.mixer, self.attn, self.ffn = (_mixer(x, c, idx + j, f"{prefix}.{name}", vllm_config)
                                           for j, (x, c, name) in enumerate(zip(letters, cfgs,
                                                                                 ("mixer", "attn", "ffn"))))

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        r = x + _call(self.mixer, self.norm1(x), positions)
        a = _call(self.attn, self.norm2(r), positions)
        return r + self.ffn(self.norm3(a + r))


def _model_config(vllm_config: VllmConfig) -> ModelConfig:
    hf = vllm_config.model_config.hf_config
    return ModelConfig.from_dict(hf.hybridlm) if hf.hybridlm is not None else ModelConfig()


def _largest_state(vllm_config: VllmConfig):
    """(shapes, dtypes) of the recurrent layer with the largest state: vLLM sizes every mamba page by it."""
    cfg, tp = _model_config(vllm_config), vllm_config.parallel_config.tensor_parallel_size
    cache = vllm_config.cache_config
    dtype = vllm_config.model_config.dtype
    found = []
    if "S" in cfg.layout:
        d_inner = cfg.ssd_d_inner or cfg.ssd_expand * cfg.d_model
        found.append((MambaStateShapeCalculator.mamba2_state_shape(
            tp_world_size=tp, intermediate_size=d_inner, n_groups=cfg.ssd_ngroups,
            num_heads=d_inner // cfg.ssd_headdim, head_dim=cfg.ssd_headdim, state_size=cfg.ssd_d_state,
            conv_kernel=cfg.d_conv, num_spec=vllm_config.num_speculative_tokens),
            MambaStateDtypeCalculator.mamba2_state_dtype(dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype)))
    if "C" in cfg.layout:
        found.append((MambaStateShapeCalculator.short_conv_state_shape(
            tp_world_size=tp, intermediate_size=cfg.d_model, conv_kernel=cfg.d_conv,
            num_spec=vllm_config.num_speculative_tokens),
            MambaStateDtypeCalculator.short_conv_state_dtype(dtype, cache.mamba_cache_dtype)))
    if "R" in cfg.layout:
        m = cfg.rodimus_d_inner or cfg.rodimus_expand * cfg.d_model
        found.append((state_shapes(cfg.d_conv, m, cfg.rodimus_d_state), (dtype, torch.float32)))

    def nbytes(item):
        shapes, dtypes = item
        return sum(torch.Size(s).numel() * torch.empty(0, dtype=t).element_size() for s, t in zip(shapes, dtypes))
    return max(found, key=nbytes) if found else (((0,),), (dtype,))


class HybridLMForCausalLM(nn.Module, HasInnerState, IsHybrid, SupportsMambaPrefixCaching):
    """A hybridlm run or export served by vLLM (see the module docstring)."""

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        return _largest_state(vllm_config)[0]

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return _largest_state(vllm_config)[1]

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.mamba2_state_copy_func()

    @classmethod
    def get_mamba_state_copy_funcs(cls, mamba_types):
        """Per kind of state: vLLM's for MambaMixer2's, a whole-snapshot copy for Rodimus's two."""
        ours = {MambaAttentionBackendEnum[BACKEND]: (get_temporal_copy_spec, get_temporal_copy_spec),
                MambaAttentionBackendEnum.SHORT_CONV: MambaStateCopyFuncCalculator.short_conv_state_copy_func()}
        return {t: ours.get(t, cls.get_mamba_state_copy_func()) for t in mamba_types}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        hf = vllm_config.model_config.hf_config
        cfg = _model_config(vllm_config)
        check_servable(cfg, getattr(hf, "quantization_config", None))
        self.config = cfg
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, prefix="embed")
        self.embed_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps) if cfg.embed_norm else None
        blocks, idx = [], 0
        for i, it in enumerate(parse_layout(cfg.layout, LETTERS.keys())):
            if isinstance(it, Hop):
                cfgs = [cfg.for_layer(idx + j) for j in range(len(it))]
                blocks.append(HopBlock(cfgs, it, idx, f"blocks.{i}", vllm_config))
                idx += len(it)
            else:
                blocks.append(Block(cfg.for_layer(idx), it, idx, f"blocks.{i}", vllm_config))
                idx += 1
        self.blocks = nn.ModuleList(blocks)
        self.norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.d_model, prefix="lm_head")
        if cfg.tie_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.embed)
        self.logits_processor = LogitsProcessor(cfg.vocab_size)
        self.allow_patterns_overrides = _weight_files(vllm_config.model_config.model)

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        x = self.embed(input_ids)
        if self.config.embed_scale != 1.0:
            x = x * self.config.embed_scale
        return self.embed_norm(x) if self.embed_norm is not None else x

    def forward(self, input_ids: Tensor | None, positions: Tensor, intermediate_tensors=None,
                inputs_embeds: Tensor | None = None, **kwargs) -> Tensor:
        x = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        for blk in self.blocks:
            x = blk(x, positions)
        return self.norm(x)

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Our state dict's names -> this module's parameters, re-cut where vLLM's layers shape them differently."""
        params = dict(self.named_parameters())
        recut = {n: m for n, m in self.named_modules()
                 if isinstance(m, (VLLMAttention, VLLMMLP, VLLMMamba2, VLLMShortConv))}
        loaded = set()
        for name, w in weights:
            if name == "lm_head.weight" and self.config.tie_embeddings:
                continue
            owner = next((o for o in (name.rsplit(".", 1)[0], name.rsplit(".", 2)[0]) if o in recut), None)
            cuts = _recut(recut[owner], name[len(owner) + 1:], w) if owner else [(name, None, w)]
            for target, shard, tensor in cuts:
                target = f"{owner}.{target}" if owner else target
                p = params[target]
                loader = getattr(p, "weight_loader", default_weight_loader)
                loader(p, tensor, shard) if shard is not None else loader(p, tensor)
                loaded.add(target)
        if self.config.tie_embeddings:
            loaded.add("lm_head.weight")
        return loaded


def _recut(mod: nn.Module, leaf: str, w: Tensor):
    """(parameter of `mod`, shard id or None, tensor) for our tensor `mod.leaf`."""
    if isinstance(mod, VLLMAttention) and leaf in ("qkv.weight", "qkv.bias"):
        kind = leaf.split(".")[1]
        q, k, v = w.split((mod.H * mod.D, mod.Hk * mod.D, mod.Hv * mod.D))
        if mod.shared_key:
            return [(f"qv.{kind}", 0, q), (f"qv.{kind}", 1, v), (f"k.{kind}", None, k)]
        return [(f"qkv.{kind}", "q", q), (f"qkv.{kind}", "k", k), (f"qkv.{kind}", "v", v)]
    if isinstance(mod, VLLMMLP) and mod.gated and leaf in ("w_in.weight", "w_in.bias"):
        gate, up = w.chunk(2)
        return [(leaf, 0, gate), (leaf, 1, up)]
    if isinstance(mod, VLLMShortConv) and leaf in ("conv.weight", "conv.bias"):
        return [(leaf, None, w.unsqueeze(1) if leaf == "conv.weight" else w)]
    if isinstance(mod, VLLMShortConv) and leaf in ("in_proj.weight", "in_proj.bias"):
        return [(leaf, i, part) for i, part in enumerate(w.chunk(3))]
    if isinstance(mod, VLLMMamba2):
        if leaf == "conv.weight":
            return [("conv1d.weight", None, w.unsqueeze(1))]
        renames = {"conv.bias": "conv1d.bias", "A_log": "A", "norm_weight": "norm.weight"}
        return [(renames.get(leaf, leaf), None, w)]
    return [(leaf, None, w)]


def _weight_files(model_dir: str) -> list[str] | None:
    """The safetensors files of a local directory's index (a run keeps its weights in step directories, which vLLM's
    loader, globbing the top level, would not find), else None (vLLM's own search)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if not os.path.isfile(index):
        return None
    with open(index) as f:
        return sorted(set(json.load(f)["weight_map"].values()))
