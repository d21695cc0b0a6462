"""The mixer letters of the layout language: one table entry per letter, declared once, here.

An entry holds the letter's builder (config for this layer, layer index) -> nn.Module, its validator, its
options (config fields that swap the module for another: `wm_dyn_mask` on A builds the dynamic-mask attention) and
its traits, which the rest of the library asks of the letter instead of keeping lists of letters: the config fields
it reads, whether it is attention-like (and how many keys a query scores), whether a lightning indexer picks its keys,
whether DDP must expect parameters without a gradient, and why context
parallelism cannot run it. A trait that depends on options is a function of the layer's config.
Builders that live in a family module (mixers_*.py) are named "module:function" and imported on first use, so the
table is complete whatever was imported, in whatever order, and no module rewrites another's entry.
Token mixers are called as `m(x, ctx=..., cache=...)`, channel mixers as `m(x)`. A new architecture declares its
letters with `register("R", build, token=True)` (once per letter) instead of writing a new model class.
"""
import importlib
from dataclasses import dataclass
from typing import Callable

from torch import nn

from ..errors import ConfigError


def lazy(fn: Callable | str | None) -> Callable | None:
    """`fn`, or for "module:function" (a module of this package) a function importing it on first call: the family
    modules import this one, so the table cannot import them while it is being built."""
    if not isinstance(fn, str):
        return fn
    mod, name = fn.split(":")
    found = []

    def call(*args, **kw):
        if not found:
            found.append(getattr(importlib.import_module(f".{mod}", __package__), name))
        return found[0](*args, **kw)
    call.__name__ = call.__qualname__ = call.ref = fn
    return call


@dataclass(frozen=True)
class Option:
    """A config option of a letter: layers whose config has `on(cfg)` are built by `build` instead of the letter's
    builder. `validate(cfg)` checks the option's fields on every config of the letter, the option set or not."""
    field: str                       # the ModelConfig field that turns it on
    on: Callable
    build: Callable
    validate: Callable | None
    doc: str


@dataclass(frozen=True)
class Letter:
    builder: Callable                # builder(cfg, idx) -> nn.Module when no option is on
    token: bool                      # token mixer (sees the sequence, owns a cache slot) or channel mixer
    doc: str
    validator: Callable | None = None   # validator(cfg) raises ConfigError for impossible options
    options: tuple[Option, ...] = ()
    residual: bool = True            # False: built bare, no norm and residual around it (Z feeds the next letter)
    check: Callable | None = None    # check(cfg, parsed_layout_items): whole-layout rule, once if the letter is used
    reads: tuple[str, ...] = ()      # its config fields beyond the model-wide ones; "ssd_" = every field so named
    attention: bool = False          # attention-like token mixer (the middle of a two-hop block [RWM])
    unused_params: bool | Callable = False   # (cfg ->) some parameters may get no gradient in a step (DDP must know)
    no_context_parallel: str | Callable | None = None   # (cfg ->) why context parallelism cannot run it; None: it can
    attention_keys: Callable | None = None   # attention: cfg -> the most keys a query scores (window, top-k); None: all
    indexer: bool = False            # picks each query's keys with a lightning indexer (its captured mass is measured)

    def build(self, cfg, idx: int) -> nn.Module:
        """The module of one layer: the first option that is on, else the letter's builder."""
        for o in self.options:
            if o.on(cfg):
                return o.build(cfg, idx)
        return self.builder(cfg, idx)

    def validate(self, cfg):
        for o in self.options:
            if o.validate is not None:
                o.validate(cfg)
        if self.validator is not None:
            self.validator(cfg)

    def reads_field(self, name: str) -> bool:
        return any(name.startswith(r) if r.endswith("_") else name == r for r in self.reads)


def trait(value, cfg):
    """A letter's trait for the layer config `cfg`: the value, or what the function of the config returns."""
    return value(cfg) if callable(value) else value


def readers(name: str) -> list[str]:
    """The letters that read config field `name` (none for a model-wide field)."""
    return [k for k, v in LETTERS.items() if v.reads_field(name)]


def layer_configs(cfg) -> list[tuple[str, object]]:
    """(letter, its layer's config) for every layer of `cfg.layout`, layer_overrides applied."""
    from .layout import flatten, parse_layout
    return [(str(x), cfg.for_layer(i)) for i, x in enumerate(flatten(parse_layout(cfg.layout, LETTERS)))]


def attention_layers(cfg) -> list[tuple[str, object, int | None]]:
    """(letter, layer config, most keys a query scores or None for all earlier ones) of every attention layer."""
    return [(x, c, LETTERS[x].attention_keys(c) if LETTERS[x].attention_keys else None)
            for x, c in layer_configs(cfg) if LETTERS[x].attention]


def has_indexer(cfg) -> bool:
    """Whether any layer of `cfg.layout` chooses its keys with a lightning indexer."""
    return any(LETTERS[x].indexer for x, _ in layer_configs(cfg))


LETTERS: dict[str, Letter] = {}


def option(field: str, on: Callable, build: Callable | str, validate: Callable | str | None = None,
           doc: str = "") -> Option:
    return Option(field, on, lazy(build), lazy(validate), doc)


def register(letter: str, build: Callable[..., nn.Module] | str, *, token: bool, doc: str = "",
             validate: Callable | str | None = None, options: tuple[Option, ...] = (), residual: bool = True,
             check: Callable | str | None = None, reads: tuple[str, ...] = (), attention: bool = False,
             unused_params: bool | Callable = False, no_context_parallel: str | Callable | None = None,
             attention_keys: Callable | None = None, indexer: bool = False):
    """Declare `letter` (once: a second declaration is an error; options of a letter go in its one entry) with its
    traits (see `Letter`)."""
    if len(letter) != 1 or not letter.isalpha() or not letter.isupper():
        raise ValueError(f"a mixer letter is one upper-case letter, got {letter!r}")
    if letter in LETTERS:
        raise ValueError(f"mixer letter {letter!r} is already registered ({LETTERS[letter].doc}); a letter is "
                         f"declared once: add an option to its entry in models/registry.py instead")
    LETTERS[letter] = Letter(lazy(build), token, doc, lazy(validate), tuple(options), residual, lazy(check),
                             tuple(reads), attention, unused_params, no_context_parallel, attention_keys, indexer)


def need(cond: bool, msg: str):
    if not cond:
        raise ConfigError(msg)


def _validate_attention(cfg):
    need(cfg.n_heads >= 1 and cfg.kv_heads >= 1, "n_heads and n_kv_heads must be >= 1")
    need(cfg.n_heads % cfg.kv_heads == 0,
         f"n_heads ({cfg.n_heads}) must be a multiple of n_kv_heads ({cfg.kv_heads})")
    need(cfg.head_dim is not None or cfg.d_model % cfg.n_heads == 0,
         f"d_model ({cfg.d_model}) must be divisible by n_heads ({cfg.n_heads}), or set head_dim")
    rd = cfg.attn_head_dim if cfg.rope_dim is None else cfg.rope_dim
    need(rd % 2 == 0 and 0 <= rd <= cfg.attn_head_dim,
         f"rope_dim ({rd}) must be even and at most head_dim ({cfg.attn_head_dim})")
    need(cfg.window is None or cfg.window >= 1, f"window must be >= 1, got {cfg.window}")
    if cfg.n_k_heads is not None:
        need(cfg.n_k_heads >= 1 and cfg.kv_heads % cfg.n_k_heads == 0,
             f"n_k_heads ({cfg.n_k_heads}) must be >= 1 and divide the value heads n_kv_heads ({cfg.kv_heads})")


def _validate_ssd(cfg):
    d_inner = cfg.ssd_d_inner or cfg.ssd_expand * cfg.d_model
    need(cfg.ssd_d_inner is None or cfg.ssd_d_inner >= 1, f"ssd_d_inner must be >= 1, got {cfg.ssd_d_inner}")
    need(d_inner % cfg.ssd_headdim == 0,
         f"the SSD width ({d_inner}: ssd_d_inner, or ssd_expand*d_model) must be divisible by ssd_headdim "
         f"({cfg.ssd_headdim})")
    lim = cfg.ssd_dt_limit
    need(lim is None or (len(lim) == 2 and 0 <= lim[0] < lim[1]),
         f"ssd_dt_limit must be (lo, hi) with 0 <= lo < hi, got {lim}")
    need(cfg.ssd_norm in ("gated", "norm_gate", "gate"), f"ssd_norm must be gated|norm_gate|gate, got {cfg.ssd_norm!r}")
    nheads = d_inner // cfg.ssd_headdim
    need(nheads % cfg.ssd_ngroups == 0, f"SSD heads ({nheads}) must be divisible by ssd_ngroups ({cfg.ssd_ngroups})")
    need(cfg.ssd_chunk_size >= 1 and cfg.d_conv >= 1, "ssd_chunk_size and d_conv must be >= 1")


def _attention(cfg, idx):
    from ..layers.attention import Attention
    return Attention(cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.attn_head_dim, layer_idx=idx, bias=cfg.attn_bias,
                     rope_dim=(cfg.rope_dim if cfg.rope_dim is not None else cfg.attn_head_dim)
                     if cfg.pos_embedding == "rope" else 0,
                     rope_base=cfg.rope_base, rope_interleaved=cfg.rope_interleaved, window=cfg.window,
                     qk_norm=cfg.qk_norm, norm_eps=cfg.norm_eps, dropout=cfg.dropout,
                     n_k_heads=cfg.n_k_heads or (1 if cfg.attn_shared_key else None),
                     output_gate=cfg.attn_output_gate)


def _mlp(cfg, idx):
    from ..layers.mlp import MLP
    return MLP(cfg.d_model, cfg.mlp_hidden_size, act=cfg.mlp_act, gated=cfg.mlp_gated, bias=cfg.mlp_bias,
               dropout=cfg.dropout)


def _ssd(cfg, idx):
    from ..layers.mamba2 import Mamba2
    return Mamba2(cfg.d_model, layer_idx=idx, d_state=cfg.ssd_d_state, d_conv=cfg.d_conv,
                  expand=cfg.ssd_expand, headdim=cfg.ssd_headdim, ngroups=cfg.ssd_ngroups,
                  chunk_size=cfg.ssd_chunk_size, bias=cfg.ssd_bias, conv_bias=cfg.ssd_conv_bias,
                  dt_min=cfg.ssd_dt_min, dt_max=cfg.ssd_dt_max, A_init_range=cfg.ssd_A_init_range,
                  norm_eps=cfg.norm_eps, d_inner=cfg.ssd_d_inner, dt_limit=cfg.ssd_dt_limit,
                  norm=cfg.ssd_norm)


# --- the table: every letter of the language ------------------------------------------------------------------
def _dyn_mask_on(cfg) -> bool:
    return cfg.wm_dyn_mask != "none"


def _indexer_frozen(cfg) -> bool:
    """An indexer not trained by its KL (dsa_kl_weight 0) gets no gradient at all."""
    return not cfg.dsa_kl_weight


def _indexer_cp(cfg) -> str | None:
    return None if not cfg.dsa_kl_weight else (
        "its lightning indexer trains toward each query's attention over the whole sequence: set dsa_kl_weight=0 "
        "to train with a fixed indexer, or train it without context parallelism")


# the fields each letter reads besides the model-wide ones (d_model, norm, pos_embedding, dropout, ...)
_HEADS = ("n_heads", "n_kv_heads", "head_dim", "n_k_heads", "rope_base", "rope_dim", "rope_interleaved", "attn_",
          "qk_norm")
_ATTN = _HEADS + ("window", "wm_dyn_mask", "wm_keep_window")

register("A", _attention, token=True, doc="softmax attention (MHA/GQA/MQA, RoPE, optional window)",
         validate=_validate_attention, reads=_ATTN, attention=True, attention_keys=lambda cfg: cfg.window,
         options=(option("wm_dyn_mask", _dyn_mask_on, "mixers_wm:dyn_mask_attention", "mixers_wm:_validate_dyn_mask",
                         "dynamic-mask attention (Wonderful Matrices, Doge)"),))
register("S", _ssd, token=True, doc="SSD / Mamba-2 block", validate=_validate_ssd,
         reads=("ssd_", "d_conv", "wm_ssd_", "rope_base", "rope_interleaved"),
         options=(option("wm_ssd_rope", lambda cfg: cfg.wm_ssd_rope, "mixers_wm:_rope_ssd",
                         "mixers_wm:_validate_rope_ssd", "Cheems' SSD: RoPE on C/B, no conv or D"),))
register("M", _mlp, token=False, doc="MLP or gated MLP (SwiGLU)", reads=("mlp_",))
register("F", "mixers_wm:inner_attention", token=True, validate="mixers_wm:_validate_inner",
         reads=_ATTN + ("wm_inner_",), attention=True, attention_keys=lambda cfg: cfg.window,
         doc="inner-function attention (values f(x) from shared value rows; optional dynamic mask)")
register("E", "mixers_wm:_cdmoe", token=False, validate="mixers_wm:_validate_cdmoe",
         reads=("wm_cdmoe_", "mlp_"), unused_params=True,       # experts a step routes no token to
         doc="CDMoE: shared MLP + product-key single-neuron experts")
register("O", "mixers_moe:_routed_moe", token=False, validate="mixers_moe:_validate_moe",
         reads=("moe_", "mlp_"), unused_params=True,            # experts a step routes no token to
         no_context_parallel="the routed MoE's load-balancing loss is a function of the whole sequence's routing",
         doc="routed top-k MoE of gated MLPs (+ shared expert: MoE-SEI)")
register("L", "mixers_deepseek:_mla", token=True, validate="mixers_deepseek:_validate_mla",
         reads=("n_heads", "head_dim", "rope_base", "attn_bias", "mla_"), attention=True,
         doc="multi-head latent attention (MLA, DeepSeek-V3): decoupled RoPE, latent cache, absorbed decode")
register("I", "mixers_deepseek:_indexed", token=True, validate="mixers_deepseek:_validate_indexed",
         reads=_ATTN + ("mla_", "dsa_"), attention=True, unused_params=_indexer_frozen,
         no_context_parallel=_indexer_cp, attention_keys=lambda cfg: cfg.dsa_topk, indexer=True,
         doc="lightning-indexer top-k sparse attention (DeepSeek-V3.2) over MLA or attention")
register("R", "mixers_rodimus:_rodimus", token=True, validate="mixers_rodimus:_validate_rodimus",
         reads=("rodimus_", "d_conv"), doc="Rodimus block (DDTS gated linear attention in a GLU)")
register("W", "mixers_rodimus:_window_attention", token=True, validate="mixers_rodimus:_validate_window_attention",
         reads=_HEADS + ("swa_window",), attention=True, attention_keys=lambda cfg: cfg.swa_window,
         doc="sliding-window attention (swa_window; shared key with attn_shared_key), cache bounded by the window")
register("K", "mixers_kda:_kda", token=True, validate="mixers_kda:_validate_kda", reads=("kda_", "n_heads", "d_conv"),
         doc="Kimi Delta Attention (Kimi-Linear): gated delta rule with a per-channel forget gate, q/k/v short convs")
register("G", "mixers_delta:_gated_deltanet", token=True, validate="mixers_delta:_validate_gdn",
         reads=("gdn_", "n_heads", "head_dim", "d_conv"),
         doc="Gated DeltaNet (Qwen3-Next's linear attention: delta rule, scalar decay, short conv, gated RMSNorm)")
register("B", "mixers_mamba1:_mamba1", token=True, validate="mixers_mamba1:_validate_mamba1",
         reads=("mamba1_", "d_conv"), doc="Mamba-1 block (selective scan, per-channel diagonal A; Mamba, Jamba)")
register("C", "mixers_conv:_gated_conv", token=True, validate="mixers_conv:_validate_conv",
         reads=("d_conv", "conv_bias"),
         no_context_parallel="the gated short conv keeps only a conv tail, which travels with a recurrent state",
         doc="gated short convolution (LFM2): out(c ⊙ conv(b ⊙ h)), cache = conv tail")
register("Z", "mixers_zamba:_zamba", token=True, validate="mixers_zamba:_validate_zamba", residual=False,
         check="mixers_zamba:_check_feeds",
         reads=("zamba_", "n_heads", "n_kv_heads", "head_dim", "rope_base", "window", "mlp_"),
         doc="Zamba2 shared transformer over concat(stream, embeddings), output fed to the next letter's input")
