"""Distributed checkpoints (torch.distributed.checkpoint, DCP) for FSDP2 training.

    DIR/checkpoint/
        dcp/                    model + AdamW state, one shard file per rank + .metadata (reshards on load)
        model.safetensors       the consolidated weights (written at the end of training, or by `consolidate`)
        config.json, trainer_state.json, tokenizer files   as in checkpoint.py

Every rank writes its own shards into a temporary directory that rank 0 chose; rank 0 then adds the JSON files
and renames the directory into place (checkpoint.publish), so a crash never leaves a partial checkpoint. Keys
are those of `get_state_dict` (plain parameter names, whatever wraps the model), so a checkpoint saved on N
ranks resumes on M ranks, under DDP, or in one process, and `load_checkpoint` reads the weights without
a process group when no consolidated file exists.
"""
import json
import os
import shutil
import struct
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

from ..errors import CheckpointError
from .files import (LATEST_FILE, MANIFEST_FILE, MODEL_FILE, _save_model, dedupe_tied, new_tmp_dir, publish,
                    verify_checkpoint, write_manifest, write_metadata, write_run_index)

DCP_DIR = "dcp"


def has_dcp(checkpoint_dir: str) -> bool:
    return os.path.isfile(os.path.join(checkpoint_dir, DCP_DIR, ".metadata"))


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


def save_full_weights(model: nn.Module, path: str):
    """model.safetensors of an FSDP2-sharded model, written by rank 0 one tensor at a time: every rank gathers each
    tensor in turn and rank 0 appends its bytes, so no rank holds more than one whole tensor (a full state dict on
    rank 0 would be the model's size again: 4 GB at 1B parameters). Every rank must call; the file is the one
    `_save_model` writes for the unsharded model (tied weights stored once, under the same names)."""
    sd = get_model_state_dict(model)                       # this rank's shards, under the plain parameter names
    box = [dedupe_tied(sd) if _rank0() else None]          # rank 0 decides; every rank gathers the same list
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    names, aliases = list(box[0][0]), box[0][1]
    f = None
    if _rank0():
        header, offset = {}, 0
        for n in names:
            t = sd[n]
            size = t.numel() * t.element_size()
            header[n] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                         "data_offsets": [offset, offset + size]}
            offset += size
        header["__metadata__"] = {"format": "pt", "aliases": json.dumps(aliases)}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)                      # the data starts 8-byte aligned
        f = open(path, "wb")
        f.write(struct.pack("<Q", len(raw)) + raw)
    try:
        for n in names:
            t = sd[n]
            whole = t.full_tensor() if isinstance(t, DTensor) else t     # a collective: every rank, same order
            if f is not None:
                f.write(whole.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().data)
            del whole
    finally:
        if f is not None:
            f.close()


def save_sharded_checkpoint(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict,
                            tokenizer=None, *, consolidate: bool = False, name: str = "checkpoint") -> str:
    """Every rank calls this with the (FSDP2-sharded) CausalLM. Writes `directory/name` with DCP shards of
    model + optimizer (and model.safetensors when `consolidate`); returns its path."""
    box = [new_tmp_dir(directory, name) if _rank0() else None]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    tmp = box[0]
    try:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(tmp, DCP_DIR))
        if consolidate:
            save_full_weights(model, os.path.join(tmp, MODEL_FILE))
        if _rank0():
            write_metadata(tmp, model.config, state, tokenizer)
            publish(tmp, directory, name)
    except BaseException:
        if _rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dist.is_initialized():
        dist.barrier()           # nobody reads the checkpoint before rank 0 has published it
    return os.path.join(directory, name)


def _load(state: dict, checkpoint_dir: str, no_dist: bool):
    path = os.path.join(checkpoint_dir, DCP_DIR)
    try:
        with warnings.catch_warnings():   # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=path, no_dist=no_dist)
    except Exception as e:  # DCP raises CheckpointException / RuntimeError with per-rank detail
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: cannot load the distributed checkpoint ({first})") from None


def load_dcp_weights(model: nn.Module, checkpoint_dir: str):
    """Weights of a DCP checkpoint into a plain, unsharded model, in this process alone (no process group)."""
    sd = get_model_state_dict(model)
    _load({"model": sd}, checkpoint_dir, no_dist=True)
    set_model_state_dict(model, sd)


def load_training_state(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint_dir: str):
    """Resume: model + optimizer from the DCP shards, resharded to however this run is parallelised (FSDP2
    on any number of ranks, DDP, one process). Every rank calls this."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    _load({"model": model_sd, "optim": optim_sd}, checkpoint_dir, no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def consolidate(checkpoint_dir: str) -> str:
    """Write model.safetensors next to the DCP shards of `checkpoint_dir` (one process); returns its path."""
    from ..models import CausalLM
    from .files import find_checkpoint, load_config
    ckpt = find_checkpoint(checkpoint_dir)
    verify_checkpoint(ckpt)  # the manifest is rewritten below: it must not bless damaged shards
    if not has_dcp(ckpt):
        raise CheckpointError(f"{ckpt} holds no distributed checkpoint ({DCP_DIR}/.metadata is missing)")
    with torch.device("meta"):
        model = CausalLM(load_config(ckpt))
    model.to_empty(device="cpu")     # no init: the shards fill every weight
    model.tie_weights()
    load_dcp_weights(model, ckpt)
    path = os.path.join(ckpt, MODEL_FILE)
    tmp = path + ".tmp"
    _save_model(model, tmp)
    os.replace(tmp, path)
    if os.path.exists(os.path.join(ckpt, MANIFEST_FILE)):
        write_manifest(ckpt)
    run, name = os.path.split(os.path.abspath(ckpt))
    latest = os.path.join(run, LATEST_FILE)
    if os.path.isfile(latest) and open(latest).read().strip() == name:
        write_run_index(run, ckpt)       # the run's latest step: transformers can now open the run directory
    return path
