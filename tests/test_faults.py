"""Training survives what kills jobs: SIGKILL (resume reproduces the loss curve), SIGTERM/SIGINT (checkpoint at
the current step, exit 0), damaged bytes (refused, naming the file), a kill during a save (the previous
checkpoint loads), a full disk, an unwritable output directory, and NaN losses (--on-nan stop|skip)."""
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from hybridlm import CausalLM, CheckpointError, presets
from hybridlm.data.loader import TokenData
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.train import TrainConfig, load_checkpoint, load_pretrained, train
from hybridlm.checkpoint import files as ckpt_mod
from hybridlm.checkpoint import ensure_writable, find_checkpoint, save_step_checkpoint
from hybridlm.optim import make_optimizer

TINY = ["--preset", "transformer++", "--n-layers", "1", "--d-model", "32", "--set", "n_heads=2", "--seq-len", "32",
        "--batch-size", "4", "--warmup", "1", "--eval-every", "0", "--eval-tokens", "64", "--log-every", "1",
        "--no-progress"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def start(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hybridlm", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)


def metrics(out) -> list[dict]:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def wait_for_step(proc, out, step, timeout=120) -> int:
    """Poll metrics.jsonl until it shows `step` (returns the step seen) or the process ends."""
    end = time.time() + timeout
    while time.time() < end:
        rows = metrics(out)
        if rows and rows[-1]["step"] >= step:
            return rows[-1]["step"]
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.02)
    raise TimeoutError(f"no step {step} in {out}")


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("faults") / "code.py"
    path.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(600)))
    return path


@pytest.mark.slow
def test_sigkill_then_resume_reproduces_the_loss_curve(tmp_path, text):
    full = start("train", *TINY, "--data", text, "--steps", 40, "--save-every", 5, "--out", tmp_path / "full")
    part = start("train", *TINY, "--data", text, "--steps", 40, "--save-every", 5, "--out", tmp_path / "part")
    wait_for_step(part, tmp_path / "part", random.randint(7, 20))
    part.kill()
    part.wait()
    assert full.wait(timeout=300) == 0, full.stderr.read()
    killed_at = metrics(tmp_path / "part")[-1]["step"]
    resumed = start("train", *TINY, "--data", text, "--steps", 40, "--out", tmp_path / "part", "--resume")
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()
    a, b = metrics(tmp_path / "full"), metrics(tmp_path / "part")
    assert [r["step"] for r in b] == list(range(1, 41)) and killed_at < 40
    assert [r["loss"] for r in a] == [r["loss"] for r in b]


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_signal_saves_the_current_step_and_exits_0(tmp_path, text, sig):
    out = tmp_path / "run"
    proc = start("train", *TINY, "--data", text, "--steps", 100_000, "--save-every", 0, "--out", out)
    seen = wait_for_step(proc, out, 3)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    last = metrics(out)[-1]["step"]
    assert seen <= last < seen + 3  # the step in flight finished, no further ones ran
    assert f"stopped by {sig.name} after step {last}" in stdout
    ckpt = find_checkpoint(str(out))
    assert os.path.basename(ckpt) == f"step-{last:06d}" and load_checkpoint(str(out))[1]["step"] == last


def tiny_model():
    return CausalLM(presets.get("transformer++", n_layers=1, d_model=32, n_heads=2, vocab_size=257))


def test_flipped_bytes_in_any_checkpoint_file_are_refused(tmp_path, capsys):
    model = tiny_model()
    opt = make_optimizer(model, 1e-3)
    model(torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long)).loss.backward()
    opt.step()
    good = save_step_checkpoint(str(tmp_path / "run"), 1, model, opt, {"loss": 1.0}, ByteTokenizer())
    names = sorted(os.listdir(good))
    assert {"config.json", "manifest.json", "model.safetensors", "optimizer.safetensors", "tokenizer_config.json",
            "trainer_state.json"} <= set(names)
    for name in names:
        bad = str(tmp_path / f"bad-{name}")
        shutil.copytree(good, bad)
        with open(os.path.join(bad, name), "r+b") as f:
            f.seek(os.path.getsize(f.name) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
        for load in (load_checkpoint, load_pretrained):
            with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
                load(bad)
    shutil.copytree(good, tmp_path / "step-000001")
    os.remove(tmp_path / "step-000001" / "manifest.json")  # a step directory never goes unchecked
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        load_checkpoint(str(tmp_path / "step-000001"))
    # and on the command line: one line naming the file, exit 2
    from hybridlm.cli import main
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path / "bad-model.safetensors"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.safetensors is damaged" in err, err


SAVER = textwrap.dedent("""
    import sys, torch
    from hybridlm import CausalLM, presets
    from hybridlm.data.tokenizer import ByteTokenizer
    from hybridlm.checkpoint import find_checkpoint, load_checkpoint, save_step_checkpoint
    from hybridlm.optim import make_optimizer
    run = sys.argv[1]
    model = CausalLM(presets.get("transformer++", n_layers=4, d_model=256, n_heads=4, vocab_size=257))
    opt = make_optimizer(model, 1e-3)
    model(torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long)).loss.backward()
    opt.step()
    try:
        step = load_checkpoint(run)[1]["step"] + 1
    except Exception:
        step = 1
    print("ready", flush=True)
    while True:  # every saved step stamps its number into the weights
        with torch.no_grad():
            model.embed.weight[0, 0] = step
        save_step_checkpoint(run, step, model, opt, {}, ByteTokenizer(), keep=2)
        step += 1
""")


@pytest.mark.slow
def test_sigkill_during_saves_always_leaves_a_loadable_checkpoint(tmp_path):
    run, rng, partial = str(tmp_path / "run"), random.Random(0), 0
    for trial in range(4):
        proc = subprocess.Popen([sys.executable, "-c", SAVER, run], stdout=subprocess.PIPE, text=True, env=ENV)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.2, 1.0))  # several saves in, then a kill at some point of one
        proc.kill()
        proc.wait()
        partial += any("-tmp-" in n or n.endswith("-deleting") for n in os.listdir(run))
        model, state = load_checkpoint(run)  # manifest verified: nothing partial is ever picked
        assert model.embed.weight[0, 0].item() == state["step"] >= 1
        assert ckpt_mod.STEP_DIR.match(os.path.basename(state["checkpoint_dir"]))  # never a -tmp- or -deleting one
    assert partial  # the loop body is a save: kills land inside one (a half-written or half-deleted directory)


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model = tiny_model()
    opt = make_optimizer(model, 1e-3)
    save_step_checkpoint(str(tmp_path), 1, model, opt, {}, ByteTokenizer())
    before = sorted(os.listdir(tmp_path))

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt_mod, "_save_optimizer", full)
    with torch.no_grad():
        model.embed.weight.add_(1.0)
    with pytest.raises(CheckpointError, match="No space left on device.*previous checkpoint .* is intact"):
        save_step_checkpoint(str(tmp_path), 2, model, opt, {}, ByteTokenizer())
    assert sorted(os.listdir(tmp_path)) == before  # no partial directory, latest unchanged
    loaded, state = load_checkpoint(str(tmp_path))
    assert state["step"] == 1 and not torch.equal(loaded.embed.weight, model.embed.weight)


def test_keep_prunes_old_steps_and_latest_follows(tmp_path):
    model = tiny_model()
    for step in (2, 4, 6, 8):
        save_step_checkpoint(str(tmp_path), step, model, None, {}, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "latest", "model.safetensors.index.json",
                                            "modeling_hybridlm.py", "step-000006", "step-000008"]
    assert load_checkpoint(str(tmp_path))[1]["step"] == 8
    index = json.load(open(tmp_path / "model.safetensors.index.json"))        # transformers' view of the run
    assert set(index["weight_map"].values()) == {"step-000008/model.safetensors"}
    os.remove(tmp_path / "latest")  # a lost pointer falls back to the newest complete step
    assert find_checkpoint(str(tmp_path)).endswith("step-000008")


def test_unwritable_output_is_one_line_before_training(tmp_path, text, capsys, monkeypatch):
    from hybridlm.cli import main
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setattr(CausalLM, "forward", lambda *a, **kw: pytest.fail("trained"))
    assert main(["train", *TINY, "--data", str(text), "--steps", "1000", "--out", str(blocker / "run")]) == 2
    err = capsys.readouterr().err
    assert err == f"hybridlm: error: output directory {blocker / 'run'} cannot be created: {blocker} is a file\n"
    with pytest.raises(CheckpointError, match="is a file"):
        ensure_writable(str(blocker))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_output_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    with pytest.raises(CheckpointError, match="not writable"):
        ensure_writable(str(ro / "run"))


# --- NaN / Inf losses --------------------------------------------------------------------------------------
@pytest.fixture
def nan_at_step_3(monkeypatch):
    """Training forwards return a NaN loss in step 3 (the third call with labels in train mode)."""
    real, calls = CausalLM.forward, {"n": 0}

    def forward(self, *a, **kw):
        out = real(self, *a, **kw)
        if self.training and kw.get("labels") is not None:
            calls["n"] += 1
            if calls["n"] == 3:
                out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(CausalLM, "forward", forward)


def _nan_run(tmp_path, on_nan):
    data = TokenData.from_corpus(type("C", (), {"train": ["abc def " * 200], "val": ["ghi " * 50],
                                                "source": "mem"})(), ByteTokenizer())
    mcfg = presets.get("transformer++", n_layers=1, d_model=32, n_heads=2, vocab_size=257)
    cfg = TrainConfig(steps=5, batch_size=2, seq_len=16, warmup=1, eval_every=0, eval_tokens=64, log_every=1,
                      on_nan=on_nan)
    return train(mcfg, cfg, data, str(tmp_path), progress=False), mcfg


def test_nan_loss_skip_counts_and_leaves_weights(tmp_path, nan_at_step_3, capsys):
    s, _ = _nan_run(tmp_path, "skip")
    assert s["nan_skipped"] == 1 and s["steps"] == 5 and torch.isfinite(torch.tensor(s["loss"]))
    rows = metrics(tmp_path)
    assert [r["nan_skipped"] for r in rows] == [0, 0, 1, 1, 1]
    assert load_checkpoint(str(tmp_path))[1]["nan_skipped"] == 1
    assert all(torch.isfinite(p).all() for p in load_checkpoint(str(tmp_path))[0].parameters())
    assert "step 3: loss nan" in capsys.readouterr().err


def test_nan_loss_stop_names_the_step(tmp_path, nan_at_step_3):
    with pytest.raises(FloatingPointError, match="loss nan .* at step 3"):
        _nan_run(tmp_path, "stop")


def _descendants(pid: int) -> list[int]:
    kids = []
    for p in os.listdir("/proc"):
        try:
            with open(f"/proc/{p}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            kids += [int(p), *_descendants(int(p))]
    return kids


def _rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return None
    return int(env[b"RANK"]) if b"RANK" in env and b"LOCAL_RANK" in env else None


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the rank-1 worker through /proc")
def test_sigterm_to_one_ddp_rank_stops_both_at_the_same_step(tmp_path, text):
    out = tmp_path / "ddp"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                             "29541", "-m", "hybridlm", "train", *TINY, "--data", str(text), "--steps", "100000",
                             "--save-every", "0", "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV)
    seen = wait_for_step(proc, out, 3, timeout=300)
    rank1 = [p for p in _descendants(proc.pid) if _rank_of(p) == 1]
    assert len(rank1) == 1
    os.kill(rank1[0], signal.SIGTERM)  # only rank 1 hears it; rank 0 learns through the all-reduced flag
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    last = metrics(out)[-1]["step"]
    assert seen <= last and f"stopped by a signal on another rank after step {last}" in stdout
    assert load_checkpoint(str(out))[1]["step"] == last
