"""`R` in vLLM: hybridlm's own Rodimus layer (layers/rodimus.py) as a vLLM `MambaBase` layer with a state of its own.

vLLM has no Rodimus (DDTS gated linear attention in a GLU), so the layer is ours, parameter for parameter, and only
its state moves: vLLM's KV cache manager holds, per request, the short-conv tail [d_conv - 1, m] (model dtype) and
the GLA state [1, n, m] (float32), in pages it allocates, frees, and copies for prefix caching (a state is a
snapshot: copied whole). Each step the layer gathers the rows of the requests in the batch into a `RecurrentCache`,
runs our forward on them (decodes as one batch of one-token steps; each prefill, or prefill chunk, with its
initial state when it continues one) and scatters the new states back. So vLLM's continuous batching, chunked
prefill and prefix caching run our exact arithmetic.

The layer is replicated under tensor parallelism (its one head reads all m channels): every rank computes it whole.
It runs behind a custom op (`torch.ops.vllm.hybridlm_rodimus`) so that torch.compile leaves it as one opaque call,
and its metadata is vLLM's common mamba metadata (state slots, query offsets, which prefills carry a state), built
by `RodimusMetadataBuilder` for the backend the plugin registers as MambaAttentionBackendEnum.HYBRIDLM_RODIMUS.
"""
from dataclasses import dataclass

import torch
from torch import Tensor
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.attention.backends.mamba_attn import BaseMambaAttentionMetadata, BaseMambaAttentionMetadataBuilder
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from ..cache import RecurrentCache
from ..context import SeqContext
from ..layers.rodimus import Rodimus

BACKEND = "HYBRIDLM_RODIMUS"     # its MambaAttentionBackendEnum member (registered by the plugin, __init__.py)


@dataclass
class RodimusMetadata(BaseMambaAttentionMetadata):
    pass


class RodimusMetadataBuilder(BaseMambaAttentionMetadataBuilder[RodimusMetadata]):
    metadata_cls = RodimusMetadata
    needs_causal_conv1d_metadata = False       # the conv is ours (ops/conv.py)


class RodimusBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return BACKEND

    @staticmethod
    def get_builder_cls() -> type[RodimusMetadataBuilder]:
        return RodimusMetadataBuilder

    @classmethod
    def is_ssm(cls) -> bool:
        return True


def state_shapes(d_conv: int, m: int, n: int) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """(conv tail [d_conv - 1, m], GLA state [1, n, m]) of one request."""
    return (d_conv - 1, m), (1, n, m)


class _Slot:
    """The one-slot cache our layer's forward reads and writes (`cache.layer(idx, factory)`)."""

    def __init__(self, slot: RecurrentCache):
        self.slot = slot

    def layer(self, idx: int, factory) -> RecurrentCache:
        return self.slot


class VLLMRodimus(Rodimus, MambaBase):
    """Rodimus (same parameters and names) whose state lives in vLLM's cache. x [N, d] (the batch's tokens, decodes
    first, then prefills) -> [N, d] written into `output`."""

    def __init__(self, *args, prefix: str, model_dtype: torch.dtype, **kwargs):
        super().__init__(*args, **kwargs)
        self.prefix, self.model_dtype = prefix, model_dtype
        ctx = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"duplicate layer name {prefix}")
        ctx[prefix] = self
        self.kv_cache = (torch.tensor([]), torch.tensor([]))
        self.d_conv = self.conv.kernel

    # --- MambaBase ---------------------------------------------------------------------------------------
    def get_state_shape(self):
        return state_shapes(self.d_conv, self.d_inner, self.d_state)

    def get_state_dtype(self) -> tuple[torch.dtype, torch.dtype]:
        return self.model_dtype, torch.float32

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum[BACKEND]

    @property
    def is_kv_cache_tp_replicated(self) -> bool:
        return True

    # --- forward -----------------------------------------------------------------------------------------
    def serve(self, x: Tensor, output: Tensor):
        torch.ops.vllm.hybridlm_rodimus(x, output, self.prefix)

    def _run(self, x: Tensor, conv: Tensor | None, state: Tensor | None) -> tuple[Tensor, RecurrentCache]:
        """Our forward on x [B, T, d] from (conv [B, K-1, m], state [B, 1, n, m]) or from zeros (None)."""
        slot = RecurrentCache()
        slot.conv, slot.state = conv, state
        ctx = SeqContext(positions=torch.zeros(x.shape[:2], dtype=torch.long, device=x.device))
        return Rodimus.forward(self, x, ctx=ctx, cache=_Slot(slot)), slot

    def forward_batch(self, x: Tensor, output: Tensor):
        meta = get_forward_context().attn_metadata
        meta = meta.get(self.prefix) if isinstance(meta, dict) else None
        if meta is None:                  # vLLM's profiling run: no states, the output only has to have its shape
            output[: x.shape[0]] = self._run(x[None], None, None)[0][0]
            return
        conv_cache, state_cache = self.kv_cache
        nd, npt = meta.num_decode_tokens, meta.num_prefill_tokens
        if nd:
            rows = meta.state_indices_tensor_d[:, 0].long()
            y, slot = self._run(x[:nd, None], conv_cache[rows], state_cache[rows])
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
                y, slot = self._run(x[None, a:b], conv, state)
                conv_cache[row], state_cache[row] = slot.conv[0].to(conv_cache.dtype), slot.state[0]
                output[a:b] = y[0]


def hybridlm_rodimus(x: Tensor, output: Tensor, layer_name: str) -> None:
    get_forward_context().no_compile_layers[layer_name].forward_batch(x, output)


direct_register_custom_op(op_name="hybridlm_rodimus", op_func=hybridlm_rodimus, mutates_args=["output"])
