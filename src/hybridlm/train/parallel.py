"""Data parallelism applied to a built `CausalLM` from outside (the model never knows): activation
checkpointing per block, `torch.compile` per block, then DDP or FSDP2 `fully_shard`, in torchtitan's order.

    with torch.device("meta"):
        model = CausalLM(cfg)                      # no memory, no init: each rank initialises what it holds
    par = parallelize(model, "fsdp", world=2, device=dev, dtype="bfloat16", compile=True, checkpointing=True)
    loss = par.module(ids, labels=ids).loss        # what the training step calls
    opt = make_optimizer(model, ...)               # after sharding: the optimizer must see the sharded params

A model built on the meta device is materialised on `device` and initialised here (torchtitan's order): under FSDP2
after `fully_shard`, so a rank only ever allocates its shards, plus one part (embedding, block, head) whole at a time
while it is initialised (`_whole`); otherwise before DDP, which broadcasts rank 0's weights.

FSDP2 units: every block (and a module in it flagged `fsdp_unit`), the embedding, the final norm + lm_head
together, then the root (which keeps what is left: positional embedding, hyper-connection head). A tied lm_head
shares the embedding's weight, and a parameter lives in one unit, so with tied weights embedding, norm and lm_head
all stay in the root unit.
bf16 runs under FSDP2 use `MixedPrecisionPolicy`: parameters are gathered in bf16 for compute, gradients are
reduced in float32 and the sharded master weights stay float32 (recurrent states are float32 inside the ops).
"""
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError

MODES = ("auto", "ddp", "fsdp")
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


@dataclass
class Parallel:
    """What `parallelize` did. `module` is what a training step calls; `mode` is none | ddp | fsdp."""
    module: nn.Module
    mode: str
    mixed_precision: bool = False    # FSDP2 casts parameters itself: the caller must not autocast as well

    @property
    def sharded(self) -> bool:
        """Every rank must take part in forward passes and checkpoints (FSDP gathers parameters)."""
        return self.mode == "fsdp"


def clean_name(name: str) -> str:
    """A parameter name without the wrappers' prefixes (activation checkpointing, torch.compile)."""
    for p in _WRAPPER_PREFIXES:
        name = name.replace(p, "")
    return name


def apply_block_wrappers(model: nn.Module, checkpointing: bool, compile: bool):
    """Activation checkpointing, then torch.compile, on each block in place (module names keep their index)."""
    if checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        model.gradient_checkpointing = False     # the model's own switch would checkpoint twice
        for i, blk in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(blk)
    if compile:
        for blk in model.blocks:
            blk.compile()


def _fully_shard(model: nn.Module, dtype: str) -> bool:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = dtype == "bfloat16"
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp \
        else MixedPrecisionPolicy()
    last = len(model.blocks) - 1
    for i, blk in enumerate(model.blocks):
        # a module flagged `fsdp_unit` is a unit of its own: an output of its forward that leaves the block other
        # than through the block's output (the lightning indexer's scores -> its KL) still gets FSDP2's gather
        # before backward
        for m in blk.modules():
            if getattr(m, "fsdp_unit", False) and m is not blk:
                fully_shard(m, mp_policy=policy, reshard_after_forward=i < last)
        # the last block's parameters are needed again at once by backward: keep them gathered
        fully_shard(blk, mp_policy=policy, reshard_after_forward=i < last)
    if not model.config.tie_embeddings:
        fully_shard(model.embed, mp_policy=policy)
        fully_shard([model.norm, model.lm_head], mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mp_policy=policy)
    return mp


@contextmanager
def _whole(module: nn.Module):
    """`module`'s sharded parameters replaced by whole local tensors while it is initialised; on exit each rank keeps
    its shard of them. Every rank draws the same whole tensors (same seed, same order), so the sharded model is the
    one a single process initialises, without communication."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    slots = [(m, n, p) for m in module.modules() for n, p in m._parameters.items() if isinstance(p, DTensor)]
    whole = {}
    for m, n, p in slots:
        if id(p) not in whole:   # a tied tensor: one whole tensor too
            whole[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device))
        m._parameters[n] = whole[id(p)]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, n, p in slots:
                if id(p) in whole:
                    shard = distribute_tensor(whole.pop(id(p)).data, p.device_mesh, p.placements, src_data_rank=None)
                    p.to_local().copy_(shard.to_local())
                m._parameters[n] = p


def _materialise(model: nn.Module, device: torch.device | None, sharded: bool):
    """A model built on the meta device: allocate it (its shards) on `device` and initialise it."""
    if not any(p.is_meta for p in model.parameters()):
        return
    model.to_empty(device=device or torch.device("cpu"))
    model.init_weights(part=_whole if sharded else None)


def expects_unused_parameters(cfg) -> bool:
    """Whether DDP must look for parameters without a gradient each step (find_unused_parameters): some layer's
    letter says so (models/registry.py `unused_params`: routed experts that get no token, a frozen indexer)."""
    from ..models.registry import LETTERS, layer_configs, trait
    return any(trait(LETTERS[letter].unused_params, c) for letter, c in layer_configs(cfg))


def parallelize(model: nn.Module, mode: str = "auto", *, world: int = 1, device: torch.device | None = None,
                dtype: str = "float32", compile: bool = False, checkpointing: bool = False) -> Parallel:
    """Wrap `model` (on `device`, or on the meta device: then materialised and initialised here, see above) for
    training on `world` ranks. mode auto = ddp; with world 1 there is nothing to shard or synchronise, so only the
    per-block wrappers apply. Modifies `model` in place (FSDP2 swaps its parameters for sharded DTensors): build
    the optimizer afterwards."""
    if mode not in MODES:
        raise ConfigError(f"parallel must be one of {', '.join(MODES)}, got {mode!r}")
    apply_block_wrappers(model, checkpointing, compile)
    if world <= 1 or mode != "fsdp":
        _materialise(model, device, sharded=False)
    if world <= 1:
        return Parallel(model, "none")
    if not dist.is_initialized():
        raise ConfigError(f"parallel {mode} on {world} ranks needs torch.distributed initialised (run under torchrun)")
    if mode == "fsdp":
        if getattr(model, "_shared", None):   # one tensor in several per-block FSDP units cannot be sharded
            raise ConfigError("parallel fsdp does not support weight-shared layers (X@k in the layout): use ddp")
        mp = _fully_shard(model, dtype)
        _materialise(model, device, sharded=True)
        return Parallel(model, "fsdp", mixed_precision=mp)
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(model, device_ids=[device.index] if device is not None and device.type == "cuda" else None,
              find_unused_parameters=expects_unused_parameters(model.config))
    return Parallel(ddp, "ddp")
