"""`HybridLMForCausalLM` for vLLM: one model class for any servable layout, its mixers from layers.py's table
(`LAYERS`, one class per mixer kind: vLLM's own layers where vLLM has the mixer and its kernel runs the run's dtype and
shapes here, ours with vLLM's cache otherwise; anything else is refused at load, named: config.check_servable).

    Block     x + mixer(norm(x))                                      (layers/residual.py's Residual)
    HopBlock  Rodimus++'s two-hop block [R W M]                       (layers/residual.py's TwoHopResidual)

Module and parameter names follow hybridlm's CausalLM (`embed`, `blocks.i.norm`, `blocks.i.mixer`, ...), so a run's
weights load by name through one WeightsMapper (the renames each mixer kind declares: our own layers under `own.`,
MambaMixer2's `conv1d` / `A`) and each kind's cuts of our fused tensors into vLLM's stacked parameters (fused QKV,
gate/up, the conv kernel's [C, K] as [C, 1, K], our stacked experts one expert at a time into FusedMoE's). vLLM
gives continuous batching, chunked prefill, prefix caching (its mamba "align" mode) and tensor parallelism (A, W, S,
C, M, O and, on vLLM's layers, G, K and B shard by heads / channels; the others are replicated).
"""
import json
import os
from collections.abc import Iterable
from contextlib import nullcontext

import torch
from torch import Tensor, nn
from vllm.config import VllmConfig, get_current_vllm_config_or_none, set_current_vllm_config
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator, get_temporal_copy_spec
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid, SupportsMambaPrefixCaching
from vllm.model_executor.models.utils import WeightsMapper
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from ..errors import ConfigError
from ..layers.norm import make_norm
from ..models.config import ModelConfig
from ..models.layout import Hop, flatten, parse_layout
from ..models.registry import LETTERS
from .config import check_servable, mla_fields
from .layers import MLALayer, Mixer, kind
from .state import BACKEND


class Block(nn.Module):
    """x + mixer(norm(x)) (layers/residual.py's Residual)."""

    def __init__(self, cfg: ModelConfig, letter: str, idx: int, prefix: str, vllm_config: VllmConfig):
        super().__init__()
        self.norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        mixer = kind(letter, cfg, vllm_config.model_config.dtype)
        self.mixer = mixer(cfg, letter, idx, f"{prefix}.mixer", vllm_config)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        return x + self.mixer(self.norm(x), positions)


class HopBlock(nn.Module):
    """Rodimus++'s two-hop block (layers/residual.py's TwoHopResidual):
    h = mixer(norm1(x)); r = x + h; a = attn(norm2(r)); out = r + ffn(norm3(a + r))."""

    def __init__(self, cfgs: list[ModelConfig], letters: tuple, idx: int, prefix: str, vllm_config: VllmConfig):
        super().__init__()
        self.norm1, self.norm2, self.norm3 = (make_norm(c.norm, c.d_model, c.norm_eps) for c in cfgs)
        dtype = vllm_config.model_config.dtype
        self.mixer, self.attn, self.ffn = (kind(x, c, dtype)(c, x, idx + j, f"{prefix}.{name}", vllm_config)
                                           for j, (x, c, name) in enumerate(zip(letters, cfgs,
                                                                                 ("mixer", "attn", "ffn"))))

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        r = x + self.mixer(self.norm1(x), positions)
        a = self.attn(self.norm2(r), positions)
        return r + self.ffn(self.norm3(a + r), positions)


def _model_config(vllm_config: VllmConfig) -> ModelConfig:
    hf = vllm_config.model_config.hf_config
    return ModelConfig.from_dict(hf.hybridlm) if hf.hybridlm is not None else ModelConfig()


def _largest_state(vllm_config: VllmConfig):
    """(shapes, dtypes) of the recurrent layer with the largest state: vLLM sizes every mamba page by it. The kinds
    are chosen as the model's layers will be (under `vllm_config`: its tensor-parallel size is a reason to refuse)."""
    cfg, dtype = _model_config(vllm_config), vllm_config.model_config.dtype
    with nullcontext() if get_current_vllm_config_or_none() else set_current_vllm_config(vllm_config):
        states = [kind(str(x), c := cfg.for_layer(i), dtype).state(c, str(x), vllm_config)
                  for i, x in enumerate(flatten(parse_layout(cfg.layout, LETTERS)))]
    found = [s for s in states if s is not None]

    def nbytes(item):
        shapes, dtypes = item
        return sum(torch.Size(s).numel() * torch.empty(0, dtype=t).element_size() for s, t in zip(shapes, dtypes))
    return max(found, key=nbytes) if found else (((0,),), (vllm_config.model_config.dtype,))


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
        """Per kind of state: vLLM's for its layers' (MambaMixer2, ShortConv, MambaMixer, Gated DeltaNet and KDA: one
        kind, the same copies), a whole-snapshot copy for our (conv, state)."""
        ours = {MambaAttentionBackendEnum[BACKEND]: (get_temporal_copy_spec, get_temporal_copy_spec),
                MambaAttentionBackendEnum.SHORT_CONV: MambaStateCopyFuncCalculator.short_conv_state_copy_func(),
                MambaAttentionBackendEnum.MAMBA1: MambaStateCopyFuncCalculator.mamba1_state_copy_func(),
                MambaAttentionBackendEnum.GDN_ATTN: MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()}
        return {t: ours.get(t, cls.get_mamba_state_copy_func()) for t in mamba_types}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        hf = vllm_config.model_config.hf_config
        cfg = _model_config(vllm_config)
        dtype = vllm_config.model_config.dtype
        check_servable(cfg, getattr(hf, "quantization_config", None), dtype)
        if (getattr(hf, "kv_lora_rank", None) is not None) != bool(mla_fields(cfg, dtype)):
            # vLLM turned MLA on for the model (use_mla) before it knew the dtype; now L cannot stay on it
            raise ConfigError(f"the hybridlm vLLM plugin cannot serve letter L at dtype {dtype} here: "
                              f"{MLALayer.refuse(cfg, 'L', dtype)}; serve with --dtype bfloat16")
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
        self.mixers = {n: m for n, m in self.named_modules() if isinstance(m, Mixer)}
        self.hf_to_vllm_mapper = WeightsMapper(orig_to_new_prefix={
            f"{n}.{old}": f"{n}.{new}" for n, m in self.mixers.items() for old, new in m.renames.items()})

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
        """Our state dict's names, renamed by the WeightsMapper, into this module's parameters; a mixer cuts our fused
        tensors into vLLM's stacked shards (`Mixer.cut`)."""
        params = {**dict(self.named_buffers()), **dict(self.named_parameters())}   # our layers keep some buffers
        loaded = set()
        for name, w in self.hf_to_vllm_mapper.apply(weights):
            if name == "lm_head.weight" and self.config.tie_embeddings:
                continue
            owner = ".".join(name.split(".")[:3])
            cuts = ([(f"{owner}.{t}", shard, part) for t, shard, part in self.mixers[owner].cut(
                name[len(owner) + 1:], w)] if owner in self.mixers else [(name, None, w)])
            for target, shard, tensor in cuts:
                p = params[target]
                loader = getattr(p, "weight_loader", default_weight_loader)
                loader(p, tensor, *(shard if isinstance(shard, tuple) else () if shard is None else (shard,)))
                loaded.add(target)
        if self.config.tie_embeddings:
            loaded.add("lm_head.weight")
        return loaded


def _weight_files(model_dir: str) -> list[str] | None:
    """The safetensors files of a local directory's index (a run keeps its weights in step directories, which vLLM's
    loader, globbing the top level, would not find), else None (vLLM's own search)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if not os.path.isfile(index):
        return None
    with open(index) as f:
        return sorted(set(json.load(f)["weight_map"].values()))
