"""The training loop: AdamW + schedule, gradient accumulation and clipping, bf16 autocast, periodic
validation, metrics.jsonl, atomic checkpoints, exact resume, and DDP under torchrun.

    summary = train(model_cfg, TrainConfig(steps=300), data, "runs/x")
    summary = train(model_cfg, TrainConfig(steps=600), data, "runs/x", resume=True)   # continues at 300

Batches depend only on (seed, step, micro-batch, rank), and the checkpoint holds weights, optimizer state
and RNG state, so a resumed run reproduces the loss curve of an uninterrupted one. Under
`torchrun --nproc_per_node N` (WORLD_SIZE > 1) each rank draws its own batches, gradients are averaged by
DDP or FSDP2 (`parallel`, train/parallel.py; gloo on CPU, nccl on CUDA), and rank 0 alone logs; every rank
validates its share of the windows, and under FSDP2 writes its shards of a DCP checkpoint
(checkpoint/dcp.py).

With `context_parallel` N, groups of N consecutive ranks split each sequence (train/context_parallel.py): the
ranks of a group read the same batch and each runs its T/N positions; the groups are data parallel. Every rank
holds the whole model, and one all-reduce over all ranks sums the gradient shares of a group and averages the
groups. Validation runs unsplit windows, shared out among all ranks.
"""
import contextlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..data.loader import TokenData
from ..data.sampling import ORDERS, make_sampler
from ..dtypes import CHOICES as DTYPES
from ..dtypes import resolve_dtype
from ..errors import CheckpointError, ConfigError
from ..eval.perplexity import DEFAULT_VAL_TOKENS, describe, validate
from ..models import CausalLM, ModelConfig
from ..checkpoint import (ensure_writable, find_checkpoint, init_weights, load_checkpoint, load_optimizer,
                         mark_latest, save_checkpoint, set_rng_state, step_name)
from .context_parallel import all_reduce_grads, context_parallel_forward
from ..checkpoint.dcp import has_dcp, load_training_state, save_sharded_checkpoint
from .faults import StopSignals, finite
from ..optim import lr_at, make_optimizer
from .parallel import MODES as PARALLEL_MODES
from .parallel import parallelize
from .stages import STAGES, apply_stage, set_dense


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    min_lr: float | None = None          # None = lr / 10
    warmup: int = 100
    schedule: str = "cosine"             # cosine | wsd | constant
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-8
    grad_clip: float = 1.0               # 0 = off
    grad_accum: int = 1
    eval_every: int = 200                # validate every N steps and at the end; 0 = only at the end
    eval_tokens: int | None = DEFAULT_VAL_TOKENS  # the whole val split up to this many tokens, else a fixed sample
                                                  # of about this many; None = the whole split; 0 = no validation
    eval_batch_size: int | None = None   # windows per forward and rank; None = EVAL_BATCH x batch_size (batch_size
                                         # under context parallelism: a rank then evaluates whole windows)
    doc_mask: bool = True                # reset state / mask attention at document boundaries
    save_every: int = 500                # 0 = only at the end
    seed: int = 0
    dtype: str = "float32"               # float32 | bfloat16 (autocast; weights stay float32) | auto (hybridlm.dtypes)
    compile: bool = False
    grad_checkpointing: bool = False
    log_every: int = 10
    device: str = "auto"                 # auto | cpu | cuda | cuda:N
    parallel: str = "auto"               # auto (= ddp) | ddp | fsdp, under torchrun (train/parallel.py)
    context_parallel: int = 1            # ranks splitting each sequence (data parallel over the rest)
    keep: int = 0                        # step checkpoints kept (0 = all)
    on_nan: str = "stop"                 # stop | skip: a NaN/Inf loss ends the run or skips that batch
    data_order: str = "random"           # random | sequential (see data/sampling.py)
    stage: str = "full"                  # full | indexer-warmup (train/stages.py)
    init_from: str | None = None         # start from this checkpoint's weights (fresh optimizer, step 0)
    indexer_dense_steps: int = 0         # stage full: the first N steps run `I` layers densely (train/stages.py)

    def __post_init__(self):
        self.betas = tuple(self.betas)
        need = [(self.steps >= 1, "steps must be >= 1"), (self.batch_size >= 1, "batch_size must be >= 1"),
                (self.seq_len >= 2, "seq_len must be >= 2"), (self.grad_accum >= 1, "grad_accum must be >= 1"),
                (self.lr > 0, "lr must be > 0"), (self.warmup >= 0, "warmup must be >= 0"),
                (self.log_every >= 1, "log_every must be >= 1"),
                (self.eval_tokens is None or self.eval_tokens >= 0, "eval_tokens must be >= 0"),
                (self.eval_batch_size is None or self.eval_batch_size >= 1, "eval_batch_size must be >= 1"),
                (self.adam_eps > 0, "adam_eps must be > 0"),
                (len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas must be two numbers in [0, 1)"),
                (self.dtype in DTYPES, f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}"),
                (self.parallel in PARALLEL_MODES, f"parallel must be auto, ddp or fsdp, got {self.parallel!r}"),
                (self.schedule in ("cosine", "wsd", "constant"),
                 f"schedule must be cosine, wsd or constant, got {self.schedule!r}"),
                (self.keep >= 0, "keep must be >= 0"),
                (self.context_parallel >= 1, "context_parallel must be >= 1"),
                (self.on_nan in ("stop", "skip"), f"on_nan must be stop or skip, got {self.on_nan!r}"),
                (self.data_order in ORDERS, f"data_order must be one of {', '.join(ORDERS)}, got {self.data_order!r}"),
                (self.stage in STAGES, f"stage must be one of {', '.join(STAGES)}, got {self.stage!r}"),
                (self.indexer_dense_steps >= 0, "indexer_dense_steps must be >= 0")]
        for ok, msg in need:
            if not ok:
                raise ConfigError(msg)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def lr_for(self, step: int) -> float:
        min_lr = self.lr / 10 if self.min_lr is None else self.min_lr
        return lr_at(step, lr=self.lr, total=self.steps, warmup=self.warmup, min_lr=min_lr, schedule=self.schedule)


# Validation keeps no activations for backward and the loss is fused with the LM head (no [B, T, V] logits), so a
# few times the training micro-batch fits in the memory training used; under FSDP each forward all-gathers every
# block, so larger batches mean fewer gathers per window.
EVAL_BATCH = 4


def _setup_distributed(device: str) -> tuple[int, int, torch.device, bool]:
    """-> (rank, world size, device, whether we initialised the process group)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if world <= 1:
        return 0, 1, torch.device(device), False
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        torch.cuda.set_device(local)
        dev, backend = torch.device("cuda", local), "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    created = not dist.is_initialized()
    if created:
        dist.init_process_group(backend)
    return rank, world, dev, created


def _context_parallel_group(cfg, model_cfg, rank: int, world: int):
    """This rank's process group of `cfg.context_parallel` consecutive ranks, after checking that the run can be
    split so (one ConfigError otherwise)."""
    from .context_parallel import check_layout
    cp = cfg.context_parallel
    if world % cp:
        raise ConfigError(f"--context-parallel {cp} does not divide the {world} ranks")
    if cfg.seq_len % cp or cfg.seq_len // cp < 2:
        raise ConfigError(f"--context-parallel {cp} needs a --seq-len divisible by {cp} with at least 2 tokens per "
                          f"rank, got {cfg.seq_len}")
    for on, flag in ((cfg.parallel == "fsdp", "--parallel fsdp"), (cfg.compile, "--compile"),
                     (cfg.grad_checkpointing, "--grad-checkpointing")):
        if on:     # each rank's chunk exchanges states mid-forward: recomputing or tracing it would resend them
            raise ConfigError(f"--context-parallel does not combine with {flag}")
    check_layout(model_cfg)
    if model_cfg.dropout:
        raise ConfigError("--context-parallel needs dropout 0 (the ranks of a group would drop different units)")
    groups = [dist.new_group(list(range(g, g + cp))) for g in range(0, world, cp)]   # every rank creates all
    return groups[rank // cp]


def _write_metrics(path: str, rows: list[dict], mode: str):
    with open(path, mode) as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _metrics_until(path: str, step: int) -> list[dict]:
    """The metrics lines of steps <= `step` (a resumed run rewrites what came after its checkpoint)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r.get("step", 0) <= step]


def train(model_cfg: ModelConfig, train_cfg: TrainConfig, data: TokenData, out_dir: str, resume: bool = False,
          progress: bool = True) -> dict:
    """Train and return a summary dict (steps, loss, val_loss, val_ppl, tokens_seen, tokens_per_s, ...)."""
    rank, world, device, own_pg = _setup_distributed(train_cfg.device)
    cfg = replace(train_cfg, dtype=resolve_dtype(train_cfg.dtype, device)[0])   # checkpoints record what ran
    try:
        with StopSignals() as signals:  # SIGTERM / SIGINT end the run after the current step, with a checkpoint
            return _train(model_cfg, cfg, data, out_dir, resume, progress, rank, world, device, signals)
    finally:
        if own_pg:
            dist.destroy_process_group()


def _train(model_cfg, cfg, data, out_dir, resume, progress, rank, world, device, signals) -> dict:
    main = rank == 0
    ensure_writable(out_dir)
    tok = data.tokenizer
    torch.manual_seed(cfg.seed)
    start, tokens_seen, state = 0, 0, {}
    if resume:
        ckpt = find_checkpoint(out_dir)
        # DCP shards are loaded below, into whatever this rank holds: no whole model here
        model, state = load_checkpoint(ckpt, weights=not has_dcp(ckpt))
        model_cfg = model.config
        start, tokens_seen = int(state.get("step", 0)), int(state.get("tokens_seen", 0))
    else:
        if cfg.init_from:             # the weights come from a checkpoint (e.g. a dense model, before the warm-up)
            model = CausalLM(model_cfg)
            init_weights(model, cfg.init_from)
        else:
            with torch.device("meta"):    # allocated and initialised by parallelize, under FSDP2 shard by shard
                model = CausalLM(model_cfg)
    apply_stage(model, cfg.stage)          # before parallelism: DDP / FSDP2 see only what trains
    if tok.vocab_size > model_cfg.vocab_size:
        raise ConfigError(f"the tokenizer has {tok.vocab_size} ids but the model's vocab_size is "
                          f"{model_cfg.vocab_size}")
    if cfg.seq_len > model_cfg.max_seq_len:
        raise ConfigError(f"seq_len {cfg.seq_len} exceeds the model's max_seq_len {model_cfg.max_seq_len}")
    if not any(p.is_meta for p in model.parameters()):
        model.to(device)
    cp = cfg.context_parallel
    cp_group = _context_parallel_group(cfg, model_cfg, rank, world) if cp > 1 else None
    # activation checkpointing, compile, DDP / FSDP2, applied from outside; the optimizer sees the result
    par = parallelize(model, cfg.parallel, world=1 if cp > 1 else world, device=device, dtype=cfg.dtype,
                      compile=cfg.compile, checkpointing=cfg.grad_checkpointing)   # CP reduces gradients itself
    fwd = par.module
    opt = make_optimizer(model, cfg.lr, cfg.weight_decay, cfg.betas, cfg.adam_eps)
    B, T, A = cfg.batch_size, cfg.seq_len, cfg.grad_accum
    dp_rank, dp_world = rank // cp, world // cp      # the ranks of a context-parallel group read the same batch
    sampler = make_sampler(data, cfg.data_order, B, T, cfg.seed, dp_rank, dp_world)
    nan_skipped = 0
    if resume:
        if has_dcp(ckpt):
            load_training_state(model, opt, ckpt)
        elif par.sharded:
            raise CheckpointError(f"{ckpt} was saved without --parallel fsdp (no dcp/ shards); resume it with "
                                  "--parallel ddp")
        else:
            load_optimizer(opt, ckpt)
        set_rng_state(state.get("rng", {}))
        sampler.load_state_dict(state.get("data_position", {}))
        nan_skipped = int(state.get("nan_skipped", 0))
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    if main:
        _write_metrics(metrics_path, _metrics_until(metrics_path, start) if resume else [], "w")

    # FSDP2's mixed-precision policy already computes in bf16
    autocast = torch.autocast(device.type, dtype=torch.bfloat16,
                              enabled=cfg.dtype == "bfloat16" and not par.mixed_precision)

    eval_batch = cfg.eval_batch_size or B * (EVAL_BATCH if cp == 1 else 1)

    def run_eval() -> dict:   # every rank evaluates its share of the windows (eval/perplexity.py)
        return validate(model, data.tokens("val"), tok, cfg.seq_len, eval_batch,
                        max_tokens=cfg.eval_tokens, seed=cfg.seed, doc_mask=cfg.doc_mask, autocast=autocast,
                        rank=rank, world=world)

    bar = tqdm(total=cfg.steps, initial=start, disable=not (progress and main), file=sys.stderr, desc="train",
               dynamic_ncols=True, leave=True)
    tokens_per_step = B * T * A * dp_world
    first_loss = loss_val = val = kl_val = None
    window_tokens, window_time, train_time = 0, 0.0, 0.0
    ckpt_path = stopped = None

    def save(done, last=False):  # RUN/step-NNNNNN, then RUN/latest points at it
        st = {"step": done, "tokens_seen": tokens_seen, "train_config": asdict(cfg), "tokenizer": tok.to_dict(),
              "data": data.source, "data_spec": getattr(data, "spec", None), "loss": loss_val,
              "val_loss": val and val["loss"], "nan_skipped": nan_skipped, "data_position": sampler.state_dict()}
        if par.sharded:   # DCP shards from every rank; the weights consolidated at the end
            path = save_sharded_checkpoint(out_dir, model, opt, st, tok, consolidate=last, name=step_name(done))
        else:
            path = save_checkpoint(out_dir, model, opt, st, tok, name=step_name(done)) if main else None
        if main:
            mark_latest(out_dir, path, cfg.keep)
        if world > 1:
            dist.barrier()
        return path

    model.train()
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        lr = cfg.lr_for(step)
        for g in opt.param_groups:
            g["lr"] = lr
        if cfg.indexer_dense_steps and cfg.stage == "full" and step in (start, cfg.indexer_dense_steps):
            set_dense(model, step < cfg.indexer_dense_steps)
        loss_sum = torch.zeros((), device=device)
        kl_sum = None                       # the lightning indexers' KL (`I` layers), logged on its own
        for micro in range(A):
            ids, resets = sampler.batch(step, micro)
            ids, resets = ids.to(device), resets.to(device) if cfg.doc_mask else None
            sync = fwd.no_sync() if par.mode == "ddp" and micro < A - 1 else contextlib.nullcontext()
            if par.sharded:
                fwd.set_requires_gradient_sync(micro == A - 1)
            with sync:
                with autocast:
                    if cp_group is None:
                        res = fwd(ids, labels=ids, resets=resets)
                    else:   # this rank's share of the sequence's loss
                        res = context_parallel_forward(model, ids, labels=ids, resets=resets, group=cp_group)
                    loss = res.loss
                (loss / A).backward()
            loss_sum += loss.detach().float()
            if getattr(res, "indexer_kl", None) is not None:
                kl_sum = res.indexer_kl.detach().float() + (kl_sum if kl_sum is not None else 0)
        loss_avg = loss_sum / A
        if cp_group is not None:   # sum the shares within a group, average the groups
            all_reduce_grads(model)
            for p in model.parameters():
                p.grad.div_(dp_world)
        kl_avg = kl_sum / A if kl_sum is not None else None
        if world > 1:  # every rank sees the same loss, so all take the same branch below
            dist.all_reduce(loss_avg)
            loss_avg /= dp_world
            if kl_avg is not None:
                dist.all_reduce(kl_avg)
                kl_avg /= world
        loss_val = loss_avg.item()
        kl_val = kl_avg.item() if kl_avg is not None else None
        grad_norm = None
        if cfg.grad_clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            grad_norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()  # a DTensor under FSDP
        if finite(loss_val, grad_norm):
            opt.step()
        elif cfg.on_nan == "skip":  # drop this batch: no update, the data position moves on
            nan_skipped += 1
            bar.write(f"step {step + 1}: loss {loss_val}, grad norm {grad_norm}: batch skipped "
                      f"({nan_skipped} so far)", file=sys.stderr)
        else:
            raise FloatingPointError(f"loss {loss_val} (grad norm {grad_norm}) at step {step + 1}: stopped, the last "
                                     f"checkpoint is untouched; try a lower --lr, or --on-nan skip")
        opt.zero_grad(set_to_none=True)
        if first_loss is None:
            first_loss = loss_val
        done = step + 1
        tokens_seen += tokens_per_step
        dt = time.perf_counter() - t0
        window_time, window_tokens, train_time = window_time + dt, window_tokens + tokens_per_step, train_time + dt
        bar.update(1)
        bar.set_postfix(loss=f"{loss_val:.4f}", lr=f"{lr:.2e}", tok_s=f"{window_tokens / window_time:,.0f}")

        is_last = done == cfg.steps
        do_eval = cfg.eval_tokens != 0 and (is_last or (cfg.eval_every and done % cfg.eval_every == 0))
        row_eval = {}
        if do_eval:
            val = run_eval()
            row_eval = {"val_loss": val["loss"], "val_ppl": val["ppl"], "val_tokens": val["tokens"],
                        "val_bpb": val["bpb"]}
            line = f"step {done:>6}  train loss {loss_val:.4f}  {describe(val)}"
            if main and bar.disable:  # --no-progress hides the bar, not the validation lines
                print(line, file=sys.stderr, flush=True)
            elif main:
                bar.write(line, file=sys.stderr)
        if main and (done % cfg.log_every == 0 or done == 1 or do_eval):
            row = {"step": done, "loss": loss_val, "lr": lr, "tokens_per_s": window_tokens / window_time,
                   "tokens": tokens_seen, "nan_skipped": nan_skipped, "val_loss": None, "val_ppl": None, **row_eval}
            if kl_val is not None:
                row["indexer_kl"] = kl_val
            _write_metrics(metrics_path, [row], "a")
            window_tokens, window_time = 0, 0.0
        if signals.requested(world, device):  # SIGTERM / SIGINT: this step is done; save it and leave
            stopped = signals.received
            ckpt_path = save(done, last=True)
            break
        if is_last or (cfg.save_every and done % cfg.save_every == 0):
            ckpt_path = save(done, last=is_last)
    bar.close()
    end = done if stopped else cfg.steps
    return {"steps": end, "stopped": stopped, "nan_skipped": nan_skipped, "start_step": start,
            "first_loss": first_loss, "loss": loss_val, "indexer_kl": kl_val, "val_loss": val and val["loss"],
            "val_ppl": val and val["ppl"], "val_tokens": val and val["tokens"], "val_bpb": val and val["bpb"],
            "val_whole": val and val["whole"],
            "tokens_seen": tokens_seen, "train_time_s": train_time,
            "tokens_per_s": (end - start) * tokens_per_step / train_time if train_time else None,
            "params": model.num_parameters(), "checkpoint": ckpt_path, "out_dir": out_dir}
