"""Training stages. DeepSeek-V3.2 adds its lightning indexer to a trained dense model in two stages
(the DeepSeek-V3.2 report):

    indexer-warmup  the `I` layers attend densely and every parameter but the indexers' is frozen: the indexers
                    learn the main attention's distribution over all keys (their KL is the only loss with a
                    gradient). A short stage, started from a trained checkpoint (`hybridlm train --init-from`).
    full            everything trains; `I` layers attend to the indexer's top-k, the indexer learns from its KL
                    over the selected keys and the rest from the LM loss (layers/indexer.py). The default.

Training from scratch has no trained dense model to start from; `indexer_dense_steps` (TrainConfig) runs the first
steps of a `full` run with `I` layers dense instead, so that the indexers learn the dense distribution over all
keys (which the sparse stage's KL, over the selected keys only, cannot teach) while the model trains.

Applied to the model before parallelism wraps it, so DDP / FSDP2 and the optimizer see only the trainable
parameters.
"""
from torch import nn

from ..errors import ConfigError

STAGES = ("full", "indexer-warmup")


def set_dense(model: nn.Module, dense: bool) -> list:
    """Make every `I` layer of `model` attend densely (or not); returns those layers."""
    from ..layers.indexer import IndexedAttention
    indexed = [m for m in model.modules() if isinstance(m, IndexedAttention)]
    for m in indexed:
        m.dense = dense
    return indexed


def apply_stage(model: nn.Module, stage: str):
    """Set `model` (a CausalLM) up for `stage`, in place."""
    if stage not in STAGES:
        raise ConfigError(f"stage must be one of {', '.join(STAGES)}, got {stage!r}")
    indexed = set_dense(model, stage == "indexer-warmup")
    if stage == "full":
        return
    if not indexed:
        raise ConfigError(f"stage {stage} trains lightning indexers, but layout {model.config.layout!r} has no "
                          "`I` layer")
    if not model.config.dsa_kl_weight:
        raise ConfigError(f"stage {stage} trains the indexers from their KL loss: dsa_kl_weight must be > 0")
    model.requires_grad_(False)
    for m in indexed:
        m.indexer.requires_grad_(True)
