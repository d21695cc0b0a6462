"""Optimiser groups and schedules, the training loop (falling loss, exact resume), checkpoints (round trip,
atomic writes, corrupt files) and perplexity."""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from hybridlm import CausalLM, CheckpointError, ModelConfig, presets
from hybridlm.data.corpus import stdlib_corpus
from hybridlm.data.loader import TokenData
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.eval.perplexity import perplexity
from hybridlm.train import TrainConfig, load_checkpoint, load_pretrained, lr_at, param_groups, save_checkpoint, train
from hybridlm.checkpoint import files as ckpt_mod
from hybridlm.checkpoint import load_optimizer
from hybridlm.optim import make_optimizer


def tiny_config(preset="mamba2-attention", **kw):
    base = dict(n_layers=2, d_model=32, vocab_size=257, max_seq_len=64, n_heads=2)
    if preset.startswith("mamba2"):
        base.update(ssd_headdim=16, ssd_d_state=16, ssd_chunk_size=16)
    return presets.get(preset, **{**base, **kw})


@pytest.fixture(scope="module")
def data():
    return TokenData.from_corpus(stdlib_corpus(max_bytes=400_000), ByteTokenizer())


def fast_cfg(**kw):
    base = dict(steps=8, batch_size=4, seq_len=32, lr=3e-3, warmup=2, eval_every=4, eval_tokens=2000, save_every=4,
                log_every=1, seed=1)
    return TrainConfig(**{**base, **kw})


def read_metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# --- optimiser and schedule --------------------------------------------------------------------------------
def test_schedules():
    kw = dict(lr=1.0, total=100, warmup=10, min_lr=0.1)
    assert lr_at(0, **kw) == pytest.approx(0.1) and lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(10, **kw) == pytest.approx(1.0) and lr_at(99, **kw) == pytest.approx(0.1)
    assert lr_at(10, **kw) > lr_at(50, **kw) > lr_at(90, **kw)
    wsd = dict(kw, schedule="wsd")
    assert lr_at(50, **wsd) == 1.0 and lr_at(79, **wsd) == 1.0
    assert lr_at(80, **wsd) < 1.0 and lr_at(99, **wsd) == pytest.approx(0.1)
    assert lr_at(60, **dict(kw, schedule="constant")) == 1.0


def test_no_decay_on_norms_biases_and_ssd_parameters():
    model = CausalLM(tiny_config())
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    plain = {names[id(p)] for p in no_decay["params"]}
    assert "embed.weight" in decayed and any("in_proj" in n for n in decayed)
    assert all(not n.endswith(("A_log", "D", "dt_bias", "norm.weight", "bias")) for n in decayed)
    assert any(n.endswith("A_log") for n in plain) and any(n.endswith("dt_bias") for n in plain)
    total = sum(p.numel() for g in (decay, no_decay) for p in g["params"])
    assert total == model.num_parameters()  # the tied lm_head/embedding counted once


# --- training loop -------------------------------------------------------------------------------------------
def test_loss_falls(tmp_path, data):
    s = train(tiny_config(), fast_cfg(steps=30, eval_every=0, save_every=0, log_every=5), data, str(tmp_path),
              progress=False)
    rows = read_metrics(str(tmp_path))
    assert rows[0]["step"] == 1 and rows[-1]["step"] == 30 and rows[-1]["val_loss"] is not None
    assert s["loss"] < s["first_loss"] - 1.5, (s["first_loss"], s["loss"])
    assert s["val_ppl"] == pytest.approx(math.exp(s["val_loss"]))
    assert s["tokens_seen"] == 30 * 4 * 32


def test_resume_reproduces_the_loss_curve(tmp_path, data, monkeypatch):
    cfg, mcfg = fast_cfg(grad_accum=2), tiny_config()
    train(mcfg, cfg, data, str(tmp_path / "full"), progress=False)
    full = read_metrics(str(tmp_path / "full"))

    calls = {"n": 0}
    real = TokenData.get_batch

    def crash_in_step_6(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] > 5 * cfg.grad_accum:
            raise RuntimeError("simulated crash")
        return real(self, *a, **kw)

    monkeypatch.setattr(TokenData, "get_batch", crash_in_step_6)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(mcfg, cfg, data, str(tmp_path / "part"), progress=False)
    monkeypatch.setattr(TokenData, "get_batch", real)
    assert json.load(open(tmp_path / "part" / "step-000004" / "trainer_state.json"))["step"] == 4
    s = train(mcfg, cfg, data, str(tmp_path / "part"), resume=True, progress=False)
    assert s["start_step"] == 4
    resumed = read_metrics(str(tmp_path / "part"))
    assert [r["step"] for r in resumed] == [r["step"] for r in full]
    for a, b in zip(full, resumed):
        assert a["loss"] == b["loss"] and a["lr"] == b["lr"] and a["val_loss"] == b["val_loss"], (a, b)
    m_full, _ = load_checkpoint(str(tmp_path / "full"))
    m_res, _ = load_checkpoint(str(tmp_path / "part"))
    for (n, p), q in zip(m_full.state_dict().items(), m_res.state_dict().values()):
        assert torch.equal(p, q), n


def test_resume_without_checkpoint_is_a_checkpoint_error(tmp_path, data):
    with pytest.raises(CheckpointError, match="does not exist|no checkpoint"):
        train(tiny_config(), fast_cfg(), data, str(tmp_path / "never"), resume=True, progress=False)


# --- checkpoints -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["mamba2-attention", "transformer++"])  # tied and untied embeddings
def test_checkpoint_round_trip_identical_logits(tmp_path, preset):
    model = CausalLM(tiny_config(preset))
    opt = make_optimizer(model, 1e-3)
    x = torch.randint(0, 257, (2, 20))
    model(x, labels=x).loss.backward()
    opt.step()
    save_checkpoint(str(tmp_path), model, opt, {"step": 1}, ByteTokenizer())
    loaded, state = load_checkpoint(str(tmp_path))
    assert state["step"] == 1 and loaded.config == model.config
    assert torch.equal(model(x).logits, loaded(x).logits)
    if model.config.tie_embeddings:
        assert loaded.lm_head.weight is loaded.embed.weight
    opt2 = make_optimizer(loaded, 1e-3)
    load_optimizer(opt2, state["checkpoint_dir"])
    a, b = opt.state_dict(), opt2.state_dict()
    for i, st in a["state"].items():
        for k, v in st.items():
            assert torch.equal(v, b["state"][i][k])
    m2, tok = load_pretrained(str(tmp_path))
    assert isinstance(tok, ByteTokenizer) and not m2.training


def test_checkpoint_config_is_transformers_and_the_bare_config_of_old_checkpoints_still_loads(tmp_path):
    model = CausalLM(tiny_config())
    path = save_checkpoint(str(tmp_path / "new"), model, None, {"step": 1}, ByteTokenizer())
    cfg = json.load(open(os.path.join(path, "config.json")))
    assert cfg["model_type"] == "hybridlm" and cfg["architectures"] == ["HybridLMForCausalLM"]
    assert ModelConfig.from_dict(cfg["hybridlm"]) == model.config
    assert cfg["eos_token_id"] == 256 and cfg["hidden_size"] == 32 and cfg["dtype"] == "float32"
    old = str(tmp_path / "old" / "checkpoint")                     # as written before: config.json = the ModelConfig
    shutil.copytree(path, old)
    with open(os.path.join(old, "config.json"), "w") as f:
        json.dump(model.config.to_dict(), f)
    ckpt_mod.write_manifest(old)
    x = torch.randint(0, 257, (1, 9))
    assert torch.equal(load_checkpoint(str(tmp_path / "old"))[0](x).logits, model(x).logits)
    with open(os.path.join(old, "config.json"), "w") as f:      # another model's transformers directory
        json.dump({"model_type": "llama", "hidden_size": 32}, f)
    ckpt_mod.write_manifest(old)
    with pytest.raises(CheckpointError, match="'llama' config, not a hybridlm checkpoint"):
        load_checkpoint(old)


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model = CausalLM(tiny_config())
    opt = make_optimizer(model, 1e-3)
    save_checkpoint(str(tmp_path), model, opt, {"step": 1}, ByteTokenizer())
    before = sorted(os.listdir(tmp_path / "checkpoint"))

    def boom(*a, **kw):
        raise KeyboardInterrupt  # e.g. Ctrl-C while the optimizer state is being written

    monkeypatch.setattr(ckpt_mod, "_save_optimizer", boom)
    with torch.no_grad():
        model.embed.weight.add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(str(tmp_path), model, opt, {"step": 2}, ByteTokenizer())
    assert os.listdir(tmp_path) == ["checkpoint"]  # no partial or temporary directory left
    assert sorted(os.listdir(tmp_path / "checkpoint")) == before
    loaded, state = load_checkpoint(str(tmp_path))
    assert state["step"] == 1 and not torch.equal(loaded.embed.weight, model.embed.weight)


def test_checkpoint_moved_aside_mid_swap_is_still_found(tmp_path):
    model = CausalLM(tiny_config())
    save_checkpoint(str(tmp_path), model, None, {"step": 3})
    os.makedirs(tmp_path / "checkpoint-old-x")
    os.replace(tmp_path / "checkpoint", tmp_path / "checkpoint-old-x" / "checkpoint")  # killed between renames
    assert load_checkpoint(str(tmp_path))[1]["step"] == 3


def test_missing_and_corrupt_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(str(tmp_path / "nowhere"))
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(str(tmp_path))
    model = CausalLM(tiny_config())
    good = save_checkpoint(str(tmp_path / "good"), model, None, {"step": 1}, ByteTokenizer())

    def broken(name, damage):  # without its manifest (as written before manifests), so the parsers are reached
        d = str(tmp_path / name)
        shutil.copytree(good, d)
        os.remove(os.path.join(d, "manifest.json"))
        damage(d)
        return d

    def truncate(d):
        path = os.path.join(d, "model.safetensors")
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])

    cases = [
        (broken("trunc", truncate), "model.safetensors.*corrupt or truncated"),
        (broken("nomodel", lambda d: os.remove(os.path.join(d, "model.safetensors"))), "model.safetensors is missing"),
        (broken("badjson", lambda d: open(os.path.join(d, "config.json"), "w").write("{oops")),
         "config.json is not valid JSON"),
        (broken("badcfg", lambda d: open(os.path.join(d, "config.json"), "w").write('{"layout": "(AM"}')),
         "config.json: invalid model config"),
        (broken("badstate", lambda d: open(os.path.join(d, "trainer_state.json"), "w").write("[1,")),
         "trainer_state.json is not valid JSON"),
    ]
    for path, msg in cases:
        with pytest.raises(CheckpointError, match=msg):
            load_checkpoint(path)
    other = CausalLM(tiny_config(d_model=64))
    save_checkpoint(str(tmp_path / "mismatch"), other, None, {})
    shutil.copy(os.path.join(good, "config.json"), tmp_path / "mismatch" / "checkpoint" / "config.json")
    os.remove(tmp_path / "mismatch" / "checkpoint" / "manifest.json")
    with pytest.raises(CheckpointError, match="does not match"):
        load_checkpoint(str(tmp_path / "mismatch"))


# --- perplexity ----------------------------------------------------------------------------------------------
def test_perplexity_counts_every_token_once():
    model = CausalLM(tiny_config()).eval()
    tok = ByteTokenizer()
    text = "def f(x):\n    return x * 2\n" * 5
    r = perplexity(model, text, tok, seq_len=16, batch_size=3)
    assert r["tokens"] == len(text.encode()) and r["ppl"] == pytest.approx(math.exp(r["loss"]))
    assert 4.0 < r["loss"] < 7.0  # about log(257) for an untrained model
    r2 = perplexity(model, torch.tensor(tok.encode(text) + [tok.eos_id]), tok, seq_len=16, batch_size=3)
    assert r2 == pytest.approx(r)


# --- distributed -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_ddp_two_processes_on_cpu(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 400)
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
           "-m", "hybridlm", "train", "--preset", "transformer++", "--n-layers", "1", "--d-model", "32",
           "--set", "n_heads=2", "--data", str(text), "--steps", "3", "--seq-len", "32", "--batch-size", "2",
           "--eval-tokens", "200", "--out", str(out), "--no-progress"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(str(out))
    assert rows[-1]["step"] == 3 and rows[-1]["tokens"] == 3 * 2 * 32 * 2  # both ranks' tokens counted
    assert json.load(open(out / "step-000003" / "trainer_state.json"))["step"] == 3


def test_indexer_warmup_stage_from_a_checkpoint_trains_only_the_indexers(tmp_path, data):
    """DeepSeek-V3.2's order: a trained model, then `stage=indexer-warmup` from its weights (`init_from`): only the
    indexers move, and every logged step carries indexer_kl."""
    from safetensors.torch import load_file
    cfg = tiny_config("deepseek-sparse", dsa_topk=8)
    first = train(cfg, fast_cfg(steps=3, eval_every=0, save_every=0), data, str(tmp_path / "a"), progress=False)
    assert all("indexer_kl" in r for r in read_metrics(tmp_path / "a"))
    warm = train(cfg, fast_cfg(steps=3, eval_every=0, save_every=0, stage="indexer-warmup",
                               init_from=str(tmp_path / "a")), data, str(tmp_path / "b"), progress=False)
    before = load_file(os.path.join(first["checkpoint"], "model.safetensors"))
    after = load_file(os.path.join(warm["checkpoint"], "model.safetensors"))
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved and all(".indexer." in n for n in moved), moved
    assert {n for n in before if ".indexer." in n and n.endswith("wq.weight")} <= moved
    assert warm["indexer_kl"] > 0
    with pytest.raises(Exception, match="stage must be one of"):
        fast_cfg(stage="warmup")


def test_indexer_dense_steps_switch_to_top_k_after_n_steps(tmp_path, data, monkeypatch):
    from hybridlm.train import trainer
    seen = []

    def spy(model, dense):
        seen.append((len(read_metrics(tmp_path)) if os.path.exists(tmp_path / "metrics.jsonl") else 0, dense))
        return set_dense(model, dense)
    set_dense = trainer.set_dense
    monkeypatch.setattr(trainer, "set_dense", spy)
    train(tiny_config("deepseek-sparse", dsa_topk=8), fast_cfg(steps=4, eval_every=0, save_every=0,
                                                               indexer_dense_steps=2), data, str(tmp_path),
          progress=False)
    assert seen == [(0, True), (2, False)]          # dense before step 1, top-k from step 3 on
