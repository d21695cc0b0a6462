"""Training: the loop, AdamW + schedules, and safetensors checkpoints."""
from .checkpoint import load_checkpoint, load_pretrained, save_checkpoint
from .optim import lr_at, make_optimizer, param_groups
from ..eval.perplexity import evaluate_loss, validate
from .trainer import TrainConfig, train

__all__ = ["TrainConfig", "train", "evaluate_loss", "validate", "make_optimizer", "param_groups", "lr_at", "save_checkpoint",
           "load_checkpoint", "load_pretrained"]
