"""Channel mixers: plain MLP (GPT) and gated MLP (SwiGLU, Llama)."""
import torch.nn.functional as F
from torch import Tensor, nn

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
               "relu": F.relu, "relu2": lambda x: F.relu(x).square()}   # relu2: Primer / Nemotron-H


class MLP(nn.Module):
    """x [B, T, d] -> [B, T, d]. gated: down(act(gate(x)) * up(x)), with gate and up fused in one matmul;
    plain: down(act(up(x)))."""

    def __init__(self, d_model: int, hidden: int, *, act: str = "silu", gated: bool = True, bias: bool = False,
                 dropout: float = 0.0):
        super().__init__()
        self.gated, self.act = gated, ACTIVATIONS[act]
        self.w_in = nn.Linear(d_model, (2 if gated else 1) * hidden, bias=bias)
        self.w_out = nn.Linear(hidden, d_model, bias=bias)
        self.w_out._is_residual_out = True
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        h = self.w_in(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return self.drop(self.w_out(h))
