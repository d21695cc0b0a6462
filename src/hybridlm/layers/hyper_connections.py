"""Hyper-connections: n residual streams instead of one (the Transformer tutorial section 5, eq. 88-103).

Streams X [B, T, n, d]. Around each block F (pre-norm + mixer, via the block's `branch`):
    x_in = sum_j pre_j X_j                       (eq. 90: collapse the streams into the block's input)
    X'_i = sum_j res_ij X_j + post_i F(x_in)     (eq. 94-97: mix the streams, expand the block's output)
pre [n], post [n] and res [n, n] are a static learned part plus a dynamic part computed per token from the
RMS-normalised flattening of the streams (so decoding stays exact: nothing mixes across time).

manifold=True (mHC): pre = sigmoid(.) + eps, post = 2 sigmoid(.), and res is projected onto the doubly stochastic
  matrices by Sinkhorn-Knopp (section 5.2): products of such matrices stay doubly stochastic, so the residual path
  through depth neither explodes nor vanishes. A fixed number of iterations (DeepSeek: 20) is exact to ~1e-6 for
  moderate logits (std <= 0.5) but converges slowly for peaked ones (std 2: ~500 iterations); raise
  `sinkhorn_iters` if trained mixing logits grow large.
manifold=False (the original hyper-connections): the raw weights, initialised to pre = one-hot stream
  (layer index mod n), post = 1, res = identity, with tanh dynamic terms whose projection starts at 0. With n=1
  this init is exactly the plain residual x + F(x).
`HyperHead` turns the model input into n copies and collapses the streams again before the final norm.
"""
import torch
from torch import Tensor, nn

from ..ops.norm import rms_norm
from ..ops.sinkhorn import sinkhorn_knopp


class _Mixing(nn.Module):
    """k weights per token from the streams: static + scale ⊙ dynamic, the dynamic part being
    RMSNorm(flatten(X)) @ Wᵀ. X [B, T, n, d] -> [B, T, k] float32 (before the activation)."""

    def __init__(self, n: int, d: int, k: int, groups: list[int], *, dynamic: bool, proj_std: float,
                 scale_init: float):
        super().__init__()
        self.groups, self.proj_std, self.scale_init = groups, proj_std, scale_init
        self.static = nn.Parameter(torch.empty(k))
        self.proj = nn.Parameter(torch.empty(k, n * d)) if dynamic else None
        self.scale = nn.Parameter(torch.empty(len(groups))) if dynamic else None

    @torch.no_grad()
    def reset_parameters(self, static: Tensor):
        """static [k]: the static part's initial value (the owner's rule)."""
        self.static.copy_(static)
        if self.proj is not None:
            nn.init.normal_(self.proj, 0.0, self.proj_std)
            self.scale.fill_(self.scale_init)

    def forward(self, X: Tensor, squash=None) -> Tensor:
        if self.proj is None:
            return self.static.expand(*X.shape[:2], -1)
        dyn = rms_norm(X.flatten(2).float(), None) @ self.proj.float().t()
        if squash is not None:
            dyn = squash(dyn)
        scale = torch.cat([s.expand(g) for s, g in zip(self.scale.float(), self.groups)])
        return self.static + scale * dyn


class HyperConnection(nn.Module):
    """Streams X [B, T, n, d] -> [B, T, n, d] around `block` (which exposes branch(x, ctx, cache) -> [B, T, d])."""

    def __init__(self, block: nn.Module, n: int, d_model: int, *, layer_idx: int, manifold: bool = True,
                 dynamic: bool = True, sinkhorn_iters: int = 20, eps: float = 1e-6, init_std: float = 0.02):
        super().__init__()
        self.block, self.n, self.manifold, self.iters, self.eps = block, n, manifold, sinkhorn_iters, eps
        self.layer_idx = layer_idx
        # manifold: static logits 0 (pre = 1/2, post = 1, res = uniform), dynamic part gated by 1e-2 at init;
        # else (Zhu et al.): one-hot pre, unit post, identity res, dynamic projection starting at 0
        self.mix = _Mixing(n, d_model, 2 * n + n * n, [n, n, n * n], dynamic=dynamic,
                           proj_std=init_std if manifold else 0.0, scale_init=0.01)
        self.last_res: Tensor | None = None   # res of the latest call, kept for inspection (doubly stochastic)

    def init_weights(self, std: float, out_std: float):
        n, dev = self.n, self.mix.static.device
        if self.manifold:
            static = torch.zeros(2 * n + n * n, device=dev)
        else:
            pre = torch.nn.functional.one_hot(torch.tensor(self.layer_idx % n, device=dev), n).float()
            static = torch.cat((pre, torch.ones(n, device=dev), torch.eye(n, device=dev).flatten()))
        self.mix.reset_parameters(static)
        self.block.init_weights(std, out_std)

    def weights(self, X: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """pre [B, T, n], post [B, T, n], res [B, T, n, n] in float32."""
        n = self.n
        raw = self.mix(X, squash=None if self.manifold else torch.tanh)
        pre, post, res = raw.split((n, n, n * n), dim=-1)
        res = res.unflatten(-1, (n, n))
        if self.manifold:
            pre, post = torch.sigmoid(pre) + self.eps, 2 * torch.sigmoid(post)
            res = sinkhorn_knopp(res, self.iters, self.eps)
        return pre, post, res

    def forward(self, X: Tensor, ctx, cache) -> Tensor:
        pre, post, res = (w.to(X.dtype) for w in self.weights(X))
        self.last_res = res.detach()
        y = self.block.branch(torch.einsum("btn,btnd->btd", pre, X), ctx, cache)
        return torch.einsum("btij,btjd->btid", res, X) + post.unsqueeze(-1) * y.unsqueeze(2)


class HyperHead(nn.Module):
    """expand: x [B, T, d] -> n copies [B, T, n, d]; forward: collapse [B, T, n, d] -> [B, T, d] with per-token
    weights (sigmoid + eps for mHC; a static sum, initialised to ones, for the original form)."""

    def __init__(self, n: int, d_model: int, *, manifold: bool = True, eps: float = 1e-6, init_std: float = 0.02):
        super().__init__()
        self.n, self.manifold, self.eps = n, manifold, eps
        self.mix = _Mixing(n, d_model, n, [n], dynamic=manifold, proj_std=init_std, scale_init=1.0)

    def init_weights(self, std: float, out_std: float):
        self.mix.reset_parameters(torch.full((self.n,), 0.0 if self.manifold else 1.0, device=self.mix.static.device))

    def expand(self, x: Tensor) -> Tensor:
        return x.unsqueeze(2).expand(-1, -1, self.n, -1)

    def forward(self, X: Tensor) -> Tensor:
        w = self.mix(X)
        if self.manifold:
            w = torch.sigmoid(w) + self.eps
        return torch.einsum("btn,btnd->btd", w.to(X.dtype), X)


def hyper_connect(blocks: list, n: int, d_model: int, **options) -> tuple[list, HyperHead]:
    """Wrap every block (each must expose `branch`) in a HyperConnection; return them and the stream head.
    `options`: manifold, dynamic, sinkhorn_iters, eps, init_std."""
    from ..errors import ConfigError
    for b in blocks:
        if not hasattr(b, "branch"):
            raise ConfigError(f"hyper_connections need blocks exposing branch(x, ctx, cache); "
                              f"{type(b).__name__} does not")
    head_opts = {k: v for k, v in options.items() if k in ("manifold", "eps", "init_std")}
    wrapped = [HyperConnection(b, n, d_model, layer_idx=i, **options) for i, b in enumerate(blocks)]
    return wrapped, HyperHead(n, d_model, **head_opts)
