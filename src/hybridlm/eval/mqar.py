"""Train one model on MQAR and measure its recall accuracy on held-out examples.

The training data is a fixed set per curriculum stage (zoology trains epochs over a fixed set); the test set is
drawn from its own seed at the final pair count. Accuracy = answers whose argmax prediction (from the query
token's logits) is the value, over all answers of the test set.
"""
import sys
import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from tqdm import tqdm

from ..data.mqar import IGNORE, check_sizes, curriculum, mqar
from ..models import CausalLM, ModelConfig
from ..train.optim import lr_at, make_optimizer

TEST_SEED_OFFSET = 1_000_003  # the test set's stream never coincides with a training stage's


@dataclass
class MQARTask:
    seq_len: int
    num_pairs: int
    vocab_size: int = 512
    hard: bool = False
    power_a: float = 0.01
    train_examples: int = 8192     # per curriculum stage
    test_examples: int = 512
    curriculum: bool = True        # stages over num_pairs/8 ... num_pairs (004_f196d22cc7fe6dbe.txt D.1)

    def stages(self) -> list[int]:
        return curriculum(self.num_pairs) if self.curriculum else [self.num_pairs]


@torch.inference_mode()
def accuracy(model: nn.Module, inputs: Tensor, labels: Tensor, batch_size: int = 64) -> float:
    """Fraction of answers predicted exactly; inputs/labels [N, T] (labels -100 off the answers)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    correct = total = 0
    for i in range(0, len(inputs), batch_size):
        x, y = inputs[i:i + batch_size].to(device), labels[i:i + batch_size].to(device)
        pred = model(x).logits[:, :-1].argmax(-1)           # position t predicts token t + 1
        tgt = y[:, 1:]
        mask = tgt != IGNORE
        correct += (pred[mask] == tgt[mask]).sum().item()
        total += mask.sum().item()
    model.train(was_training)
    return correct / max(total, 1)


def train_mqar(cfg: ModelConfig, task: MQARTask, *, steps: int, batch_size: int, lr: float, seed: int = 0,
               weight_decay: float = 0.1, grad_clip: float = 1.0, device: str = "cpu", progress: bool = True,
               desc: str = "mqar") -> dict:
    """Train a fresh `CausalLM(cfg)` for `steps` optimizer steps (split evenly over the curriculum stages,
    warmup + cosine schedule) and return {accuracy, loss, params, steps, wall_s}."""
    check_sizes(task.seq_len, task.num_pairs, task.vocab_size)
    stages = task.stages()
    torch.manual_seed(seed)
    model = CausalLM(cfg).to(device).train()
    opt = make_optimizer(model, lr, weight_decay=weight_decay)
    test = mqar(task.test_examples, task.seq_len, task.num_pairs, task.vocab_size, seed=seed + TEST_SEED_OFFSET,
                power_a=task.power_a, hard=task.hard)
    g = torch.Generator().manual_seed(seed)
    bounds = [round(steps * (i + 1) / len(stages)) for i in range(len(stages))]  # last step of each stage
    losses: list[float] = []
    start = time.perf_counter()
    bar = tqdm(total=steps, disable=not progress, file=sys.stderr, desc=desc, leave=False, dynamic_ncols=True)
    step = 0
    for stage, (pairs, end) in enumerate(zip(stages, bounds)):
        x_all, y_all = mqar(task.train_examples, task.seq_len, pairs, task.vocab_size, seed=seed + 1 + stage,
                            power_a=task.power_a, hard=task.hard)
        order = torch.empty(0, dtype=torch.long)
        while step < end:
            if len(order) < batch_size:  # a new epoch over the stage's fixed training set
                order = torch.cat((order, torch.randperm(len(x_all), generator=g)))
            idx, order = order[:batch_size], order[batch_size:]
            for group in opt.param_groups:
                group["lr"] = lr_at(step, lr=lr, total=steps, warmup=max(1, steps // 20), min_lr=lr / 10)
            loss = model(x_all[idx].to(device), labels=y_all[idx].to(device)).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if grad_clip:
                nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            opt.step()
            losses.append(loss.item())
            step += 1
            bar.update(1)
            bar.set_postfix(pairs=pairs, loss=f"{losses[-1]:.3f}", refresh=False)
    bar.close()
    acc = accuracy(model, *test)
    tail = losses[-max(1, len(losses) // 10):]
    return {"accuracy": acc, "loss": sum(tail) / len(tail) if tail else float("nan"),
            "params": model.num_parameters(), "steps": steps, "wall_s": time.perf_counter() - start}
