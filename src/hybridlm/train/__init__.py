"""Training: the loop, AdamW + schedules, and safetensors checkpoints."""
from .checkpoint import load_checkpoint, load_pretrained, save_checkpoint, save_step_checkpoint
from .optim import lr_at, make_optimizer, param_groups
from .trainer import TrainConfig, evaluate_loss, train

__all__ = ["TrainConfig", "train", "evaluate_loss", "make_optimizer", "param_groups", "lr_at", "save_checkpoint",
           "save_step_checkpoint", "load_checkpoint", "load_pretrained"]
