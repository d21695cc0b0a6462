"""hybridlm models as transformers models: `AutoModelForCausalLM`, `generate()`, `pipeline`, `save_pretrained`.

    import hybridlm                                  # registers model_type "hybridlm" once transformers is imported
    # (or, in a program that never imports hybridlm: from_pretrained(d, trust_remote_code=True), through the shim that
    #  save_pretrained and every checkpoint write beside config.json: checkpoint/remote_code.py)
    model = HybridLMForCausalLM.from_model(causal_lm)                 # wraps it: same parameters, no copy
    model.save_pretrained(d); AutoModelForCausalLM.from_pretrained(d).generate(ids, num_beams=3)

One config class carrying the whole ModelConfig (layout included) and one model class around the one `CausalLM`: no
modeling code per architecture. `generate()` keeps its state in a `HybridLMCache`, a transformers `Cache` around our
`InferenceCache`: each mixer keeps reading and writing its own slot (K/V, rings, MLA latents, indexer keys,
recurrent and conv states) exactly as in our own decoding, so both decode the same function, and the cache reorders
every slot's batch rows for beam search. (transformers' per-layer types would fit only the plain K/V and recurrent
slots, and would need a second cache protocol in every mixer.) Needs transformers 5.x (`pip install hybridlm[hf]`).
"""
import torch
from torch import Tensor
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..cache import InferenceCache
from ..checkpoint.remote_code import AUTO_MAP, write_shim
from ..errors import InputError
from ..models.causal_lm import CausalLM
from ..models.config import ModelConfig
from ..models.quantize import cpu_kernels_by_default_


class HybridLMConfig(PreTrainedConfig):
    """The ModelConfig under `hybridlm` (the source of truth), plus the few names transformers reads mirrored from it."""

    model_type = "hybridlm"
    keys_to_ignore_at_inference = ["past_key_values"]

    hybridlm: dict | None = None                 # ModelConfig.to_dict(); None = ModelConfig() defaults
    vocab_size: int = 256
    hidden_size: int = 256
    num_hidden_layers: int = 4
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    use_cache: bool = True

    def __post_init__(self, **kwargs):
        mirrored = self.model_config.transformers_dict()           # the names a training checkpoint writes too
        for key in ("hybridlm", "vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings",
                    "tie_word_embeddings"):
            setattr(self, key, mirrored[key])
        kwargs["auto_map"] = dict(AUTO_MAP)                         # the shim save_pretrained writes beside it
        super().__post_init__(**kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """config.json, and the remote-code shim its auto_map names (checkpoint/remote_code.py)."""
        super().save_pretrained(save_directory, *args, **kwargs)
        write_shim(save_directory)

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig"):
        """Nothing: transformers would copy this file into saved directories, where it cannot run outside the
        package; save_pretrained writes the shim that imports it instead."""

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.hybridlm) if self.hybridlm is not None else ModelConfig()

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, **kwargs) -> "HybridLMConfig":
        return cls(hybridlm=cfg.to_dict(), **kwargs)


def _take_rows(t: Tensor, rows: Tensor) -> Tensor:
    """t[rows] in t's memory order (K/V buffers are head-major views: keep them so)."""
    order = sorted(range(t.dim()), key=t.stride, reverse=True)
    return t.permute(order).index_select(order.index(0), rows).permute([order.index(d) for d in range(t.dim())])


def _select_rows(obj, rows: Tensor, batch: int):
    """Replace every per-row tensor [batch, ...] held by a cache (its bookkeeping, each slot, and slots inside slots:
    an indexer's slot holds its attention's) by its `rows`."""
    items = enumerate(obj) if isinstance(obj, list) else vars(obj).items()
    for key, v in list(items):
        if isinstance(v, Tensor):
            if v.dim() and v.shape[0] == batch:
                v = _take_rows(v, rows)
                if isinstance(obj, list):
                    obj[key] = v
                else:
                    setattr(obj, key, v)
        elif isinstance(v, list) or (hasattr(v, "__dict__") and not isinstance(v, type)):
            _select_rows(v, rows, batch)


class HybridLMCache(Cache):
    """transformers' handle on our `InferenceCache` (created at the first forward, when the batch size is known)."""

    is_compileable = False

    def __init__(self, model: CausalLM, max_tokens: int | None = None):
        super().__init__(layers=[])
        self.model, self.max_tokens = model, max_tokens
        self.inner: InferenceCache | None = None

    def for_batch(self, batch_size: int) -> InferenceCache:
        if self.inner is None:
            self.inner = self.model.make_cache(batch_size, max_tokens=self.max_tokens)
        return self.inner

    def __len__(self) -> int:
        return self.model.num_layers

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.inner.seen if self.inner is not None else 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_initialized(self) -> bool:
        return self.inner is not None

    @property
    def is_croppable(self) -> bool:
        return False            # recurrent states cannot be rolled back a few tokens

    def crop(self, tokens_to_remove: int):
        raise InputError("a hybridlm cache cannot be cropped (recurrent states have no per-token history)")

    def reset(self):
        self.inner = None

    def reorder_cache(self, beam_idx: Tensor):
        """Beam search: row i continues from row beam_idx[i], in every layer's state and in the bookkeeping."""
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: Tensor):
        c = self.inner
        if c is None:
            return
        rows = indices.to(c.next_pos.device, torch.long)
        _select_rows(c, rows, c.batch_size)
        c.batch_size = len(rows)

    def batch_repeat_interleave(self, repeats: int):
        if self.inner is not None:
            rows = torch.arange(self.inner.batch_size, device=self.inner.next_pos.device)
            self.batch_select_indices(rows.repeat_interleave(repeats))


class HybridLMForCausalLM(PreTrainedModel, GenerationMixin):
    """A transformers causal LM whose `model` is our `CausalLM` (its parameters, under the prefix "model.")."""

    config_class = HybridLMConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _is_stateful = True                 # recurrent layers: no assisted decoding (it needs to roll the cache back)
    _tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"}   # used only with tie_word_embeddings

    def __init__(self, config: HybridLMConfig, model: CausalLM | None = None):
        super().__init__(config)
        self.model = model if model is not None else CausalLM(config.model_config)
        self._tied_weights_keys = self.get_expanded_tied_weights_keys()    # what save_pretrained may store once
        self.post_init()

    @classmethod
    def from_model(cls, model: CausalLM, **config_kwargs) -> "HybridLMForCausalLM":
        """Wrap an existing CausalLM (no copy: the wrapper's parameters are the model's)."""
        config = HybridLMConfig.from_model_config(model.config, **config_kwargs)
        p = next(model.parameters())
        return cls(config, model).to(p.dtype).train(model.training)

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModelForCausalLM"):
        """Nothing (as HybridLMConfig.register_for_auto_class): the config's save_pretrained writes the shim."""

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        """Every parameter name that is another's tensor -> the first name: the tied embedding (tie_word_embeddings)
        and the weight-shared layers of `X@k` layouts, which transformers then saves once and ties back on load."""
        first, tied = {}, {}
        for name, p in self.named_parameters(remove_duplicate=False):
            src = first.setdefault(id(p), name)
            if src != name:
                tied[name] = src
        return tied

    def _init_weights(self, module):
        """Nothing: every hybridlm module initialises itself when built (CausalLM.reset_parameters and each mixer's own
        init: A_log, dt_bias, conv, ...); transformers' generic init would overwrite that."""

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, value):
        self.model.lm_head = value

    def generate(self, *args, **kwargs):
        """transformers' generate, with the project's CPU kernels on a CPU as in our own decoding
        (`models.quantize.cpu_kernels_by_default_`: training unaffected; HYBRIDLM_CPU_KERNELS=0 turns them off)."""
        cpu_kernels_by_default_(self.model)
        return super().generate(*args, **kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length):
        """generate() would build a DynamicCache; ours holds every mixer's state, sized once for the whole output."""
        if model_kwargs.get("past_key_values") is not None or generation_config.use_cache is False:
            return super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, batch_size,
                                                         max_cache_length)
        model_kwargs["past_key_values"] = HybridLMCache(self.model, max_tokens=max_cache_length)

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                past_key_values: HybridLMCache | None = None, labels: Tensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int = 0, inputs_embeds: Tensor | None = None,
                position_ids: Tensor | None = None, **kwargs) -> CausalLMOutputWithPast:
        """input_ids [B, T] (only the tokens the cache has not seen); attention_mask [B, past + T] (transformers'
        convention: the whole sequence) or [B, T]; labels [B, T] aligned with input_ids (shifted inside).
        position_ids are ignored: the model derives the same ones from the mask (left padding starts at 0)."""
        if inputs_embeds is not None or input_ids is None:
            raise InputError("HybridLMForCausalLM takes input_ids (inputs_embeds is not supported)")
        if past_key_values is not None and not isinstance(past_key_values, HybridLMCache):
            raise InputError(f"HybridLMForCausalLM needs a HybridLMCache, got {type(past_key_values).__name__}")
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        if past_key_values is None and use_cache and labels is None:
            past_key_values = HybridLMCache(self.model)
        cache = past_key_values.for_batch(input_ids.shape[0]) if past_key_values is not None else None
        if attention_mask is not None:
            attention_mask = attention_mask[:, -input_ids.shape[1]:]
        out = self.model(input_ids, attention_mask=attention_mask, cache=cache, labels=labels,
                         logits_to_keep=logits_to_keep or None)
        return CausalLMOutputWithPast(loss=out.loss, logits=out.logits, past_key_values=past_key_values)


from .auto import register  # noqa: E402  (the Auto classes learn "hybridlm" however this module was reached)

register()
