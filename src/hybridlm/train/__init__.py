"""Training: the loop (and, re-exported for convenience, the optimizer, validation and checkpoint functions it uses)."""
from ..checkpoint import load_checkpoint, load_pretrained, save_checkpoint, save_step_checkpoint
from ..optim import lr_at, make_optimizer, param_groups
from ..eval.perplexity import evaluate_loss, validate
from .trainer import TrainConfig, train

__all__ = ["TrainConfig", "train", "evaluate_loss", "validate", "make_optimizer", "param_groups", "lr_at",
           "save_checkpoint", "save_step_checkpoint", "load_checkpoint", "load_pretrained"]
