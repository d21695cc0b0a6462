"""ModelConfig: every size and option of a model, plus its layout string."""
import contextlib
import contextvars
import dataclasses
import difflib
import json
import warnings
from dataclasses import asdict, dataclass, field, fields

from ..errors import ConfigError
from .registry import lazy

# fields that were renamed: old name -> new name. Config dicts (config.json, checkpoints, recipes, --set) written
# with an old name still load (`renamed`).
RENAMED = {"wm_moe_experts": "moe_experts", "wm_moe_topk": "moe_topk", "wm_moe_hidden": "moe_hidden",
           "wm_moe_shared": "moe_shared"}
# the per-letter short-conv kernels merged into d_conv, and the letter that read each: a config.json from before
# carries all six, of which only those of letters in its layout reached the model
MERGED = {"ssd_d_conv": "S", "rodimus_d_conv": "R", "kda_d_conv": "K", "gdn_conv": "G", "mamba1_d_conv": "B",
          "conv_kernel": "C"}
RENAMED |= dict.fromkeys(MERGED, "d_conv")


def renamed(d: dict, where: str = "config") -> dict:
    """`d` (config fields) with old field names replaced by their new ones (ModelConfig does the same to each of
    its `layer_overrides`); where `d` names the layout, a merged field of a letter absent from it is dropped."""
    layout = d.get("layout")
    out, given = {}, {}
    for k, v in d.items():
        if k in MERGED and isinstance(layout, str) and MERGED[k] not in layout:
            continue
        new = RENAMED.get(k, k)
        if new in out and out[new] != v:
            raise ConfigError(f"{where} sets {given[new]!r} = {out[new]!r} and {k!r} = {v!r}: two names of one "
                              f"field ({new})")
        out[new], given[new] = v, k
    return out


_QUIET = contextvars.ContextVar("quiet_unread", default=False)


@contextlib.contextmanager
def quiet_unread():
    """ModelConfigs made inside do not warn about fields their layout does not read (`unread`): converters from
    transformers fill every field their family has, whatever letters one checkpoint uses, and a preset may set
    fields for letters that only its deeper layouts contain."""
    token = _QUIET.set(True)
    try:
        yield
    finally:
        _QUIET.reset(token)


def unread(cfg, names=None) -> dict[str, list[str]]:
    """Fields of `cfg` (of `names`, if given) set away from their default whose letters, the only ones that read
    them, are all absent from the layout: field -> those letters."""
    from .registry import readers
    used = set(cfg.layout)
    out = {}
    for f in fields(cfg):
        if (names is None or f.name in names) and f.default is not dataclasses.MISSING:
            who = readers(f.name)
            if who and not used.intersection(who) and getattr(cfg, f.name) != f.default:
                out[f.name] = who
    return out


def warn_unread(cfg, names=None, stacklevel: int = 2):
    """One UserWarning naming each field of `unread(cfg, names)` and the letters that would read it (none inside
    `quiet_unread`)."""
    found = not _QUIET.get() and unread(cfg, names)
    if found:
        listed = "; ".join(f"{k} (read by {', '.join(v)})" for k, v in found.items())
        effect = "this field has" if len(found) == 1 else "these fields have"
        warnings.warn(f"layout {cfg.layout!r} has no letter that reads {listed}: {effect} no effect",
                      stacklevel=stacklevel + 1)


def check_fields(keys, where: str = "config"):
    """One ConfigError naming each unknown ModelConfig field and the nearest valid names."""
    names = [f.name for f in fields(ModelConfig)]
    unknown = sorted(set(keys) - set(names))
    if unknown:
        hints = []
        for k in unknown:
            near = [RENAMED[k]] if k in RENAMED else difflib.get_close_matches(k, names, n=3, cutoff=0.6)
            hints.append(f"{k!r}" + (f" (did you mean {' or '.join(near)}?)" if near else ""))
        raise ConfigError(f"unknown {where} field {', '.join(hints)}")


# extra whole-model checks, hook(cfg, parsed_layout_items), declared here ("module:function" imported on first use)
CONFIG_CHECKS: list = [lazy("mixers_deepseek:_check_hyper_connections"),   # the hyper_connections options
                       lazy("mixers_rodimus:_check_hops")]                 # two-hop block structure [...]


@dataclass
class ModelConfig:
    """One flat config for all architectures; each letter's builder reads the fields it needs.
    `layer_overrides` maps a letter index (0-based, in the expanded layout) to field overrides."""
    layout: str = "(AM)*4"
    vocab_size: int = 256
    d_model: int = 256
    max_seq_len: int = 2048
    tie_embeddings: bool = True
    norm: str = "rms"                     # rms | layer
    norm_eps: float = 1e-6
    init_std: float = 0.02
    dropout: float = 0.0
    residual_scale: bool = False          # Doge: learnable per-channel residual weight (init 1)
    pos_embedding: str = "rope"           # rope | learned (GPT-2 style absolute positions) | none
    embed_scale: float = 1.0              # token embeddings × embed_scale (Rodimus' use_scale_embedding: √n)
    embed_norm: bool = False              # RMSNorm right after the (scaled) embedding (Rodimus' use_norm_embedding)
    # attention (A)
    n_heads: int = 8
    n_kv_heads: int | None = None         # None = n_heads (MHA); fewer = GQA; 1 = MQA
    head_dim: int | None = None           # None = d_model // n_heads
    rope_base: float = 10000.0
    rope_dim: int | None = None           # rotary channels per head; None = head_dim
    rope_interleaved: bool = False
    attn_bias: bool = False
    qk_norm: bool = False
    window: int | None = None             # sliding window for A layers (None = full causal)
    # MLP (M)
    mlp_hidden: int | None = None         # None = 8/3 · d_model rounded up to a multiple of 64 (gated)
    mlp_act: str = "silu"
    mlp_gated: bool = True
    mlp_bias: bool = False
    # short causal depthwise conv of S, R, K, G, B and C: one kernel for the model (a layer's own: layer_overrides)
    d_conv: int = 4                       # taps (Mamba, FLA and the hybrids built on them: 4; LFM2's C: 3)
    # SSD / Mamba-2 (S)
    ssd_d_state: int = 64
    ssd_expand: int = 2
    ssd_headdim: int = 64
    ssd_ngroups: int = 1
    ssd_chunk_size: int = 64
    ssd_bias: bool = False
    ssd_conv_bias: bool = True
    ssd_dt_min: float = 1e-3
    ssd_dt_max: float = 0.1
    ssd_A_init_range: tuple[float, float] = (1.0, 16.0)
    # Rodimus (R), sliding-window attention (W), shared-key attention (the Rodimus* paper)
    rodimus_d_state: int = 64             # n: state expansion; the state is n × (expand · d_model) per layer
    rodimus_expand: int = 2               # GLU width m = expand · d_model
    rodimus_d_inner: int | None = None    # m set directly (None = expand · d_model); the released code's
                                          # non-integer expand_ratio gives m = align8(int(d_model · expand_ratio))
    rodimus_rank: int | None = None       # ℓ: rank of β̂'s projection; None = max(d_model // 64, 16)
    rodimus_chunk_size: int = 64
    rodimus_use_g: bool = True            # ablations (table 11): False makes g a learned constant,
    rodimus_use_tau: bool = True          # τ = 1,
    rodimus_use_beta_hat: bool = True     # β̂ = 1
    rodimus_product_decay: bool = False   # table 12: also decay the value dim by β_t = 1 - β̂_t
    swa_window: int = 1024                # W layers: each query sees its last swa_window keys (itself included)
    attn_shared_key: bool = False         # A and W layers: one key head shared by all query and value heads
    n_k_heads: int | None = None          # A and W layers: key heads, each shared by a group of value heads
                                          # (None = 1 with attn_shared_key, else n_kv_heads)
    # Wonderful Matrices: Cheems, Doge, inner-function attention (F), CDMoE (E) (Shi et al., 2024;
    # models/mixers_wm.py)
    wm_ssd_rope: bool = False             # S layers: RoPE on C and B, own X/B/C/dt projections, no conv/gate/norm/D
    wm_ssd_position: str = "rope"         # with wm_ssd_rope: "conv" puts Mamba-2's conv + D back in place of RoPE (ablation)
    wm_dyn_mask: str = "none"             # A and F layers: none | position (eq. 4: learned weight per head and key
                                          # position multiplied into the causal attention) | dt (Doge: bias
                                          # exp(A·softplus(dt_proj(V))) per key added to the scores)
    wm_keep_window: int | None = None     # dt mask: each query keeps only its top keep_window keys (None = all)
    wm_inner_values: int = 8              # F: n_v shared value rows of the inner function f(x)
    wm_inner_topk: int = 2                # F: value rows retrieved per token and head
    wm_inner_dret: int = 64               # F: retrieval dimension of the value query
    wm_cdmoe_form: str = "doge"           # E: doge (router, shared gated MLP) | sum | compose (the two forms of eq. 5)
    wm_cdmoe_experts: int = 16384         # E: private single-neuron experts; a perfect square (√N keys per side)
    wm_cdmoe_topk: int = 64               # E: experts per token and retrieval head
    wm_cdmoe_heads: int = 1               # E: product-key retrieval heads
    wm_cdmoe_dret: int = 128              # E, sum/compose forms: query dimension per head (two halves of d_ret/2)
    wm_cdmoe_hidden: int | None = None    # E: shared MLP width (None = the MLP's width)
    # routed MoE (O; models/mixers_moe.py): WM's MoE and MoE-SEI, DeepSeek-V3, Jamba, Qwen3-Next, Kimi-Linear, ...
    moe_experts: int = 16                 # O: routed gated-MLP experts
    moe_topk: int = 2                     # O: experts per token
    moe_hidden: int | None = None         # O: width of each expert (None = the MLP's width)
    moe_shared: bool = False              # O: one always-on shared expert as well (MoE-SEI)
    moe_router: str = "softmax"           # O: softmax over the experts | sigmoid (independent scores, DeepSeek-V3)
    moe_norm_topk: bool = True            # O: renormalise the chosen experts' weights to sum to 1
    moe_router_bias: bool = False         # O: a per-expert bias (e_score_correction_bias) used only to choose experts
    moe_n_group: int = 1                  # O: expert groups; experts come from the moe_topk_group best groups
    moe_topk_group: int = 1
    moe_scale: float = 1.0                # O: routed_scaling_factor on the routed weights
    moe_shared_hidden: int | None = None  # O: width of the shared expert (None = the experts' width)
    moe_shared_gate: bool = False         # O: shared expert output × sigmoid(Linear(d, 1)(x)) (Qwen-MoE)
                                          # O's experts (and shared expert) follow mlp_act and mlp_gated
    # MLA (L), lightning-indexer sparse attention (I), hyper-connections (the Transformer tutorial 3.2-3.5, 5)
    mla_kv_lora_rank: int | None = None   # shared K/V latent; None = 4 · head_dim (DeepSeek-V3: 512 = 4 · 128)
    mla_q_lora_rank: int | None = None    # query latent; None = 3 · kv_lora_rank (V3: 1536); 0 = direct query proj.
    mla_qk_nope_dim: int | None = None    # per-head query/key part without RoPE; None = head_dim
    mla_rope_dim: int | None = None       # decoupled RoPE: per-head query part = shared key; None = head_dim // 2
    mla_v_dim: int | None = None          # per-head value dim; None = head_dim
    mla_rope_interleaved: bool = True     # DeepSeek rotates interleaved pairs (2i, 2i+1)
    mla_absorb: bool = True               # decode with W_uk / W_uv absorbed (attention in latent space)
    dsa_n_heads: int = 4                  # lightning-indexer heads (V3.2: 64)
    dsa_head_dim: int | None = None       # None = head_dim (V3.2: 128)
    dsa_rope_dim: int | None = None       # RoPE (half-split) on the first dims of index q/k; None = MLA rope dim
    dsa_topk: int = 2048                  # keys kept per query by the indexer
    dsa_attention: str = "L"              # attention under the indexer: L (MLA) or A (plain attention)
    dsa_kl_weight: float = 1.0            # weight of the indexer's KL to the main attention (its only training
                                          # signal; layers/indexer.py) in the training loss; 0 = indexer frozen
    hyper_connections: int | None = None  # n residual streams around every block; None = plain residual
    hc_manifold: bool = True              # mHC: sigmoid pre/post, doubly stochastic res (Sinkhorn); False = HC
    hc_dynamic: bool = True               # per-token dynamic mixing weights on top of the static ones
    hc_sinkhorn_iters: int = 20
    # Kimi Delta Attention (K) and Kimi-Linear (models/mixers_kda.py, hf/convert_kimi_linear.py); Kimi's MLA is
    # plain `L` with pos_embedding="none" (no rotation anywhere: the shared key part stays unrotated)
    kda_heads: int | None = None          # K: heads (None = n_heads)
    kda_head_dim: int | None = None       # K: key = value dim per head; state D × D per head (None = d_model // heads)
    kda_rank: int | None = None           # K: rank of the low-rank forget-gate and output-gate projections
                                          # (None = kda_head_dim, as released)
    # Gated DeltaNet (G, models/mixers_delta.py) and Qwen3-Next's gated attention
    gdn_k_heads: int | None = None        # G: query/key heads (None = n_heads)
    gdn_v_heads: int | None = None        # G: value heads, a multiple of gdn_k_heads (None = gdn_k_heads)
    gdn_k_dim: int | None = None          # G: query/key head dim (None = head_dim)
    gdn_v_dim: int | None = None          # G: value head dim (None = gdn_k_dim)
    gdn_chunk_size: int = 64              # G: chunk of the chunked delta rule (speed only)
    attn_output_gate: bool = False        # A: q projection also yields a per-channel gate, sigmoid(gate) ⊙ attention
                                          # output before the out projection (Qwen3-Next)
    # Mamba-1 selective scan (B): Mamba, Falcon-Mamba, Jamba (models/mixers_mamba1.py)
    mamba1_d_state: int = 16              # N: states per channel (A is [d_inner, N])
    mamba1_expand: int = 2                # d_inner = expand · d_model channels
    mamba1_dt_rank: int | None = None     # rank of the dt projection; None = ceil(d_model / 16)
    mamba1_conv_bias: bool = True         # bias on the conv
    mamba1_bias: bool = False             # biases on in_proj and out_proj
    mamba1_bcdt_norm: str = "none"        # RMSNorm on dt, B, C after x_proj: none | weight (Jamba) | plain (no
                                          # weight: Falcon-Mamba)
    mamba1_norm_eps: float | None = None  # eps of those norms; None = norm_eps
    mamba1_chunk_size: int = 64           # tokens per chunk of the scan (a chunk holds [B, L, d_inner, N] floats)
    # Mamba-2 hybrids: Bamba, Nemotron-H, Granite-4.0 (hf/convert_{bamba,nemotron_h,granitemoehybrid}.py)
    ssd_d_inner: int | None = None        # S: SSD width (heads × ssd_headdim) set directly; None = ssd_expand · d_model
                                          # (Nemotron-H's mamba_num_heads · mamba_head_dim is not a multiple of d)
    ssd_dt_limit: tuple[float, float] | None = None   # S: dt = softplus(·) clamped to [lo, hi] (transformers'
                                          # time_step_limit; Nemotron-H: (time_step_min, inf)); None = no clamp
    # Falcon-H1 and LFM2: options of S and the gated short convolution C (models/mixers_conv.py); the parallel
    # block {...} of the layout needs no field
    ssd_norm: str = "gated"               # S output: gated = RMSNorm(y·silu(z)) | norm_gate = RMSNorm(y)·silu(z) |
                                          # gate = y·silu(z) without a norm (Falcon-H1's mamba_rms_norm=False)
    conv_bias: bool = False               # C: biases on in_proj, the conv and out_proj (LFM2's conv_bias)
    # Zamba2 (Z: shared transformer over concat(stream, embeddings) feeding the next layer; models/mixers_zamba.py).
    # Z reads n_heads, n_kv_heads, head_dim (over the 2·d_model input), rope_base, pos_embedding, mlp_hidden/act/bias
    zamba_adapter_rank: int = 0           # Z: rank of the per-occurrence LoRA adapter on the MLP's gate/up (0 = none)
    zamba_attn_adapter: bool = False      # Z: per-occurrence LoRA adapters (same rank) on q, k and v as well
    layer_overrides: dict[int, dict] = field(default_factory=dict)

    def __post_init__(self):
        self.layer_overrides = {int(k): renamed(v, f"layer_overrides[{k}]") if isinstance(v, dict) else v
                                for k, v in self.layer_overrides.items()}
        self.ssd_A_init_range = tuple(self.ssd_A_init_range)
        if self.ssd_dt_limit is not None:
            self.ssd_dt_limit = tuple(float(v) for v in self.ssd_dt_limit)
        self.validate()
        warn_unread(self, stacklevel=3)          # __post_init__ <- __init__ <- the caller

    # derived sizes -------------------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def attn_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def mlp_hidden_size(self) -> int:
        if self.mlp_hidden:
            return self.mlp_hidden
        h = int(8 * self.d_model / 3) if self.mlp_gated else 4 * self.d_model
        return 64 * ((h + 63) // 64)

    def for_layer(self, idx: int) -> "ModelConfig":
        """This config with layer `idx`'s overrides applied (validated)."""
        over = self.layer_overrides.get(idx)
        if not over:
            return self
        check_fields(over, f"layer_overrides[{idx}]")
        with quiet_unread():       # the whole config has warned already
            return dataclasses.replace(self, **{**over, "layer_overrides": {}})

    def validate(self):
        from .layout import flatten, parse_layout, shared_groups
        from .registry import LETTERS, need
        need(self.vocab_size >= 1, f"vocab_size must be >= 1, got {self.vocab_size}")
        need(self.d_model >= 1, f"d_model must be >= 1, got {self.d_model}")
        need(self.max_seq_len >= 1, f"max_seq_len must be >= 1, got {self.max_seq_len}")
        need(self.norm in ("rms", "layer"), f"norm must be 'rms' or 'layer', got {self.norm!r}")
        need(self.pos_embedding in ("rope", "learned", "none"),
             f"pos_embedding must be rope|learned|none, got {self.pos_embedding!r}")
        items = parse_layout(self.layout, LETTERS.keys(), {k for k, v in LETTERS.items() if v.token})
        layers = flatten(items)
        n_letters = len(layers)
        for k in self.layer_overrides:
            need(0 <= k < n_letters, f"layer_overrides index {k} is outside the layout's {n_letters} layers")
        # each letter checks the options it reads, on the config each of its layers will see
        checked = set()
        for i, letter in enumerate(layers):
            key = (letter, i if i in self.layer_overrides else None)
            if key in checked:
                continue
            checked.add(key)
            LETTERS[letter].validate(self.for_layer(i))
        for letter in dict.fromkeys(str(x) for x in layers):   # whole-layout rules of the letters used
            if LETTERS[letter].check is not None:
                LETTERS[letter].check(self, items)
        for tag in shared_groups(items):                  # `X@k`: one set of parameters, so one layer config
            at = [i for i, l in enumerate(layers) if getattr(l, "tag", None) == tag]
            need(len({repr(self.layer_overrides.get(i)) for i in at}) == 1,
                 f"layer_overrides differ between layers {at}, which share parameters (@{tag})")
        for hook in CONFIG_CHECKS:
            hook(self, items)

    # serialisation --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def transformers_dict(self, **extra) -> dict:
        """config.json as transformers reads it (model_type "hybridlm", hf/modeling.py's HybridLMConfig): this config
        under "hybridlm", the few names transformers and other tools read mirrored from it, then `extra`
        (eos_token_id, dtype, ...). Pure JSON: writing it needs no transformers."""
        from .layout import flatten, parse_layout
        from .registry import LETTERS
        return {"architectures": ["HybridLMForCausalLM"], "model_type": "hybridlm", "vocab_size": self.vocab_size,
                "hidden_size": self.d_model, "num_hidden_layers": len(flatten(parse_layout(self.layout, LETTERS))),
                "max_position_embeddings": self.max_seq_len, "tie_word_embeddings": self.tie_embeddings,
                **extra, "hybridlm": self.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """From to_dict()'s output (config.json, checkpoints), old field names (RENAMED) included; silent about
        unread fields (`warn_unread`): they were set, and warned of, where the config was made."""
        d = renamed(d)
        check_fields(d)
        with quiet_unread():
            return cls(**d)

    def replace(self, **kw) -> "ModelConfig":
        kw = renamed(kw)
        check_fields(kw)
        with quiet_unread():
            cfg = dataclasses.replace(self, **kw)
        warn_unread(cfg, set(unread(cfg)) - set(unread(self)))      # only what this change leaves unread
        return cfg
