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
from ..checkpoint import (ensure_writable, find_checkpoint, load_weights_into, load_checkpoint, load_optimizer,
                         mark_latest, save_checkpoint, set_rng_state, step_name)
from .context_parallel import all_reduce_grads, context_parallel_forward
from ..checkpoint.dcp import has_dcp, load_training_state, save_sharded_checkpoint
from .faults import StopSignals
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


def setup_distributed(device: str) -> tuple[int, int, torch.device, bool]:
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
    rank, world, device, own_pg = setup_distributed(train_cfg.device)
    cfg = replace(train_cfg, dtype=resolve_dtype(train_cfg.dtype, device)[0])   # checkpoints record what ran
    try:
        with StopSignals() as signals:  # SIGTERM / SIGINT end the run after the current step, with a checkpoint
            return Trainer(model_cfg, cfg, data, out_dir, resume, rank, world, device).fit(signals, progress)
    finally:
        if own_pg:
            dist.destroy_process_group()


class Trainer:
    """One run, in torchtitan's shape: `__init__` sets up (model, parallelism, optimizer, data, resume state),
    `train_step` runs one optimizer step and returns its loss as device tensors, `validate` and `save` do what
    they say, and `fit` is the loop. Losses stay on the device between log lines: the host reads them back only
    at the logging cadence (and before a validation or a checkpoint), except under on_nan "skip" without a fused
    optimizer (FSDP), where each step's skip decision needs them."""

    def __init__(self, model_cfg, cfg: TrainConfig, data: TokenData, out_dir: str, resume: bool, rank: int,
                 world: int, device: torch.device):
        self.cfg, self.data, self.out_dir, self.rank, self.world, self.device = cfg, data, out_dir, rank, world, device
        self.main, self.tok = rank == 0, data.tokenizer
        ensure_writable(out_dir)
        torch.manual_seed(cfg.seed)
        model, state, ckpt = self._model(model_cfg, resume)
        self.model = model
        model_cfg = model.config
        apply_stage(model, cfg.stage)          # before parallelism: DDP / FSDP2 see only what trains
        if self.tok.vocab_size > model_cfg.vocab_size:
            raise ConfigError(f"the tokenizer has {self.tok.vocab_size} ids but the model's vocab_size is "
                              f"{model_cfg.vocab_size}")
        if cfg.seq_len > model_cfg.max_seq_len:
            raise ConfigError(f"seq_len {cfg.seq_len} exceeds the model's max_seq_len {model_cfg.max_seq_len}")
        if not any(p.is_meta for p in model.parameters()):
            model.to(device)
        cp = cfg.context_parallel
        self.cp_group = _context_parallel_group(cfg, model_cfg, rank, world) if cp > 1 else None
        # activation checkpointing, compile, DDP / FSDP2, applied from outside; the optimizer sees the result
        self.par = parallelize(model, cfg.parallel, world=1 if cp > 1 else world, device=device, dtype=cfg.dtype,
                               compile=cfg.compile, checkpointing=cfg.grad_checkpointing)   # CP reduces grads itself
        self.opt = make_optimizer(model, cfg.lr, cfg.weight_decay, cfg.betas, cfg.adam_eps)
        # a fused AdamW skips a non-finite step on the device (found_inf, as GradScaler does): no host sync
        self.device_skip = cfg.on_nan == "skip" and bool(self.opt.defaults.get("fused")) and not self.par.sharded
        self.dp_world = world // cp             # the ranks of a context-parallel group read the same batch
        self.sampler = make_sampler(data, cfg.data_order, cfg.batch_size, cfg.seq_len, cfg.seed, rank // cp,
                                    self.dp_world)
        self.start, self.tokens_seen = int(state.get("step", 0)), int(state.get("tokens_seen", 0))
        self.nan_skipped = int(state.get("nan_skipped", 0))
        if resume:
            self._resume(ckpt, state)
        self.metrics_path = os.path.join(out_dir, "metrics.jsonl")
        if self.main:
            _write_metrics(self.metrics_path, _metrics_until(self.metrics_path, self.start) if resume else [], "w")
        # FSDP2's mixed-precision policy already computes in bf16
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16,
                                       enabled=cfg.dtype == "bfloat16" and not self.par.mixed_precision)
        self.eval_batch = cfg.eval_batch_size or cfg.batch_size * (EVAL_BATCH if cp == 1 else 1)
        self.tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * self.dp_world
        self.loss_val = self.kl_val = self.val = None
        self.skipped = torch.zeros((), dtype=torch.long, device=device)   # skipped steps not yet read back
        self.bad_step = torch.full((), -1, dtype=torch.long, device=device)   # a non-finite step not yet read back
        self.bad_loss = torch.zeros((), device=device)

    def _model(self, model_cfg, resume: bool):
        """-> (model, checkpoint state, checkpoint path): resumed, initialised from a checkpoint, or on the meta
        device (allocated and initialised by parallelize, under FSDP2 shard by shard)."""
        if resume:
            ckpt = find_checkpoint(self.out_dir)
            # DCP shards are loaded later, into whatever this rank holds: no whole model here
            model, state = load_checkpoint(ckpt, weights=not has_dcp(ckpt))
            return model, state, ckpt
        if self.cfg.init_from:        # the weights come from a checkpoint (e.g. a dense model, before the warm-up)
            model = CausalLM(model_cfg)
            load_weights_into(model, self.cfg.init_from)
            return model, {}, None
        with torch.device("meta"):
            return CausalLM(model_cfg), {}, None

    def _resume(self, ckpt: str, state: dict):
        if has_dcp(ckpt):
            load_training_state(self.model, self.opt, ckpt)
        elif self.par.sharded:
            raise CheckpointError(f"{ckpt} was saved without --parallel fsdp (no dcp/ shards); resume it with "
                                  "--parallel ddp")
        else:
            load_optimizer(self.opt, ckpt)
        set_rng_state(state.get("rng", {}))
        self.sampler.load_state_dict(state.get("data_position", {}))

    def train_step(self, step: int) -> dict:
        """Forward and backward over the micro-batches, gradient reduction and clipping, and the optimizer step
        unless the loss or gradient norm is non-finite (on_nan). -> {"step", "loss", "kl" (device tensors)}."""
        cfg, A = self.cfg, self.cfg.grad_accum
        for g in self.opt.param_groups:
            g["lr"] = cfg.lr_for(step)
        if cfg.indexer_dense_steps and cfg.stage == "full" and step in (self.start, cfg.indexer_dense_steps):
            set_dense(self.model, step < cfg.indexer_dense_steps)
        loss_sum, kl_sum = torch.zeros((), device=self.device), None   # kl: the lightning indexers' (`I` layers)
        for micro in range(A):
            loss, kl = self._micro_step(step, micro)
            loss_sum += loss
            if kl is not None:
                kl_sum = kl + (kl_sum if kl_sum is not None else 0)
        loss, kl = loss_sum / A, (kl_sum / A if kl_sum is not None else None)
        if self.cp_group is not None:   # sum the shares within a group, average the groups
            all_reduce_grads(self.model)
            for p in self.model.parameters():
                p.grad.div_(self.dp_world)
        if self.world > 1:  # every rank sees the same loss, so all take the same branch below
            dist.all_reduce(loss)
            loss /= self.dp_world
            if kl is not None:
                dist.all_reduce(kl)
                kl /= self.world
        ok = loss.isfinite()
        if cfg.grad_clip:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            ok &= (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).isfinite()   # a DTensor under FSDP
        self._update(step, ok, loss)
        self.opt.zero_grad(set_to_none=True)
        return {"step": step + 1, "loss": loss, "kl": kl}

    def _micro_step(self, step: int, micro: int):
        """One micro-batch's forward and backward. -> (loss, indexer KL or None), detached, float32."""
        ids, resets = self.sampler.batch(step, micro)
        ids, resets = ids.to(self.device), resets.to(self.device) if self.cfg.doc_mask else None
        fwd, last = self.par.module, micro == self.cfg.grad_accum - 1
        sync = fwd.no_sync() if self.par.mode == "ddp" and not last else contextlib.nullcontext()
        if self.par.sharded:
            fwd.set_requires_gradient_sync(last)
        with sync:
            with self.autocast:
                if self.cp_group is None:
                    res = fwd(ids, labels=ids, resets=resets)
                else:   # this rank's share of the sequence's loss
                    res = context_parallel_forward(self.model, ids, labels=ids, resets=resets, group=self.cp_group)
            (res.loss / self.cfg.grad_accum).backward()
        kl = getattr(res, "indexer_kl", None)
        return res.loss.detach().float(), (kl.detach().float() if kl is not None else None)

    def _update(self, step: int, ok: torch.Tensor, loss: torch.Tensor):
        """The optimizer step, or none for a non-finite step (ok False). on_nan "stop" records the first such step
        and steps anyway: `read` raises before any log line, validation or checkpoint sees the spoiled weights.
        "skip" drops the update, on the device with a fused optimizer, else after reading the flag (a sync)."""
        # the step and loss a message names: the first non-finite one (stop), the last since the last read (skip)
        hit = ~ok & (self.bad_step < 0) if self.cfg.on_nan == "stop" else ~ok
        self.bad_step = torch.where(hit, step + 1, self.bad_step)
        self.bad_loss = torch.where(hit, loss, self.bad_loss)
        if self.cfg.on_nan == "stop":
            self.opt.step()
        elif self.device_skip:
            self.opt.found_inf, self.opt.grad_scale = (~ok).float(), None   # read by the fused kernel, as GradScaler
            try:
                self.opt.step()
            finally:
                del self.opt.found_inf, self.opt.grad_scale
            self.skipped += ~ok
        elif bool(ok):
            self.opt.step()
        else:
            self.skipped += 1

    def read(self, out: dict) -> None:
        """Bring a step's loss and KL and the skipped steps to the host (a sync); on_nan stop raises here when a
        step since the last read was non-finite."""
        self.loss_val = out["loss"].item()
        self.kl_val = out["kl"].item() if out["kl"] is not None else None
        bad, n = int(self.bad_step), int(self.skipped)
        if bad >= 0 and self.cfg.on_nan == "stop":
            raise FloatingPointError(f"loss {self.bad_loss.item()} (or a non-finite gradient norm) at step {bad}: "
                                     f"stopped, the last checkpoint is untouched; try a lower --lr, or --on-nan skip")
        if n:
            self.nan_skipped += n
            self.skipped.zero_()
            self.bad_step.fill_(-1)
            tqdm.write(f"step {bad}: loss {self.bad_loss.item()}: batch skipped ({self.nan_skipped} so far"
                       f"{'' if n == 1 else f'; {n} since the last log line'})", file=sys.stderr)

    def validate(self) -> dict:
        """Every rank evaluates its share of the validation windows (eval/perplexity.py)."""
        cfg = self.cfg
        return validate(self.model, self.data.tokens("val"), self.tok, cfg.seq_len, self.eval_batch,
                        max_tokens=cfg.eval_tokens, seed=cfg.seed, doc_mask=cfg.doc_mask, autocast=self.autocast,
                        rank=self.rank, world=self.world)

    def save(self, done: int, last: bool = False) -> str | None:
        """RUN/step-NNNNNN (DCP shards from every rank under FSDP2, consolidated at the end), then RUN/latest."""
        st = {"step": done, "tokens_seen": self.tokens_seen, "train_config": asdict(self.cfg),
              "tokenizer": self.tok.to_dict(), "data": self.data.source, "data_spec": getattr(self.data, "spec", None),
              "loss": self.loss_val, "val_loss": self.val and self.val["loss"], "nan_skipped": self.nan_skipped,
              "data_position": self.sampler.state_dict()}
        if self.par.sharded:
            path = save_sharded_checkpoint(self.out_dir, self.model, self.opt, st, self.tok, consolidate=last,
                                           name=step_name(done))
        else:
            path = save_checkpoint(self.out_dir, self.model, self.opt, st, self.tok, name=step_name(done)) \
                if self.main else None
        if self.main:
            mark_latest(self.out_dir, path, self.cfg.keep)
        if self.world > 1:
            dist.barrier()
        return path

    def fit(self, signals: StopSignals, progress: bool = True) -> dict:
        """The loop: steps, log lines at the cadence, validation and checkpoints; returns the run's summary."""
        cfg, start = self.cfg, self.start
        bar = tqdm(total=cfg.steps, initial=start, disable=not (progress and self.main), file=sys.stderr,
                   desc="train", dynamic_ncols=True, leave=True)
        first_loss = ckpt_path = stopped = None
        window_tokens, window_time, train_time, done = 0, 0.0, 0.0, start
        self.model.train()
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            out = self.train_step(step)
            done = step + 1
            self.tokens_seen += self.tokens_per_step
            dt = time.perf_counter() - t0
            window_time, window_tokens, train_time = window_time + dt, window_tokens + self.tokens_per_step, \
                train_time + dt
            bar.update(1)
            is_last = done == cfg.steps
            do_eval = cfg.eval_tokens != 0 and (is_last or (cfg.eval_every and done % cfg.eval_every == 0))
            do_save = is_last or (cfg.save_every and done % cfg.save_every == 0)
            do_log = done % cfg.log_every == 0 or done == 1
            if do_log or do_eval or do_save or done == start + 1:     # the first step's loss is the summary's
                self.read(out)
                first_loss = self.loss_val if first_loss is None else first_loss
                bar.set_postfix(loss=f"{self.loss_val:.4f}", lr=f"{cfg.lr_for(step):.2e}",
                                tok_s=f"{window_tokens / window_time:,.0f}")
            row_eval = self._eval(done, bar) if do_eval else {}
            if self.main and (do_log or do_eval):
                self._log(done, cfg.lr_for(step), window_tokens / window_time, row_eval)
                window_tokens, window_time = 0, 0.0
            if signals.requested(self.world, self.device):  # SIGTERM / SIGINT: this step is done; save it, leave
                self.read(out)
                stopped = signals.received
                ckpt_path = self.save(done, last=True)
                break
            if do_save:
                ckpt_path = self.save(done, last=is_last)
        bar.close()
        return self._summary(start, done if stopped else cfg.steps, stopped, first_loss, train_time, ckpt_path)

    def _eval(self, done: int, bar) -> dict:
        self.val = val = self.validate()
        line = f"step {done:>6}  train loss {self.loss_val:.4f}  {describe(val)}"
        if self.main and bar.disable:  # --no-progress hides the bar, not the validation lines
            print(line, file=sys.stderr, flush=True)
        elif self.main:
            bar.write(line, file=sys.stderr)
        return {"val_loss": val["loss"], "val_ppl": val["ppl"], "val_tokens": val["tokens"], "val_bpb": val["bpb"]}

    def _log(self, done: int, lr: float, tokens_per_s: float, row_eval: dict):
        row = {"step": done, "loss": self.loss_val, "lr": lr, "tokens_per_s": tokens_per_s, "tokens": self.tokens_seen,
               "nan_skipped": self.nan_skipped, "val_loss": None, "val_ppl": None, **row_eval}
        if self.kl_val is not None:
            row["indexer_kl"] = self.kl_val
        _write_metrics(self.metrics_path, [row], "a")

    def _summary(self, start, end, stopped, first_loss, train_time, ckpt_path) -> dict:
        val = self.val
        return {"steps": end, "stopped": stopped, "nan_skipped": self.nan_skipped, "start_step": start,
                "first_loss": first_loss, "loss": self.loss_val, "indexer_kl": self.kl_val,
                "val_loss": val and val["loss"], "val_ppl": val and val["ppl"], "val_tokens": val and val["tokens"],
                "val_bpb": val and val["bpb"], "val_whole": val and val["whole"], "tokens_seen": self.tokens_seen,
                "train_time_s": train_time,
                "tokens_per_s": (end - start) * self.tokens_per_step / train_time if train_time else None,
                "params": self.model.num_parameters(), "checkpoint": ckpt_path, "out_dir": self.out_dir}
