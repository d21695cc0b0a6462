"""Data parallelism (DDP, FSDP2), distributed checkpoints and context parallelism on CPU with gloo: two
processes (torch.multiprocessing) must reproduce the single-process losses, gradients and logits."""
import json
import os
import shutil
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import assert_close
from hybridlm import CausalLM, presets

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn, *args):
    """Run fn(rank, *args) on 2 gloo ranks; an assertion failing on any rank fails the test."""
    mp.spawn(_entry, args=(fn, _free_port(), args), nprocs=WORLD, join=True)


def tiny(preset, **kw):
    base = dict(n_layers=2, d_model=32, vocab_size=64, max_seq_len=128, n_heads=2)
    if preset.startswith("mamba2"):
        base.update(ssd_headdim=16, ssd_d_state=16, ssd_chunk_size=8)
    if preset == "rodimus":
        base.update(rodimus_d_state=16, rodimus_chunk_size=8)
    return presets.get(preset, **{**base, **kw})


def full_grads(model) -> dict:
    """name -> the whole gradient (FSDP2 holds a shard per rank: gather it)."""
    from hybridlm.train.parallel import clean_name
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        out[clean_name(n)] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return out


# --- DDP and FSDP2 ------------------------------------------------------------------------------------------
def _data_parallel(rank):
    from hybridlm.train.parallel import parallelize
    torch.manual_seed(0)
    ref = CausalLM(tiny("mamba2-attention"))
    ids = torch.randint(0, 64, (4, 24))
    loss = ref(ids, labels=ids).loss
    loss.backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    mine = ids[2 * rank: 2 * rank + 2]               # this rank's half of the global batch
    for mode, ckpt in (("ddp", False), ("fsdp", True)):
        model = CausalLM(tiny("mamba2-attention"))
        model.load_state_dict(ref.state_dict())
        par = parallelize(model, mode, world=WORLD, checkpointing=ckpt)
        part = par.module(mine, labels=mine).loss
        part.backward()
        dist.all_reduce(part := part.detach())
        assert_close(part / WORLD, loss, msg=f"{mode} loss")
        got = full_grads(model)
        for n, g in want.items():
            assert_close(got[n], g, rtol=1e-4, atol=1e-6, msg=f"{mode} grad {n}")


def test_ddp_and_fsdp_match_one_process():
    spawn(_data_parallel)


# --- context parallelism ------------------------------------------------------------------------------------
def _context_parallel(rank, preset_names):
    from hybridlm.train.context_parallel import all_reduce_grads, context_parallel_forward
    for name in preset_names:
        torch.manual_seed(0)
        model = CausalLM(tiny(name, n_layers=3) if name == "mamba2-attention" else tiny(name))
        ids = torch.randint(0, 64, (2, 40))          # 20 tokens per rank: not a multiple of the chunk size
        out = model(ids, labels=ids)
        out.loss.backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        cp = context_parallel_forward(model, ids, labels=ids)
        cp.loss.backward()
        all_reduce_grads(model)
        total = cp.loss.detach().clone()
        dist.all_reduce(total)
        assert_close(cp.logits, out.logits[:, cp.start: cp.start + 20], msg=f"{name} logits")
        assert_close(total, out.loss, msg=f"{name} loss")
        for n, p in model.named_parameters():
            assert_close(p.grad, want[n], rtol=1e-4, atol=1e-6, msg=f"{name} grad {n}")


def test_context_parallel_equals_one_rank():
    assert tiny("mamba2-attention", n_layers=3).layout.replace(" ", "").count("A") == 1
    spawn(_context_parallel, ["mamba2", "rodimus", "mamba2-attention"])
