"""hybridlm's own recurrent layers (R, G, K, B) with their state in vLLM's cache.

Where vLLM has no layer for a letter (Rodimus), or its kernel cannot run what the run has (vLLM's CPU build: its
Gated DeltaNet is bf16-only with head dims 64 / 128, its KDA is Triton-only, its Mamba-1 prefill is CUDA-only), the
layer is ours, parameter for parameter, and only its state moves: every hybridlm recurrent layer keeps a
`RecurrentCache(conv, state)` (short-conv tail in the model dtype, recurrent state in float32), and vLLM's KV cache
manager holds those two tensors per request, in pages it allocates, frees, and copies for prefix caching (a state is
a snapshot: copied whole). Each step `RecurrentState` gathers the rows of the requests in the batch into a
`RecurrentCache`, runs our forward on them (decodes as one batch of one-token steps; each prefill, or prefill chunk,
from its state when it continues one) and scatters the new states back. So vLLM's continuous batching, chunked
prefill and prefix caching run our exact arithmetic.

The shapes of a layer's state are read off the layer itself (one two-token forward at load: whatever the layer
keeps is what vLLM allocates). The layers are replicated under tensor parallelism (every rank computes them whole).
They run behind one custom op (`torch.ops.vllm.hybridlm_recurrent`) so that torch.compile leaves them as one opaque
call; the metadata is vLLM's common mamba metadata (state slots, query offsets, which prefills carry a state), built
by `RecurrentMetadataBuilder` for the backend the plugin registers as MambaAttentionBackendEnum.HYBRIDLM_RECURRENT.
"""
from dataclasses import dataclass
from functools import lru_cache

import json

import torch
from torch import Tensor, nn
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.attention.backends.mamba_attn import BaseMambaAttentionMetadata, BaseMambaAttentionMetadataBuilder
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from ..cache import RecurrentCache
from ..context import SeqContext
from ..models.config import ModelConfig
from ..models.registry import LETTERS

BACKEND = "HYBRIDLM_RECURRENT"     # its MambaAttentionBackendEnum member (registered by the plugin, __init__.py)


@dataclass
class RecurrentMetadata(BaseMambaAttentionMetadata):
    pass


class RecurrentMetadataBuilder(BaseMambaAttentionMetadataBuilder[RecurrentMetadata]):
    metadata_cls = RecurrentMetadata
    needs_causal_conv1d_metadata = False       # the convs are ours (ops/conv.py)


class RecurrentBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return BACKEND

    @staticmethod
    def get_builder_cls() -> type[RecurrentMetadataBuilder]:
        return RecurrentMetadataBuilder

    @classmethod
    def is_ssm(cls) -> bool:
        return True


class _Slot:
    """The one-slot cache our layer's forward reads and writes (`cache.layer(idx, factory)`)."""

    def __init__(self, slot: RecurrentCache):
        self.slot = slot

    def layer(self, idx: int, factory) -> RecurrentCache:
        return self.slot


def run(mixer: nn.Module, x: Tensor, positions: Tensor, conv: Tensor | None,
        state: Tensor | None) -> tuple[Tensor, RecurrentCache]:
    """Our token mixer on x [B, T, d] at positions [B, T] from (conv, state) [B, ...] or from zeros (None)."""
    slot = RecurrentCache()
    slot.conv, slot.state = conv, state
    return mixer(x, ctx=SeqContext(positions=positions), cache=_Slot(slot)), slot


@lru_cache(maxsize=64)
def _shapes(letter: str, cfg_json: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    cfg = ModelConfig.from_dict(json.loads(cfg_json))
    with torch.device("cpu"), torch.random.fork_rng(devices=[]):      # vLLM's process keeps its own random state
        torch.manual_seed(0)
        mixer = LETTERS[letter].build(cfg, 0).float().eval()
        x = torch.zeros(1, 2, cfg.d_model, dtype=torch.float32)    # vLLM's model dtype is torch's default here
        with torch.no_grad():
            _, slot = run(mixer, x, torch.arange(2)[None], None, None)
    if slot.conv is None or slot.state is None:
        raise AssertionError(f"letter {letter} keeps no (conv, state) pair: not a recurrent layer")
    return tuple(slot.conv.shape[1:]), tuple(slot.state.shape[1:])


def state_shapes(letter: str, cfg: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(conv tail, state) shapes of one request of layer `letter` built from `cfg`, read off the layer."""
    return _shapes(letter, cfg.to_json())


class RecurrentState(nn.Module, MambaBase):
    """vLLM's handle on one of our recurrent layers: it owns no parameters (the mixer stays where the decoder layer
    keeps it, under its own names), only the layer's place in vLLM's cache. x [N, d] (the batch's tokens, decodes
    first, then prefills), positions [N] -> [N, d] written into `output`."""

    def __init__(self, mixer: nn.Module, letter: str, cfg: ModelConfig, prefix: str, model_dtype: torch.dtype):
        super().__init__()
        object.__setattr__(self, "mixer", mixer)       # a reference, not a submodule: its weights load by name
        self.prefix, self.model_dtype = prefix, model_dtype
        self.shapes = state_shapes(letter, cfg)
        ctx = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"duplicate layer name {prefix}")
        ctx[prefix] = self
        self.kv_cache = (torch.tensor([]), torch.tensor([]))

    # --- MambaBase ---------------------------------------------------------------------------------------
    def get_state_shape(self):
        return self.shapes

    def get_state_dtype(self) -> tuple[torch.dtype, torch.dtype]:
        return self.model_dtype, torch.float32

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum[BACKEND]

    @property
    def is_kv_cache_tp_replicated(self) -> bool:
        return True

    # --- forward -----------------------------------------------------------------------------------------
    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        out = torch.empty_like(x)
        torch.ops.vllm.hybridlm_recurrent(x, positions, out, self.prefix)
        return out

    def forward_batch(self, x: Tensor, positions: Tensor, output: Tensor):
        meta = get_forward_context().attn_metadata
        meta = meta.get(self.prefix) if isinstance(meta, dict) else None
        if meta is None:                  # vLLM's profiling run: no states, the output only has to have its shape
            output[: x.shape[0]] = run(self.mixer, x[None], positions[None], None, None)[0][0]
            return
        conv_cache, state_cache = self.kv_cache
        nd, npt = meta.num_decode_tokens, meta.num_prefill_tokens
        if nd:
            rows = meta.state_indices_tensor_d[:, 0].long()
            y, slot = run(self.mixer, x[:nd, None], positions[:nd, None], conv_cache[rows], state_cache[rows])
            conv_cache[rows], state_cache[rows] = slot.conv.to(conv_cache.dtype), slot.state
            output[:nd] = y[:, 0]
        if npt:
            starts = (meta.query_start_loc_p + nd).tolist()
            rows = meta.state_indices_tensor_p.tolist()
            carry = meta.has_initial_states_p.tolist()
            for i, row in enumerate(rows):
                a, b = starts[i], starts[i + 1]
                conv = conv_cache[row][None] if carry[i] else None
                state = state_cache[row][None] if carry[i] else None
                y, slot = run(self.mixer, x[None, a:b], positions[None, a:b], conv, state)
                conv_cache[row], state_cache[row] = slot.conv[0].to(conv_cache.dtype), slot.state[0]
                output[a:b] = y[0]


def hybridlm_recurrent(x: Tensor, positions: Tensor, output: Tensor, layer_name: str) -> None:
    get_forward_context().no_compile_layers[layer_name].forward_batch(x, positions, output)


direct_register_custom_op(op_name="hybridlm_recurrent", op_func=hybridlm_recurrent, mutates_args=["output"])
