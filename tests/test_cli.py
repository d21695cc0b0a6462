"""The `hybridlm` command end to end (subprocesses): train, resume, generate, eval, info, and one-line errors."""
import json
import os
import shutil
import subprocess
import sys

import pytest

TINY = ["--preset", "mamba2-attention", "--n-layers", "2", "--d-model", "32", "--set", "ssd_headdim=16",
        "--set", "ssd_d_state=16", "--set", "n_heads=2", "--set", "max_seq_len=64"]


def hybridlm(*args, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="2")
    return subprocess.run([sys.executable, "-m", "hybridlm", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def assert_one_line_error(r, *needles):
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("hybridlm: error: "), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny model trained for 4 steps on a small text file."""
    d = tmp_path_factory.mktemp("cli")
    text = d / "code.py"
    text.write_text("def add(a, b):\n    return a + b\n\n" * 300)
    out = d / "run"
    r = hybridlm("train", *TINY, "--data", text, "--steps", 4, "--seq-len", 32, "--batch-size", 4, "--warmup", 1,
                 "--eval-every", 2, "--eval-tokens", 400, "--save-every", 2, "--log-every", 1, "--out", out,
                 "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "done    step 4" in r.stdout
    assert not sys.platform.startswith("linux") or "allocator glibc keep: " in r.stdout   # the run header
    return {"dir": d, "out": out, "text": text}


def test_train_writes_checkpoint_and_metrics(run):
    ckpt = run["out"] / "step-000004"
    assert open(run["out"] / "latest").read().strip() == "step-000004" and os.path.isdir(run["out"] / "step-000002")
    assert sorted(os.listdir(ckpt)) == ["config.json", "manifest.json", "model.safetensors", "modeling_hybridlm.py",
                                        "optimizer.safetensors", "tokenizer.json", "tokenizer_config.json",
                                        "trainer_state.json"]
    rows = [json.loads(line) for line in open(run["out"] / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["val_ppl"] > 1
    cfg = json.load(open(ckpt / "config.json"))
    assert cfg["vocab_size"] == 257 and cfg["hybridlm"]["d_model"] == 32 and cfg["model_type"] == "hybridlm"


def test_resume_continues(run):
    r = hybridlm("train", "--data", run["text"], "--steps", 6, "--seq-len", 32, "--batch-size", 4, "--warmup", 1,
                 "--eval-every", 2, "--eval-tokens", 400, "--out", run["out"], "--resume", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert json.load(open(run["out"] / "step-000006" / "trainer_state.json"))["step"] == 6


def test_generate_streams(run):
    r = hybridlm("generate", "--checkpoint", run["out"], "--prompt", "def ", "--max-new-tokens", 20, "--seed", 3)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("def ") and len(r.stdout) > 4


def test_info_and_eval(run):
    r = hybridlm("info", "--checkpoint", run["out"], "--context", 8, 32)
    assert r.returncode == 0, r.stderr
    assert "parameters" in r.stdout and "bytes/token" in r.stdout and "SA" in r.stdout
    r = hybridlm("info", "--preset", "transformer++", "--d-model", 32, "--set", "n_heads=2", "--context", 4, 12)
    assert r.returncode == 0, r.stderr
    assert "1,024 bytes/token" in r.stdout  # 4 attention layers x (K + V) x 32 channels x 4 bytes
    r = hybridlm("eval", "--checkpoint", run["out"], "--data", run["text"], "--batch-size", 2)
    assert r.returncode == 0, r.stderr
    assert "ppl" in r.stdout
    assert_one_line_error(hybridlm("eval", "--checkpoint", run["out"], "--data", run["text"], "--attention-mass"),
                          "captured attention mass needs `I` layers")


def test_quantize_convert_generate_eval(run):
    q = run["dir"] / "int8"
    r = hybridlm("convert", "--checkpoint", run["out"], "--quantize", "int8", "--out", q)
    assert r.returncode == 0, r.stderr
    assert json.load(open(q / "checkpoint" / "config.json"))["quantization_config"]["scheme"] == "int8"
    r = hybridlm("generate", "--checkpoint", q, "--prompt", "def ", "--max-new-tokens", 8, "--temperature", 0)
    assert r.returncode == 0 and r.stdout.startswith("def "), r.stderr
    r = hybridlm("eval", "--checkpoint", run["out"], "--data", run["text"], "--batch-size", 2, "--quantize", "int4",
                 "--group-size", 32)
    assert r.returncode == 0 and "weights int4 (groups of 32)" in r.stdout, r.stderr
    assert_one_line_error(hybridlm("generate", "--checkpoint", q, "--quantize", "int4", "--max-new-tokens", 2),
                          "already quantized int8")


@pytest.mark.parametrize("cmd", sorted(__import__("hybridlm.cli").cli.COMMANDS))
def test_help(cmd):
    from hybridlm.cli import build_parser
    with pytest.raises(SystemExit) as e:
        build_parser([cmd]).parse_args([cmd, "--help"])
    assert e.value.code == 0


def test_bad_inputs_give_one_line_errors(run, tmp_path):
    assert_one_line_error(hybridlm("train", "--preset", "nope", "--steps", 1, "--out", tmp_path / "x"),
                          "unknown preset 'nope'")
    assert_one_line_error(hybridlm("info", "--preset", "transformer++", "--set", "layout=(AM"), "bad layout",
                          "missing ')'")
    assert_one_line_error(hybridlm("train", *TINY, "--set", "vocab_size=100", "--data", run["text"], "--steps", 1,
                                   "--out", tmp_path / "y"), "257", "vocab_size is 100")
    assert_one_line_error(hybridlm("train", "--data", tmp_path / "nowhere.txt", "--steps", 1, "--out", tmp_path / "z"),
                          "nowhere.txt")
    assert_one_line_error(hybridlm("generate", "--checkpoint", run["out"], "--max-new-tokens", 1000),
                          "exceeds max_seq_len 64")
    assert_one_line_error(hybridlm("generate", "--checkpoint", tmp_path / "missing"), "missing", "does not exist")
    bad = tmp_path / "corrupt"
    shutil.copytree(run["out"] / "step-000004", bad)
    with open(bad / "model.safetensors", "r+b") as f:
        f.truncate(100)
    assert_one_line_error(hybridlm("generate", "--checkpoint", bad), "model.safetensors", "damaged")
    assert_one_line_error(hybridlm("eval", "--checkpoint", bad), "model.safetensors")


def test_bpe_tokenizer_train_and_generate_in_process(tmp_path, capsys):
    from hybridlm.cli import main
    text = tmp_path / "notes.md"
    text.write_text("# Notes\n\nThe quick brown fox jumps over the lazy dog. Ünïcödé ✓\n" * 200)
    out = tmp_path / "bpe"
    assert main(["train", *TINY, "--tokenizer", "bpe:320", "--data", str(text), "--steps", "2", "--seq-len", "32",
                 "--batch-size", "2", "--eval-tokens", "200", "--out", str(out), "--no-progress"]) == 0
    assert os.path.exists(out / "step-000002" / "tokenizer.json")
    vocab = json.load(open(out / "step-000002" / "tokenizer_config.json"))["hybridlm"]["vocab_size"]
    assert 257 < vocab <= 320 and json.load(open(out / "step-000002" / "config.json"))["vocab_size"] == vocab
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(out), "--prompt", "The quick", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("The quick")
    assert main(["train", "--tokenizer", "bpe:x", "--data", str(text), "--out", str(tmp_path / "b2")]) == 2
    assert capsys.readouterr().err.strip() == \
        "hybridlm: error: bad tokenizer spec 'bpe:x': expected bpe:<vocab size>, e.g. bpe:4096"


def test_demo_smoke(tmp_path, capsys):
    from hybridlm.cli import main
    assert main(["demo", "--steps", "2", "--max-bytes", "200000", "--max-new-tokens", "5", "--no-progress",
                 "--out", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert "validation perplexity" in out and "sample (temperature" in out and "demo took" in out
