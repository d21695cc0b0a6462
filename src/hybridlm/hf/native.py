"""A hybridlm model as one of transformers' own classes, when it is exactly one (`hybridlm convert --to-hf RUN
--as-native [auto|FAMILY]`): the result loads without hybridlm installed, and engines that read those classes' config
(vLLM, SGLang, TGI) serve it.

One table, `FAMILIES` (hf/native_families.py): per transformers family, how our layout's blocks group into its
decoder layers and its config from ours. Nothing else is per family, and every check runs the converter
(hf/convert*.py) backwards:
  - "exactly" is the native config read back through our converter: the ModelConfig it gives must equal ours in every
    field our model's letters read (derived defaults resolved; initialisation- and speed-only fields aside);
  - the weights are placed by inverting the converter itself: each native tensor element is numbered, the converter
    maps the numbers as it would map weights (renames, concatenations, reshapes, stacking, constant offsets such as
    Qwen3-Next's 1 + w), and our weights are scattered to where their numbers came from, so there is no second,
    hand-written mapping to keep in sync.
A model no family expresses gets one error naming what stands in the way and the families that come closest.
"""
import math
from contextlib import contextmanager

import torch
from torch import nn

from ..errors import ConfigError
from ..models.causal_lm import CausalLM
from ..models.config import ModelConfig, quiet_unread
from ..models.layout import flatten, parse_layout
from ..models.registry import LETTERS, readers
from .common import LazyTensor, Tensors, convert_weights
from .convert import CONVERTERS   # (importing convert registers every converter)
from .native_families import FAMILIES, NotExpressed, class_name, family_name, layout_tokens

# fields that change no function computed (initialisation, speed, training only): never compared
_NO_EFFECT = {"init_std", "dropout", "max_seq_len", "ssd_chunk_size", "ssd_dt_min", "ssd_dt_max", "ssd_A_init_range",
              "rodimus_chunk_size", "gdn_chunk_size", "mamba1_chunk_size", "mla_absorb", "dsa_kl_weight"}


# ---------------------------------------------------------------------------------------------------
# the round trip: our config -> theirs -> back through the converter -> compared

def _normal(cfg: ModelConfig) -> dict:
    """Fields with the defaults that mean "derived" resolved, so equal models compare equal."""
    from ..models.mixers_deepseek import dsa_sizes, mla_sizes
    from ..models.mixers_delta import gdn_sizes
    from ..models.mixers_kda import kda_sizes
    d = cfg.to_dict()
    moe_h = cfg.moe_hidden or cfg.mlp_hidden_size
    d.update(n_kv_heads=cfg.kv_heads, head_dim=cfg.attn_head_dim, mlp_hidden=cfg.mlp_hidden_size,
             rope_dim=cfg.attn_head_dim if cfg.rope_dim is None else cfg.rope_dim, moe_hidden=moe_h,
             moe_shared_hidden=cfg.moe_shared_hidden or moe_h,
             wm_cdmoe_hidden=cfg.wm_cdmoe_hidden or cfg.mlp_hidden_size,
             ssd_d_inner=cfg.ssd_d_inner or cfg.ssd_expand * cfg.d_model, ssd_expand=None,
             mamba1_dt_rank=cfg.mamba1_dt_rank or math.ceil(cfg.d_model / 16),
             mamba1_norm_eps=cfg.norm_eps if cfg.mamba1_norm_eps is None else cfg.mamba1_norm_eps,
             layout=[t for t, _ in layout_tokens(cfg)])
    d.update({"mla_" + k: v for k, v in mla_sizes(cfg).items()})
    d.update({"dsa_" + k: v for k, v in dsa_sizes(cfg).items()})
    d.update(zip(("kda_heads", "kda_head_dim", "kda_rank"), kda_sizes(cfg)))
    d.update(zip(("gdn_k_heads", "gdn_v_heads", "gdn_k_dim", "gdn_v_dim"), gdn_sizes(cfg)))
    return d


def _refusals() -> tuple:
    from huggingface_hub.errors import StrictDataclassError   # (transformers' configs validate their fields with it)
    return ConfigError, ValueError, StrictDataclassError


def _relevant(name: str, letters: set[str], cfg: ModelConfig) -> bool:
    """Whether field `name` can change what a model of these letters computes."""
    if name in _NO_EFFECT or name == "layer_overrides" and not cfg.layer_overrides:
        return False
    if name == "mlp_hidden":                   # for O and E only the default of their own widths (resolved)
        own = ("moe_hidden", "wm_cdmoe_hidden")
        return any(not any(LETTERS[x].reads_field(w) for w in own) for x in letters & set(readers(name)))
    if name in ("rope_base", "rope_dim", "rope_interleaved") and cfg.pos_embedding != "rope":
        return False
    who = readers(name)
    return not who or bool(letters & set(who))


def _without_unread_rope(cfg: ModelConfig, letters: set[str]) -> ModelConfig:
    """RoPE that no layer applies (an S-only or NoPE model with the default pos_embedding "rope") is no RoPE."""
    rotary = set(readers("rope_base")) - {"S"}          # S reads it only under wm_ssd_rope (compared on its own)
    return cfg.replace(pos_embedding="none") if cfg.pos_embedding == "rope" and not letters & rotary else cfg


def _express(family: str, cfg: ModelConfig, tokens, special: dict):
    """`family`'s config computing exactly `cfg`'s function, else NotExpressed."""
    fam = FAMILIES[family]
    layers = fam.grammar(tokens)
    every = flatten(parse_layout(cfg.layout, LETTERS.keys()))
    letters, n_layers = {str(x) for x in every}, len(every)
    try:
        hf = fam.config(cfg, layers, tokens)
        for k, v in special.items():
            setattr(hf, k, v)
        fields = CONVERTERS[hf.model_type].config(hf)
        with quiet_unread():
            back = ModelConfig(**fields)
    except _refusals() as e:                  # a config that transformers or our converter refuses
        raise NotExpressed((n_layers, -1), " ".join(str(e).split())) from None
    cfg, back = _without_unread_rope(cfg, letters), _without_unread_rope(back, letters)
    ours, theirs = _normal(cfg), _normal(back)
    bad = [k for k in ours if _relevant(k, letters, cfg) and ours[k] != theirs[k]]
    if bad:
        raise NotExpressed((n_layers, -len(bad)), ", ".join(f"{k}={ours[k]!r}" for k in bad))
    return hf


def native_config(cfg: ModelConfig, family: str = "auto", **special):
    """transformers' config of the native class computing exactly `cfg`'s function (`family`, or with "auto" the
    first of FAMILIES that does), else one ConfigError naming what stands in the way."""
    tokens = layout_tokens(cfg)
    names = list(FAMILIES) if family == "auto" else [family_name(family)]
    misses = {}
    for name in names:
        try:
            return _express(name, cfg, tokens, special)
        except NotExpressed as off:
            misses[name] = off
    if family != "auto":
        raise ConfigError(f"--as-native {family}: this model is not exactly a {class_name(names[0])}: "
                          f"{misses[names[0]].what}")
    best = max(off.reach for off in misses.values())
    closest = [k for k, off in misses.items() if off.reach == best]
    what = misses[closest[0]].what
    where = (f"every family stops at {what}" if best == (0, 0) else
             f"the closest, {', '.join(class_name(k) for k in closest[:4])}, stop{'s' * (len(closest) == 1)} at {what}")
    raise ConfigError(f"--as-native: no transformers class computes layout {cfg.layout!r} exactly: {where}. Export "
                      "without --as-native (HybridLMForCausalLM: loads with hybridlm or trust_remote_code=True)")


# ---------------------------------------------------------------------------------------------------
# the weights: the converter run on numbered tensors

class _Numbered(LazyTensor):
    """Positions [offset + 1, offset + 1 + numel) of the native weights (0 marks a constant the converter made),
    shaped like one native tensor, made when the converter reads it (so only the index tensors the converter is
    holding exist at a time); with dtype None all zeros instead (uint8: the converter's constant offsets)."""

    def __init__(self, offset: int, shape: torch.Size, dtype: torch.dtype | None):
        self.offset, self.shape, self.dtype = offset, shape, dtype

    def load(self) -> torch.Tensor:
        if self.dtype is None:
            return torch.zeros(self.shape, dtype=torch.uint8)
        n = math.prod(self.shape)
        return torch.arange(self.offset + 1, self.offset + 1 + n, dtype=self.dtype).view(self.shape)


@contextmanager
def _parameters_on_meta():
    """Build a module with its parameters on the meta device and its buffers (rotary frequencies) real, as
    accelerate's init_empty_weights(include_buffers=False) does: each parameter lives on the CPU only while made."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:       # (a tie re-registers a meta one: keep it)
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def to_native(model: CausalLM, family: str = "auto", **special):
    """transformers' own class (`native_config`) with `model`'s weights (copied), in eval mode. Memory: one native
    copy of the weights, a bitmap and the index tensors of the converter's output (int32 below 2^31 weights; float64
    for a converter that computes in floating point, Qwen3-Next's 1 + w), about 2.3x a float32 model beside it
    (3.3x with float64 numbers): a 1.5B float32 model exports in 24 GB."""
    from transformers import AutoModelForCausalLM
    hf_cfg = native_config(model.config, family, **special)
    dtype = next(model.parameters()).dtype
    with _parameters_on_meta():                   # shapes only: the weights are placed below, never initialised
        hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    theirs, seen = {}, set()
    for k, t in hf.state_dict(keep_vars=True).items():     # a tied tensor (lm_head, shared blocks): number it once
        if id(t) not in seen:
            seen.add(id(t))
            theirs[k] = t
    sizes = [t.numel() for t in theirs.values()]
    offsets = torch.tensor([0, *sizes]).cumsum(0).tolist()

    def run(index: torch.dtype | None) -> dict:    # the converter on numbered tensors (None: on zeros)
        tensors = Tensors({k: _Numbered(o, t.shape, index) for (k, t), o in zip(theirs.items(), offsets)})
        return convert_weights(hf_cfg, tensors, model.config)
    const = run(None)                              # what the converter makes of zeros: the constants it adds (1 + w)
    # numbers survive as integers, or, where the converter computes in floating point, as float64 (exact to 2^53)
    index = torch.float64 if any(v.is_floating_point() for v in const.values()) else \
        torch.int32 if offsets[-1] < 2 ** 31 else torch.int64
    const = {k: v for k, v in const.items() if bool(v.any())}
    placed = run(index)
    flat = torch.empty(offsets[-1], dtype=dtype)  # the native weights, one buffer
    filled = torch.zeros(offsets[-1], dtype=torch.bool)
    ours = model.state_dict()
    for name in list(placed):
        c = const.pop(name, None)
        idx = placed.pop(name).reshape(-1)
        w = ours[name].detach().reshape(-1)
        if c is not None:                          # theirs = ours - c (exact for weights near c: Sterbenz)
            c = c.reshape(-1)
            idx = idx - c.to(idx.dtype)
            w = (w.to(c.dtype if c.is_floating_point() else w.dtype) - c).to(dtype)
        if idx.is_floating_point() and not torch.equal(idx, idx.round()):
            raise ConfigError(f"--as-native: the {class_name(hf_cfg.model_type)} converter scales {name}")
        idx = idx.long() - 1
        if bool((idx < 0).any()):
            raise ConfigError(f"--as-native: the {class_name(hf_cfg.model_type)} converter makes part of {name} "
                              "from no weight of the class")
        w = w.to(dtype)
        again = filled[idx]                        # a native weight read twice (tied, shared): ours must agree
        if bool(again.any()) and not torch.equal(flat[idx][again], w[again]):
            raise ConfigError(f"--as-native: {name} differs where {class_name(hf_cfg.model_type)} shares one weight")
        flat[idx] = w
        filled[idx] = True
        del idx
    if not bool(filled.all()):
        raise ConfigError(f"--as-native: the converter leaves part of {type(hf).__name__}'s weights unset")
    del filled
    state = {k: flat[o:o + t.numel()].view(t.shape) for (k, t), o in zip(theirs.items(), offsets)}
    hf.load_state_dict(state, strict=False, assign=True)
    hf.tie_weights()
    return hf.eval()
