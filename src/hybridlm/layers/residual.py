"""Residual schemes that wrap one mixer. A block exposes `branch(x)` (what it adds) and `forward(x)`
(the new residual stream), so stream-level schemes (hyper-connections) can reuse the branch."""
import torch
from torch import Tensor, nn

from . import cpu_steps
from .init import reset_


def mix(mixer: nn.Module, h: Tensor, ctx, cache, token: bool = True) -> Tensor:
    """A mixer's output for its normed input h: on a CPU decode step (`ctx.cpu_steps`) its whole step in one C++ call
    where layers/cpu_steps.py has one that covers it, else the mixer itself (a token mixer with ctx and cache)."""
    if ctx is not None and ctx.cpu_steps:
        y = cpu_steps.step(mixer, h, ctx, cache)
        if y is not None:
            return y
    return mixer(h, ctx=ctx, cache=cache) if token else mixer(h)


class Residual(nn.Module):
    """Pre-norm residual x + mixer(norm(x)); with `learnable_scale`, Doge's per-channel residual weight
    w ⊙ x + mixer(norm(x)) (w initialised to ones)."""

    def __init__(self, norm: nn.Module, mixer: nn.Module, token: bool, d_model: int, learnable_scale: bool = False):
        super().__init__()
        self.norm, self.mixer, self.token = norm, mixer, token
        self.res_weight = nn.Parameter(torch.empty(d_model)) if learnable_scale else None

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float):
        """The norm 1, the mixer by its own rules, the residual weight 1."""
        reset_(self.norm)
        for m in (self.mixer if isinstance(self.mixer, nn.ModuleList) else [self.mixer]):
            m.init_weights(std, out_std)
        if self.res_weight is not None:
            self.res_weight.fill_(1.0)

    def branch(self, x: Tensor, ctx, cache) -> Tensor:
        return mix(self.mixer, self.norm(x), ctx, cache, self.token)

    def forward(self, x: Tensor, ctx, cache) -> Tensor:
        skip = x if self.res_weight is None else x * self.res_weight
        return skip + self.branch(x, ctx, cache)


class ParallelResidual(Residual):
    """A parallel block `{...}` (Falcon-H1): x + sum_i mixer_i(norm(x)), every token mixer reading the same normed
    input (each keeps its own cache slot)."""

    def __init__(self, norm: nn.Module, mixers: list[nn.Module], d_model: int, learnable_scale: bool = False):
        super().__init__(norm, nn.ModuleList(mixers), True, d_model, learnable_scale)

    def branch(self, x: Tensor, ctx, cache) -> Tensor:
        h = self.norm(x)
        out = None
        for m in self.mixer:
            y = mix(m, h, ctx, cache)
            out = y if out is None else out + y
        return out


class TwoHopResidual(nn.Module):
    """Rodimus++ block (the Rodimus* paper, eq. 13) on one stream, as in the released code:
        h = mixer(norm1(x)); r = x + h; a = attn(norm2(r)); x_out = r + ffn(norm3(a + r))
    The attention output reaches the stream only through the channel mixer, which binds the two
    (the "two hops" skip the attention). Mixers: a token mixer, an attention-like token mixer, a channel
    mixer; each gets its own norm."""

    def __init__(self, norms: list[nn.Module], mixer: nn.Module, attn: nn.Module, ffn: nn.Module):
        super().__init__()
        self.norm1, self.norm2, self.norm3 = norms
        self.mixer, self.attn, self.ffn = mixer, attn, ffn

    def init_weights(self, std: float, out_std: float):
        reset_(self.norm1, self.norm2, self.norm3)
        for m in (self.mixer, self.attn, self.ffn):
            m.init_weights(std, out_std)

    def _hops(self, x: Tensor, ctx, cache) -> tuple[Tensor, Tensor, Tensor]:
        h = mix(self.mixer, self.norm1(x), ctx, cache)
        r = x + h
        a = mix(self.attn, self.norm2(r), ctx, cache)
        return h, r, mix(self.ffn, self.norm3(a + r), ctx, cache, token=False)

    def branch(self, x: Tensor, ctx, cache) -> Tensor:
        h, _, f = self._hops(x, ctx, cache)
        return h + f

    def forward(self, x: Tensor, ctx, cache) -> Tensor:
        _, r, f = self._hops(x, ctx, cache)
        return r + f


class Fed(nn.Module):
    """A block whose branch input also receives another block's output (Zamba2's hybrid layer: the shared
    transformer's output is added to the next Mamba layer's input, not to the stream):
        out = x + block.branch(x + feed(x))
    `feed` is a token module `feed(x, ctx, cache) -> [B, T, d]` with its own layer index; `block` a Residual."""

    def __init__(self, feed: nn.Module, block: nn.Module):
        super().__init__()
        self.feed, self.block = feed, block

    def init_weights(self, std: float, out_std: float):
        self.feed.init_weights(std, out_std)
        self.block.init_weights(std, out_std)

    def branch(self, x: Tensor, ctx, cache) -> Tensor:
        return self.block.branch(x + self.feed(x, ctx, cache), ctx, cache)

    def forward(self, x: Tensor, ctx, cache) -> Tensor:
        w = getattr(self.block, "res_weight", None)
        return (x if w is None else x * w) + self.branch(x, ctx, cache)
