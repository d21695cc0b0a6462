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

from hybridlm import CausalLM, ConfigError, InputError, presets

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
    for tied in (True, False):       # a tied lm_head stays in the root FSDP unit; an untied one gets its own
        torch.manual_seed(0)
        cfg = tiny("mamba2-attention", tie_embeddings=tied)
        ref = CausalLM(cfg)
        ids = torch.randint(0, 64, (4, 24))
        loss = ref(ids, labels=ids).loss
        loss.backward()
        want = {n: p.grad for n, p in ref.named_parameters()}
        mine = ids[2 * rank: 2 * rank + 2]               # this rank's half of the global batch
        for mode, ckpt in (("ddp", False), ("fsdp", True)):
            model = CausalLM(cfg)
            model.load_state_dict(ref.state_dict())
            par = parallelize(model, mode, world=WORLD, checkpointing=ckpt)
            part = par.module(mine, labels=mine).loss
            part.backward()
            dist.all_reduce(part := part.detach())
            assert_close(part / WORLD, loss, msg=f"{mode} loss")
            got = full_grads(model)
            for n, g in want.items():
                assert_close(got[n], g, rtol=1e-4, atol=1e-6, msg=f"{mode} grad {n}")
    # bf16 under FSDP2: bf16 compute from float32 master weights, gradients reduced in float32
    model = CausalLM(cfg)
    model.load_state_dict(ref.state_dict())
    par = parallelize(model, "fsdp", world=WORLD, dtype="bfloat16")
    part = par.module(mine, labels=mine).loss
    part.backward()
    dist.all_reduce(part := part.detach())
    assert par.mixed_precision and abs(part.item() / WORLD - loss.item()) < 0.05
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())


def test_ddp_and_fsdp_match_one_process():
    spawn(_data_parallel)


def _indexer_data_parallel(rank):
    """The lightning indexer's KL rides in the model's output: DDP and FSDP2 reproduce one process, in the sparse
    stage and in the warm-up (frozen main model, dense attention)."""
    from hybridlm.train.parallel import parallelize
    from hybridlm.train.stages import apply_stage
    torch.manual_seed(0)
    cfg = tiny("deepseek-sparse", dsa_topk=5)
    ids = torch.randint(0, 64, (4, 24))
    mine = ids[2 * rank: 2 * rank + 2]
    for stage, modes in (("full", ("ddp", "fsdp")), ("indexer-warmup", ("ddp", "fsdp"))):
        ref = CausalLM(cfg)
        apply_stage(ref, stage)
        out = ref(ids, labels=ids)
        out.loss.backward()
        want = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
        for mode in modes:
            model = CausalLM(cfg)
            model.load_state_dict(ref.state_dict())
            apply_stage(model, stage)
            par = parallelize(model, mode, world=WORLD)
            res = par.module(mine, labels=mine)
            res.loss.backward()
            kl = res.indexer_kl.detach()
            dist.all_reduce(kl)
            assert_close(kl / WORLD, out.indexer_kl, msg=f"{stage} {mode} indexer_kl")
            got = full_grads(model)
            assert {n for n, g in got.items() if g is not None} == set(want), f"{stage} {mode}: trained parameters"
            for n, g in want.items():
                assert_close(got[n], g, rtol=1e-4, atol=1e-6, msg=f"{stage} {mode} grad {n}")


def test_indexer_kl_under_ddp_and_fsdp_matches_one_process():
    spawn(_indexer_data_parallel)


# --- context parallelism ------------------------------------------------------------------------------------
def _context_parallel(rank, preset_names):
    from hybridlm.train.context_parallel import all_reduce_grads, context_parallel_forward
    for name in preset_names:
        torch.manual_seed(0)
        model = CausalLM(tiny(name, n_layers=3) if name == "mamba2-attention" else tiny(name))
        ids = torch.randint(0, 64, (2, 40))          # 20 tokens per rank: not a multiple of the chunk size
        out = model(ids, labels=ids, return_logits=True)
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
    with pytest.raises(InputError, match="divisible"):
        context_parallel_forward(model, ids[:, :39])
    with pytest.raises(ConfigError, match="does not support"):     # MLA's latent cache cannot be split this way
        context_parallel_forward(CausalLM(tiny("deepseek-mla", n_layers=1)), ids)


def test_context_parallel_equals_one_rank():
    assert tiny("mamba2-attention", n_layers=3).layout.replace(" ", "").count("A") == 1
    spawn(_context_parallel, ["mamba2", "rodimus", "mamba2-attention"])


# --- distributed checkpoints --------------------------------------------------------------------------------
def _data(text_path):
    from hybridlm.data.corpus import load_corpus
    from hybridlm.data.loader import TokenData
    from hybridlm.data.tokenizer import ByteTokenizer
    return TokenData.from_corpus(load_corpus(text_path), ByteTokenizer())


def _train_cfg(**kw):
    from hybridlm.train import TrainConfig
    base = dict(steps=4, batch_size=2, seq_len=16, lr=3e-3, warmup=1, eval_every=0, eval_tokens=256, save_every=0,
                log_every=1, seed=3, parallel="fsdp")
    return TrainConfig(**{**base, **kw})


def _fsdp_runs(rank, tmp, text_path):
    from hybridlm.train import train
    from hybridlm.train.dist_checkpoint import load_training_state
    from hybridlm.train.optim import make_optimizer
    from hybridlm.train.parallel import parallelize
    data, cfg = _data(text_path), tiny("mamba2-attention", vocab_size=257)
    train(cfg, _train_cfg(), data, f"{tmp}/whole", progress=False)
    train(cfg, _train_cfg(steps=2), data, f"{tmp}/cut", progress=False)
    dist.barrier()
    if rank == 0:
        shutil.copytree(f"{tmp}/cut", f"{tmp}/cut1")       # resumed on one rank by the test itself
    dist.barrier()
    train(cfg, _train_cfg(), data, f"{tmp}/cut", resume=True, progress=False)
    # the sharded model, loaded from the shards on 2 ranks: its logits must equal a one-process load's
    model = parallelize(CausalLM(cfg), "fsdp", world=WORLD).module
    load_training_state(model, make_optimizer(model, 1e-3), f"{tmp}/whole/step-000004")
    with torch.no_grad():
        logits = model(torch.arange(16)[None] * 7 % 257).logits
    if rank == 0:
        from safetensors.torch import save_file
        save_file({"logits": logits}, f"{tmp}/fsdp_logits.safetensors")


def _losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def test_fsdp_checkpoint_resumes_on_two_and_one_ranks_and_loads_in_one_process(tmp_path):
    from safetensors.torch import load_file

    from hybridlm.cli import main
    from hybridlm.train import load_checkpoint, train
    from hybridlm.train.checkpoint import write_manifest
    from hybridlm.train.dist_checkpoint import load_training_state
    from hybridlm.train.optim import make_optimizer
    text = tmp_path / "text.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x * {i} + 1\n" for i in range(300)))
    spawn(_fsdp_runs, str(tmp_path), str(text))
    whole, cut = _losses(tmp_path / "whole"), _losses(tmp_path / "cut")
    assert len(whole) == 4 and cut == whole                 # 2 steps, killed, 2 more on 2 ranks = 4 steps
    ckpt = tmp_path / "whole" / "step-000004"
    assert (ckpt / "dcp" / ".metadata").exists() and (ckpt / "model.safetensors").exists()

    # one process: the consolidated weights, the shards read directly, and the sharded model agree exactly
    ids = torch.arange(16)[None] * 7 % 257
    consolidated = load_checkpoint(str(ckpt))[0].eval()
    shutil.copytree(ckpt, tmp_path / "shards_only")
    os.remove(tmp_path / "shards_only" / "model.safetensors")
    write_manifest(str(tmp_path / "shards_only"))  # as a save without consolidation lists its files
    from_shards = load_checkpoint(str(tmp_path / "shards_only"))[0].eval()
    with torch.no_grad():
        want = consolidated(ids).logits
        assert torch.equal(from_shards(ids).logits, want)
    assert torch.equal(load_file(tmp_path / "fsdp_logits.safetensors")["logits"], want)
    assert main(["consolidate", str(tmp_path / "shards_only")]) == 0
    assert torch.equal(load_checkpoint(str(tmp_path / "shards_only"))[0].eval()(ids).logits, want)

    assert main(["consolidate", str(tmp_path / "whole" / "metrics.jsonl")]) == 2        # one-line error
    # a 2-rank FSDP checkpoint at step 2 resumes in one process: model and AdamW state come from the shards
    cut1 = tmp_path / "cut1"
    model = CausalLM(tiny("mamba2-attention", vocab_size=257))
    opt = make_optimizer(model, 1e-3)
    load_training_state(model, opt, str(cut1 / "step-000002"))
    assert all(int(s["step"]) == 2 for s in opt.state.values())
    assert torch.equal(model.embed.weight, load_checkpoint(str(cut1))[0].embed.weight)
    s = train(tiny("mamba2-attention", vocab_size=257), _train_cfg(steps=3, parallel="auto"),
              _data(str(text)), str(cut1), resume=True, progress=False)
    assert s["start_step"] == 2 and s["steps"] == 3 and _losses(cut1)[:2] == whole[:2]
