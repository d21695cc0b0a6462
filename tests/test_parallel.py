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


# --- validation shared out among ranks ------------------------------------------------------------------------
def _val_stream():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (400,), generator=g)
    ids[::97] = 256                                   # documents: the state resets at each eos
    return ids.numpy()


def _validations(model):
    from hybridlm.data.tokenizer import ByteTokenizer
    from hybridlm.eval.perplexity import validate
    rank, world = (dist.get_rank(), WORLD) if dist.is_initialized() else (0, 1)
    # 13 windows of 32 (the last one cut): ranks get 7 and 6, so one runs an uncounted forward to keep in step
    return [validate(model, _val_stream(), ByteTokenizer(), 32, 4, max_tokens=m, rank=rank, world=world)
            for m in (None, 150)]


def _sharded_validation(rank, want):
    from hybridlm.train.parallel import parallelize
    for mode in ("none", "fsdp"):       # none: as under DDP, each rank runs its replica unwrapped
        torch.manual_seed(0)
        model = CausalLM(tiny("mamba2-attention", vocab_size=257))
        if mode == "fsdp":
            parallelize(model, mode, world=WORLD)
        for got, ref in zip(_validations(model), want):
            assert got["tokens"] == ref["tokens"] and got["whole"] == ref["whole"], (mode, got, ref)
            assert abs(got["loss"] - ref["loss"]) < 1e-5 and abs(got["bpb"] - ref["bpb"]) < 1e-5, (mode, got, ref)


def test_validation_shared_out_among_two_ranks_equals_one():
    torch.manual_seed(0)
    want = _validations(CausalLM(tiny("mamba2-attention", vocab_size=257)))
    assert want[0]["whole"] and not want[1]["whole"] and want[0]["tokens"] == 399
    spawn(_sharded_validation, want)
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
        cp = context_parallel_forward(model, ids, labels=ids, return_logits=True)
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
    with pytest.raises(ConfigError, match="does not support layer 'C'"):  # a conv tail alone has no message
        context_parallel_forward(CausalLM(tiny("mamba2", layout="CM")), ids)


def test_context_parallel_equals_one_rank():
    assert tiny("mamba2-attention", n_layers=3).layout.replace(" ", "").count("A") == 1
    spawn(_context_parallel, ["mamba2", "rodimus", "mamba2-attention"])


# --- context parallelism in the trainer ---------------------------------------------------------------------
CP_LAYOUTS = {"ssd": ("mamba2", {}), "gla": ("rodimus", {}), "attention": ("transformer++", {}),
              "mla": ("deepseek-mla", {}), "hybrid": ("mamba2-attention", {})}


def _docs(tmp) -> str:
    """Short documents (16-40 bytes): packed, they start anywhere in a window, across the ranks' boundary too."""
    path = os.path.join(tmp, "docs.jsonl")
    with open(path, "w") as f:
        for i in range(400):
            f.write(json.dumps({"text": f"x{i} = {i * 7 % 101}" + " + 1" * (i % 7)}) + "\n")
    return path


def _cp_cfg(name):
    preset, kw = CP_LAYOUTS[name]
    return tiny(preset, vocab_size=257, **kw)


def _cp_runs(rank, tmp, docs, names, resume):
    from hybridlm.train import train
    for name in names:
        kw = dict(parallel="auto", context_parallel=2, seq_len=32, eval_tokens=300)
        train(_cp_cfg(name), _train_cfg(**kw), _data(docs), f"{tmp}/{name}-cp", progress=False)
        if resume:      # 2 steps, then resumed to 4: the same curve as one 4-step run
            train(_cp_cfg(name), _train_cfg(steps=2, **kw), _data(docs), f"{tmp}/{name}-cut", progress=False)
            train(_cp_cfg(name), _train_cfg(**kw), _data(docs), f"{tmp}/{name}-cut", resume=True,
                  progress=False)


def check_cp_training(tmp_path, names, resume=False):
    """2 ranks splitting every sequence train as one process does: losses, validation and final weights."""
    from hybridlm.train import load_checkpoint, train
    docs = _docs(str(tmp_path))
    spawn(_cp_runs, str(tmp_path), docs, names, resume)
    for name in names:
        one = train(_cp_cfg(name), _train_cfg(parallel="auto", seq_len=32, eval_tokens=300), _data(docs),
                    str(tmp_path / f"{name}-one"), progress=False)
        want, got = _metrics(tmp_path / f"{name}-one"), _metrics(tmp_path / f"{name}-cp")
        assert [r["step"] for r in got] == [1, 2, 3, 4], name
        for a, b in zip(got, want):
            assert abs(a["loss"] - b["loss"]) < 1e-5, (name, a, b)
        assert abs(got[-1]["val_loss"] - one["val_loss"]) < 1e-5 and got[-1]["val_tokens"] == one["val_tokens"]
        cp_model, one_model = load_checkpoint(str(tmp_path / f"{name}-cp"))[0], load_checkpoint(one["checkpoint"])[0]
        for (n, p), q in zip(cp_model.named_parameters(), one_model.parameters()):
            assert_close(p, q, rtol=1e-4, atol=1e-5, msg=f"{name} {n}")
        if resume:
            assert [r["loss"] for r in _metrics(tmp_path / f"{name}-cut")] == [r["loss"] for r in got], name


def _metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_context_parallel_training_equals_one_process_and_resumes(tmp_path):
    check_cp_training(tmp_path, ["hybrid"], resume=True)


@pytest.mark.slow
def test_context_parallel_training_ssd_gla_attention_mla(tmp_path):
    check_cp_training(tmp_path, ["ssd", "gla", "attention", "mla"])


@pytest.mark.parametrize("letter,layout", [("C", "CM"), ("O", "AO")])
def test_context_parallel_refuses_uncovered_letters(letter, layout):
    from hybridlm import ModelConfig
    from hybridlm.train.context_parallel import check_layout
    check_layout(ModelConfig(layout="S A L I F W R G K B E M Z@0 S".replace(" ", ""), dsa_kl_weight=0.0))  # pass
    with pytest.raises(ConfigError, match="does not support layer .I. in layout .IM.: its lightning indexer trains"):
        check_layout(ModelConfig(layout="IM"))
    with pytest.raises(ConfigError, match=f"does not support layer '{letter}' in layout"):
        check_layout(ModelConfig(layout=layout))


def test_context_parallel_needs_ranks_to_split_over(tmp_path):
    from hybridlm.train import train
    with pytest.raises(ConfigError, match="--context-parallel 2 does not divide the 1 ranks"):
        train(tiny("mamba2", vocab_size=257), _train_cfg(parallel="auto", context_parallel=2), _data(_docs(tmp_path)),
              str(tmp_path))


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
    from hybridlm.checkpoint.dcp import load_training_state
    from hybridlm.optim import make_optimizer
    from hybridlm.train.parallel import parallelize
    data, cfg = _data(text_path), tiny("mamba2-attention", vocab_size=257)
    # sequential order: the 2 ranks read the 2 x 2 windows that one process reads as 2 micro-batches of 2
    train(cfg, _train_cfg(data_order="sequential"), data, f"{tmp}/whole", progress=False)
    train(cfg, _train_cfg(steps=2, data_order="sequential"), data, f"{tmp}/cut", progress=False)
    dist.barrier()
    if rank == 0:
        shutil.copytree(f"{tmp}/cut", f"{tmp}/cut1")       # resumed on one rank by the test itself
    dist.barrier()
    train(cfg, _train_cfg(data_order="sequential"), data, f"{tmp}/cut", resume=True, progress=False)
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
    from hybridlm.checkpoint import write_manifest
    from hybridlm.checkpoint.dcp import load_training_state
    from hybridlm.optim import make_optimizer
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
    # the final validation, shared out among the 2 ranks, is the one-process figure
    from hybridlm.eval.perplexity import validate
    data = _data(str(text))
    one = validate(consolidated, data.tokens("val"), data.tokenizer, 16, 8, max_tokens=256, seed=3)
    with open(tmp_path / "whole" / "metrics.jsonl") as f:
        last = [json.loads(line) for line in f][-1]
    assert last["val_tokens"] == one["tokens"] and abs(last["val_loss"] - one["loss"]) < 1e-5, (last, one)
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
    # ... and trains on with the uninterrupted run's losses: the same global batch (1 rank x 2 micro-batches of 2
    # = 2 ranks x 2) and, in sequential order, the same windows; AdamW's state resharded from 2 ranks to 1
    s = train(tiny("mamba2-attention", vocab_size=257), _train_cfg(parallel="auto", grad_accum=2,
                                                                     data_order="sequential"),
              _data(str(text)), str(cut1), resume=True, progress=False)
    assert s["start_step"] == 2 and s["steps"] == 4 and _losses(cut1)[:2] == whole[:2]
    assert_close(torch.tensor(_losses(cut1)), torch.tensor(whole), rtol=1e-5, atol=1e-6, msg="resumed on 1 rank")
