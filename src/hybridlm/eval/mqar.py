"""Train one model on MQAR and measure its recall accuracy on held-out examples (zoology's protocol).

The protocol (HazyResearch/zoology `train.py` / `config.py`): a fixed training set (zoology:
100k examples, large enough that a 2-layer model cannot memorise it), epochs over it in random order, AdamW with
weight decay on matrices only, warmup then cosine to 0 over the step budget, and **early stopping once held-out
accuracy reaches `target`** (0.99), checked every `eval_every` steps: easy points stop early, hard ones use the
whole budget. Recall is a phase change after thousands of steps, so the budget must be large; early stopping is
what makes a large budget affordable. With a curriculum (`--hard`) the budget is split over the stages and
early stopping applies in the last one (the test set holds the final pair count).

Accuracy = answers whose argmax prediction (from the query token's logits) is the value, over all answers of the
test set (drawn from its own seed).
"""
import sys
import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from tqdm import tqdm

from ..data.mqar import IGNORE, check_sizes, curriculum, mqar
from ..errors import InputError
from ..models import CausalLM, ModelConfig
from ..optim import lr_at, make_optimizer

TEST_SEED_OFFSET = 1_000_003  # the test set's stream never coincides with a training stage's


@dataclass
class MQARTask:
    seq_len: int
    num_pairs: int
    vocab_size: int = 8192
    hard: bool = False
    power_a: float = 0.01
    train_examples: int = 100_000  # per curriculum stage (zoology's 100k: not memorisable at these sizes)
    test_examples: int = 1_000
    curriculum: bool = False       # stages over num_pairs/8 ... num_pairs (the Mamba-2 paper D.1)

    def stages(self) -> list[int]:
        return curriculum(self.num_pairs) if self.curriculum else [self.num_pairs]


@torch.inference_mode()
def accuracy(model: CausalLM, inputs: Tensor, labels: Tensor, batch_size: int = 250) -> float:
    """Fraction of answers predicted exactly; inputs/labels [N, T] (labels -100 off the answers)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    correct = total = 0
    for i in range(0, len(inputs), batch_size):
        x, y = inputs[i:i + batch_size].to(device), labels[i:i + batch_size].to(device)
        tgt = y[:, 1:]
        mask = tgt != IGNORE                                  # position t predicts token t + 1
        h = model.hidden_states(x)[:, :-1][mask]              # the head runs at the answers only (vocab 8192)
        correct += (model.lm_head(h).argmax(-1) == tgt[mask]).sum().item()
        total += mask.sum().item()
    model.train(was_training)
    return correct / max(total, 1)


def warmup_steps(steps: int, warmup: int | None = None) -> int:
    """The lr warmup of a `steps` budget: `warmup`, or by default 2% of the budget, at most 200 steps. One clear
    error for a warmup no schedule can have (also used by the sweep before it trains anything)."""
    if warmup is None:
        return min(200, max(1, steps // 50))
    if not 0 <= warmup < steps:
        raise InputError(f"MQAR warmup must be in [0, steps): got {warmup} warmup steps for {steps} steps")
    return warmup


def train_mqar(cfg: ModelConfig, task: MQARTask, *, steps: int, batch_size: int, lr: float, seed: int = 0,
               weight_decay: float = 0.1, grad_clip: float = 1.0, eval_every: int = 250, target: float = 0.99,
               warmup: int | None = None, device: str = "cpu", progress: bool = True, desc: str = "mqar") -> dict:
    """Train a fresh `CausalLM(cfg)` for at most `steps` optimizer steps (linear warmup over `warmup` steps,
    default `warmup_steps(steps)`, then cosine to 0 over `steps`; split
    evenly over the curriculum stages), stopping once held-out accuracy >= `target` (checked every `eval_every`
    steps of the last stage; `target` > 1 never stops). Returns {accuracy, loss, params, steps (taken),
    stopped_early, curve [[step, accuracy], ...], wall_s}."""
    check_sizes(task.seq_len, task.num_pairs, task.vocab_size)
    if eval_every < 1:
        raise ValueError(f"eval_every must be >= 1, got {eval_every}")
    stages = task.stages()
    torch.manual_seed(seed)
    model = CausalLM(cfg).to(device).train()
    opt = make_optimizer(model, lr, weight_decay=weight_decay)
    test = mqar(task.test_examples, task.seq_len, task.num_pairs, task.vocab_size, seed=seed + TEST_SEED_OFFSET,
                power_a=task.power_a, hard=task.hard)
    g = torch.Generator().manual_seed(seed)
    bounds = [round(steps * (i + 1) / len(stages)) for i in range(len(stages))]  # last step of each stage
    warmup = warmup_steps(steps, warmup)
    losses: list[float] = []
    curve: list[list] = []
    acc = None
    start = time.perf_counter()
    bar = tqdm(total=steps, disable=not progress, file=sys.stderr, desc=desc, leave=False, dynamic_ncols=True)
    step = 0
    for stage, (pairs, end) in enumerate(zip(stages, bounds)):
        final = stage == len(stages) - 1
        x_all, y_all = mqar(task.train_examples, task.seq_len, pairs, task.vocab_size, seed=seed + 1 + stage,
                            power_a=task.power_a, hard=task.hard)
        order = torch.empty(0, dtype=torch.long)
        while step < end:
            if len(order) < batch_size:  # a new epoch over the stage's fixed training set
                order = torch.cat((order, torch.randperm(len(x_all), generator=g)))
            idx, order = order[:batch_size], order[batch_size:]
            for group in opt.param_groups:
                group["lr"] = lr_at(step, lr=lr, total=steps, warmup=warmup, min_lr=0.0)
            loss = model(x_all[idx].to(device), labels=y_all[idx].to(device)).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if grad_clip:
                nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            opt.step()
            losses.append(loss.item())
            step += 1
            bar.update(1)
            if final and (step % eval_every == 0 or step == end):
                acc = accuracy(model, *test)
                curve.append([step, acc])
                bar.set_postfix(pairs=pairs, loss=f"{losses[-1]:.3f}", acc=f"{acc:.3f}", refresh=False)
                if acc >= target:
                    break
    bar.close()
    if acc is None:                                  # steps < number of stages: the last stage never ran
        acc = accuracy(model, *test)
        curve.append([step, acc])
    tail = losses[-max(1, min(len(losses), eval_every) // 4):]
    return {"accuracy": acc, "loss": sum(tail) / len(tail) if tail else float("nan"),
            "params": model.num_parameters(), "steps": step, "stopped_early": acc >= target and step < steps,
            "curve": curve, "wall_s": time.perf_counter() - start}
