"""Cross-attention (the Transformer tutorial section 2.2, eq. 32-33): queries from the sequence being decoded,
keys and values from a given memory (an encoder's output, image or text embeddings). No causal mask: every
query sees every real memory position. Not a layout letter (a causal LM has no memory); use it in your own
decoder blocks, e.g. x = x + self_attn(ln1(x)); x = x + cross(ln2(x), memory); x = x + mlp(ln3(x)).
"""
from torch import Tensor, nn

from ..ops.attention import attention
from .init import normal_


class CrossAttention(nn.Module):
    """x [B, T, d_model], memory [B, S, d_memory] -> [B, T, d_model]. n_kv_heads < n_heads gives grouped heads."""

    def __init__(self, d_model: int, n_heads: int, *, d_memory: int | None = None, n_kv_heads: int | None = None,
                 head_dim: int | None = None, bias: bool = False, dropout: float = 0.0):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads or n_heads
        self.head_dim = head_dim or d_model // n_heads
        self.q = nn.Linear(d_model, n_heads * self.head_dim, bias=bias)
        self.kv = nn.Linear(d_memory or d_model, 2 * self.n_kv_heads * self.head_dim, bias=bias)
        self.out = nn.Linear(n_heads * self.head_dim, d_model, bias=bias)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()

    def init_weights(self, std: float, out_std: float):
        """q and kv N(0, std), out N(0, out_std), zero biases."""
        normal_(std, self.q, self.kv)
        normal_(out_std, self.out)

    def memory_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values [B, S, Hk, D] of a memory: compute once, reuse at every decoding step."""
        B, S, _ = memory.shape
        k, v = self.kv(memory).view(B, S, 2, self.n_kv_heads, self.head_dim).unbind(2)
        return k, v

    def forward(self, x: Tensor, memory: Tensor | tuple[Tensor, Tensor], memory_mask: Tensor | None = None) -> Tensor:
        """memory: [B, S, d_memory] or a precomputed `memory_kv(...)`; memory_mask [B, S] bool, True = real."""
        B, T, _ = x.shape
        k, v = memory if isinstance(memory, tuple) else self.memory_kv(memory)
        q = self.q(x).view(B, T, self.n_heads, self.head_dim)
        y = attention(q, k, v, causal=False, key_mask=memory_mask)
        return self.drop(self.out(y.reshape(B, T, self.n_heads * self.head_dim)))
