"""Size a model to a parameter budget or a depth, so that rows of a comparison are the same size.

    cfg, n = fit_params(lambda d: presets.get("mamba2", d_model=d), 2_000_000, candidates=range(32, 1025, 32))
    n = depth_for_mixers(lambda n: presets.get("cheems", n_layers=n), 16)   # repeats giving >= 16 mixer layers

Parameters are counted on the meta device (no memory, milliseconds per model). "Active" parameters count
what one token uses: a routed MoE contributes its router, shared expert and top_k of its experts; CDMoE its
shared MLP, retrieval and the top_k · heads private neurons it reads.
"""
from typing import Callable, Iterable

import torch

from ..errors import ConfigError
from .config import ModelConfig
from .layout import flatten, parse_layout


def parse_count(value) -> int:
    """2_000_000, "2M", "500K", "1.5e6" -> int."""
    if isinstance(value, bool):
        raise ConfigError(f"expected a parameter count such as 2M, got {value!r}")
    if isinstance(value, (int, float)):
        return int(value)
    text = str(value).strip().upper().replace("_", "")
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9}.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if scale != 1 else text) * scale)
    except ValueError:
        raise ConfigError(f"expected a parameter count such as 2M or 500K, got {value!r}") from None


def count_parameters(cfg: ModelConfig, active: bool = False) -> int:
    """Total (or active per token) parameters of CausalLM(cfg), built on the meta device."""
    from .causal_lm import CausalLM
    with torch.device("meta"):
        model = CausalLM(cfg)
    return active_parameters(model) if active else model.num_parameters()


def active_parameters(model) -> int:
    """Parameters one token uses: all of them minus the experts a token does not reach."""
    from ..layers.cdmoe import CDMoE
    from ..layers.routed_moe import RoutedMoE
    n = model.num_parameters()
    for m in model.modules():
        if isinstance(m, RoutedMoE):
            per_expert = sum(w.numel() for w in (m.w_gate, m.w_up, m.w_down) if w is not None) // m.num_experts
            n -= (m.num_experts - m.top_k) * per_expert
        elif isinstance(m, CDMoE):
            experts, d = m.down_embed.weight.shape
            n -= 2 * d * max(0, experts - m.top_k * m.heads)
    return n


def token_mixers(cfg: ModelConfig) -> int:
    """How many token-mixer layers (attention, SSD, Rodimus, ...) the layout has; MLP/MoE letters not counted."""
    from .registry import LETTERS
    return sum(LETTERS[c].token for c in flatten(parse_layout(cfg.layout, LETTERS.keys())))


def fit_params(build: Callable[[int], ModelConfig], target: int, candidates: Iterable[int], *, tolerance: float = 0.1,
               active: bool = False, what: str = "d_model") -> tuple[ModelConfig, int]:
    """The config build(k) whose parameter count is nearest `target` over the ascending candidate values k (a width
    or a repeat count); candidates whose config is invalid are skipped. Counts grow with k, so a bisection finds the
    first valid k reaching the target (galloping, then bisecting) and the valid one before it. Raises ConfigError when the nearest is further
    than `tolerance` (relative) from the target. -> (config, parameters)."""
    ks, seen = list(candidates), {}

    def at(i: int):                                     # (config, count) of candidate i, None if invalid
        if i not in seen:
            try:
                cfg = build(ks[i])
                seen[i] = (cfg, count_parameters(cfg, active))
            except ConfigError:
                seen[i] = None
        return seen[i]

    def valid_from(i: int, step: int) -> int | None:
        while 0 <= i < len(ks) and at(i) is None:
            i += step
        return i if 0 <= i < len(ks) else None

    def reaches(i: int) -> bool:
        j = valid_from(i, 1)
        return j is not None and at(j)[1] >= target

    hi = 1                                              # gallop first: large candidates (deep models) cost more
    while hi < len(ks) and not reaches(hi - 1):
        hi *= 2
    lo, hi = hi // 2, min(hi, len(ks))                  # then bisect for the first index reaching the target
    while lo < hi:
        mid = (lo + hi) // 2
        if reaches(mid):
            hi = mid
        else:
            lo = mid + 1
    near = [j for j in (valid_from(lo, 1), valid_from(lo - 1, -1)) if j is not None]
    if not near:
        raise ConfigError(f"no valid {what} for a {target:,}-parameter budget")
    i = min(near, key=lambda j: abs(at(j)[1] - target))
    (cfg, n), k = at(i), ks[i]
    if abs(n - target) > tolerance * target:
        kind = "active parameters" if active else "parameters"
        raise ConfigError(f"no {what} meets the budget of {target:,} {kind} within {tolerance:.0%}: the nearest is "
                          f"{what} {k} with {n:,}")
    return cfg, n


def depth_for_mixers(build: Callable[[int], ModelConfig], n_mixers: int, max_repeat: int = 256) -> int:
    """The smallest repeat count n for which build(n) has at least `n_mixers` token-mixer layers."""
    if n_mixers < 1:
        raise ConfigError(f"the number of mixer layers must be >= 1, got {n_mixers}")
    for n in range(1, max_repeat + 1):
        if token_mixers(build(n)) >= n_mixers:
            return n
    raise ConfigError(f"no depth up to {max_repeat} repeats gives {n_mixers} mixer layers")


def cache_bytes(cfg, contexts: list[int], batch_size: int = 1, chunk: int = 512, seed: int = 0) -> list[int]:
    """Inference cache nbytes after prefilling each context length with random ids (a real cache)."""
    import torch
    from .causal_lm import CausalLM
    cfg = cfg.replace(max_seq_len=max(cfg.max_seq_len, max(contexts)))
    torch.manual_seed(seed)
    model = CausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    out = []
    with torch.inference_mode():
        for n in contexts:
            cache = model.make_cache(batch_size)
            ids = torch.randint(0, cfg.vocab_size, (batch_size, n), generator=g)
            for i in range(0, n, chunk):
                model(ids[:, i: i + chunk], cache=cache, logits_to_keep=1)
            out.append(cache.nbytes)
    return out
