"""Routed top-k mixture of MLP experts (Switch / Mixtral / DeepSeek style), optionally with an always-on shared
expert (MoE-SEI, as compared in the Wonderful Matrices paper, table 3), and a load-balancing auxiliary loss.

Dropless: every (token, expert) pair is computed, so a token's output depends on that token only. Training (and any
call with many rows) runs all experts as one batched matmul over expert-sorted rows (hybridlm.ops.moe.routed_experts);
a CPU decode step (at most `cpu_kernels.DECODE_ROWS` rows, no gradient) and quantized experts compute only the experts
the tokens chose, one at a time (ops.moe.routed_experts_selected): a token reads k of the E experts' weights, through
the project's CPU matrix-vector kernels. The router is a softmax or sigmoid one (`ops.moe.route_topk`: correction
bias, group-limited choice, renormalisation, scaling), which covers the public MoE hybrids (Jamba, Granite-4.0,
Qwen3-Next, Kimi-Linear, Nemotron-H, DeepSeek-V3).
x [B, T, d] -> [B, T, d]; `aux_loss` holds this forward's load-balancing loss (0 for a uniform router).

Expert weights: w_gate, w_up [E, d, f] and w_down [E, f, d] (x @ w[e]), Parameters; `models.quantize.quantize_`
swaps each for a `layers.quantized.QuantizedExperts` (int8 / int4 per expert) under the same name.
"""
import torch
from torch import Tensor, nn

from ..ops import cpu_kernels
from ..ops.moe import float_experts, load_balancing_loss, route_topk, routed_experts, routed_experts_selected
from .init import normal_
from .mlp import ACTIVATIONS, MLP


class RoutedMoE(nn.Module):
    EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")     # the stacked [E, d_in, d_out] weights (quantize_ reads this)

    def __init__(self, d_model: int, hidden: int, *, num_experts: int, top_k: int, shared_expert: bool = False,
                 init_std: float = 0.02, act: str = "silu", gated: bool = True, router: str = "softmax",
                 norm_topk: bool = True, router_bias: bool = False, n_group: int = 1, topk_group: int = 1,
                 scale: float = 1.0, shared_hidden: int | None = None, shared_gate: bool = False):
        super().__init__()
        self.num_experts, self.top_k, self.act, self.init_std = num_experts, top_k, ACTIVATIONS[act], init_std
        self.act_name = act
        self.route = dict(norm_topk=norm_topk, score=router, n_group=n_group, topk_group=topk_group, scale=scale)
        self.router = nn.Linear(d_model, num_experts, bias=False)
        # DeepSeek's e_score_correction_bias: steered by load statistics, not by gradients
        self.register_buffer("router_bias", torch.empty(num_experts) if router_bias else None)
        self.w_gate = nn.Parameter(torch.empty(num_experts, d_model, hidden)) if gated else None
        self.w_up = nn.Parameter(torch.empty(num_experts, d_model, hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, d_model))
        self.shared = MLP(d_model, shared_hidden or hidden, act=act, gated=gated) if shared_expert else None
        self.shared_gate = nn.Linear(d_model, 1, bias=False) if shared_expert and shared_gate else None
        self.aux_loss: Tensor | None = None
        self.register_state_dict_pre_hook(_stored_layout)

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float):
        """Router and shared gate N(0, std), experts N(0, init_std), the shared expert by its rules, bias 0."""
        normal_(std, self.router, self.shared_gate)
        for w in (self.w_gate, self.w_up, self.w_down):
            if w is not None:
                nn.init.normal_(w, 0.0, self.init_std)
        if self.shared is not None:
            self.shared.init_weights(std, out_std)
        if self.router_bias is not None:
            self.router_bias.zero_()

    def _float_weights(self) -> list[nn.Parameter]:
        return [w for w in (self.w_gate, self.w_up, self.w_down) if isinstance(w, nn.Parameter)]

    def kernel_layout_(self, on: bool = True):
        """Store each float expert weight transposed in memory (w[e] then is the transpose of a contiguous
        [d_out, d_in] matrix, the CPU kernels' layout: `ops.moe.float_experts`), or back (on=False). The values, shapes,
        Parameters and state dict stay the same; only CPU tensors move. A training forward puts the layout back first,
        so the batched matmul reads what it always read (the same gradients, bit for bit), and so does `state_dict`
        (contiguous tensors, as safetensors needs them)."""
        with torch.inference_mode(False), torch.no_grad():     # normal tensors, even when called while decoding
            for w in self._float_weights():
                if on and w.device.type == "cpu" and type(w.data) is Tensor and w.is_contiguous():
                    w.data = w.data.mT.contiguous().mT
                    w._kernel_layout = True
                elif not on and getattr(w, "_kernel_layout", False):
                    w.data = w.data.contiguous()
                    w._kernel_layout = False

    def _selected(self, x: Tensor) -> bool:
        """Compute only the chosen experts: always for quantized ones; for float ones on a CPU decode step without
        gradient (training and long inputs keep the batched matmul; torch.compile too: its loop is data-dependent)."""
        if not isinstance(self.w_up, nn.Parameter):
            return True
        return (x.device.type == "cpu" and cpu_kernels.decode_sized(x) and not torch.compiler.is_compiling()
                and not (torch.is_grad_enabled() and self.w_up.requires_grad))

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids, probs = route_topk(self.router(x), self.top_k, bias=self.router_bias, **self.route)
        self.aux_loss = load_balancing_loss(probs, ids, self.num_experts)
        if self._selected(x):
            gate, up, down = (None if w is None else float_experts(w) if isinstance(w, nn.Parameter) else w.expert
                              for w in (self.w_gate, self.w_up, self.w_down))
            y = routed_experts_selected(x, ids, weights, up, down, gate, act=self.act)
        else:
            if torch.is_grad_enabled() and any(getattr(w, "_kernel_layout", False) for w in self._float_weights()):
                self.kernel_layout_(False)      # training after decoding: the layout it trained with
            y = routed_experts(x, self.w_gate, self.w_up, self.w_down, ids, weights, act=self.act)
        if self.shared is not None:
            s = self.shared(x)
            y = y + (s if self.shared_gate is None else torch.sigmoid(self.shared_gate(x)) * s)
        return y.view(shape)


def _stored_layout(module: RoutedMoE, prefix: str, keep_vars: bool):
    """state_dict pre-hook: the experts back in their stored layout (see RoutedMoE.kernel_layout_)."""
    module.kernel_layout_(False)
