"""Channel mixers: plain MLP (GPT) and gated MLP (SwiGLU, Llama)."""
import torch.nn.functional as F
from torch import Tensor, nn

from .init import normal_

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
               "relu": F.relu, "relu2": lambda x: F.relu(x).square()}   # relu2: Primer / Nemotron-H


class MLP(nn.Module):
    """x [B, T, d] -> [B, T, d]. gated: down(act(gate(x)) * up(x)), with gate and up fused in one matmul;
    plain: down(act(up(x)))."""

    def __init__(self, d_model: int, hidden: int, *, act: str = "silu", gated: bool = True, bias: bool = False,
                 dropout: float = 0.0):
        super().__init__()
        self.gated, self.act, self.act_name = gated, ACTIVATIONS[act], act
        self.w_in = nn.Linear(d_model, (2 if gated else 1) * hidden, bias=bias)
        self.w_out = nn.Linear(hidden, d_model, bias=bias)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()

    def init_weights(self, std: float, out_std: float):
        """w_in N(0, std), w_out N(0, out_std) (it writes to the residual stream), zero biases."""
        normal_(std, self.w_in)
        normal_(out_std, self.w_out)

    def forward(self, x: Tensor) -> Tensor:
        h = self.w_in(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return self.drop(self.w_out(h))
