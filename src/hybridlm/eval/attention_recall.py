"""Captured attention mass: how much of the dense attention an `I` layer's top-k keys keep (the recall of attention
mass that DeepSeek-V3.2 trains its lightning indexer for).

    captured_mass(model, val_ids, tokenizer, seq_len=1024) -> {"mass", "per_layer", "oracle", "random", "queries", "k"}

At each `I` layer, on that layer's input in the model as it runs (sparse), take the dense attention's head-mean
probabilities p[t, :] over every visible key (the indexer's warm-up target) and the indexer's top-k S_t:
captured[t] = Σ_{s ∈ S_t} p[t, s], averaged over the queries that see more than k keys (the others keep all).
1.0: the selection loses nothing. `oracle` is the most any k keys could capture (the mass of the dense
attention's own top k): a diffuse attention caps it below 1. `random` is what k random keys capture (k / visible).
"""
import torch

from ..data.loader import eval_starts, windows_at
from ..errors import InputError
from ..layers.indexer import IndexedAttention, LightningIndexer


def _layer_mass(layer: IndexedAttention, x: torch.Tensor, ctx) -> tuple[float, float, float, int]:
    """(Σ captured, Σ oracle, Σ k/visible, queries counted) of one layer's input x [B, T, d]."""
    q_lat = layer.attn.query_latent(x) if hasattr(layer.attn, "query_latent") else None
    extra = {"q_latent": q_lat} if q_lat is not None else {}
    scores = layer.indexer(x, q_lat if q_lat is not None else x, ctx)              # [B, T, S]
    visible = torch.isfinite(scores).sum(-1)                                       # [B, T]
    rows = visible > layer.indexer.topk
    if not rows.any():
        return 0.0, 0.0, 0.0, 0
    keep = LightningIndexer.select(scores, layer.indexer.topk)
    _, p = layer.attn(x, ctx=ctx, need_weights=True, **extra)                     # dense: no bias
    captured = (p * keep).sum(-1)
    oracle = p.topk(layer.indexer.topk, dim=-1).values.sum(-1)
    return (float(captured[rows].sum()), float(oracle[rows].sum()), float((layer.indexer.topk / visible[rows]).sum()),
            int(rows.sum()))


@torch.no_grad()
def captured_mass(model, ids, tokenizer, seq_len: int = 1024, batch_size: int = 4, max_tokens: int = 32_768,
                  seed: int = 0, doc_mask: bool = True) -> dict:
    """Mean captured attention mass over `I` layers and validation windows (token ids, 1-D); see the module doc."""
    layers = [m for m in model.modules() if isinstance(m, IndexedAttention)]
    if not layers:
        raise InputError(f"captured attention mass needs `I` layers; layout {model.config.layout!r} has none")
    seq_len = min(seq_len, model.config.max_seq_len)
    if len(ids) < seq_len:
        raise InputError(f"captured attention mass needs at least {seq_len} tokens, got {len(ids)}")
    sums = {id(m): [0.0, 0.0, 0.0, 0] for m in layers}

    def hook(module, args, kwargs, output):
        if kwargs.get("cache") is None:
            got = _layer_mass(module, args[0], kwargs["ctx"])
            sums[id(module)] = [a + b for a, b in zip(sums[id(module)], got)]

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in layers]
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        starts, _ = eval_starts(len(ids), seq_len, max_tokens, seed)
        for x, resets in windows_at(ids, starts, batch_size, seq_len, tokenizer.eos_id if doc_mask else None):
            model(x.to(device), resets=None if resets is None else resets.to(device), logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    per_layer = [s[0] / s[3] if s[3] else None for s in (sums[id(m)] for m in layers)]
    n = sum(s[3] for s in sums.values())
    total = [sum(s[i] for s in sums.values()) / n if n else None for i in range(3)]
    return {"mass": total[0], "per_layer": per_layer, "oracle": total[1], "random": total[2], "queries": n,
            "k": layers[0].indexer.topk}
