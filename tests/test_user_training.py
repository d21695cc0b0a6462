"""Training as a user meets it: one validation figure, data that cannot be misread, configs that say what they
are, the fused LM-head loss, and the CLI's allocator setting."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from hybridlm import CausalLM, ConfigError, presets
from hybridlm.cli import main
from hybridlm.data.corpus import load_corpus
from hybridlm.data.loader import eval_starts, load_data
from hybridlm.data.token_files import write_token_file
from hybridlm.eval.perplexity import evaluate_loss, validate
from hybridlm.ops.loss import cross_entropy_ref, linear_cross_entropy

TINY = ["--preset", "transformer++", "--n-layers", "1", "--d-model", "32", "--n-heads", "2", "--warmup", "1",
        "--seq-len", "32", "--batch-size", "4", "--no-progress"]


def one_line_error(capsys, argv, *needles):
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hybridlm: error:"), err
    for n in needles:
        assert n in err[0], err[0]


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "notes.txt"
    p.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(400)))
    return p


# --- validation ---------------------------------------------------------------------------------------------
def test_eval_starts_whole_and_sampled():
    starts, whole = eval_starts(1000, 33)
    assert whole and starts[1] - starts[0] == 32 and starts[-1] < 999
    covered = np.zeros(1000, bool)
    for s in starts:
        covered[s + 1: s + 33] = True
    assert covered[1:].all()                                     # every token after the first is predicted
    sample, whole = eval_starts(100_000, 33, max_tokens=3200, seed=3)
    assert not whole and len(sample) == 100 and (np.diff(sample) > 0).all()
    assert np.array_equal(sample, eval_starts(100_000, 33, max_tokens=3200, seed=3)[0])


def test_default_validation_is_the_whole_split_and_eval_agrees(tmp_path, text, capsys):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "3", "--data", str(text), "--out", str(out)]) == 0
    train_out = capsys.readouterr().out
    done = next(line for line in train_out.splitlines() if line.startswith("done"))
    # the default figure = an evaluation over every window of the validation split, done by hand
    from hybridlm.train import load_pretrained
    model, tok = load_pretrained(str(out))
    data = load_data(str(text), tok, 8_000_000)
    val = data.tokens("val")
    by_hand = evaluate_loss(model, data.sequential("val", 3, 32))
    assert by_hand["tokens"] == len(val) - 1
    r = validate(model, val, tok, seq_len=32, batch_size=4)
    assert r["whole"] and r["tokens"] == len(val) - 1 and r["loss"] == pytest.approx(by_hand["loss"], rel=1e-5)
    assert f"val loss {r['loss']:.4f}" in done and f"on {len(val) - 1:,} tokens (whole split)" in done
    assert main(["eval", "--checkpoint", str(out)]) == 0
    ev = capsys.readouterr().out
    assert f"val loss {r['loss']:.4f}" in ev and f"{len(val) - 1:,} tokens" in ev
    # --no-progress hides the bar only: validation lines still reach stderr
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert rows[-1]["val_tokens"] == len(val) - 1


def test_bits_per_byte_for_bpe(tmp_path, text):
    from hybridlm.data.tokenizer import BPETokenizer
    tok = BPETokenizer.train([text.read_text()], 300)
    ids = np.array(tok.encode(text.read_text()[:3000]) + [tok.eos_id])
    model = CausalLM(presets.get("transformer++", n_layers=1, d_model=32, n_heads=2, vocab_size=tok.vocab_size))
    r = validate(model, ids, tok, seq_len=64)
    n_bytes = len(tok.decode(ids[1:-1].tolist()).encode())   # the text behind the predicted tokens
    assert r["bpb"] == pytest.approx(r["loss"] * r["tokens"] / (np.log(2) * n_bytes), rel=1e-6)


# --- data ---------------------------------------------------------------------------------------------------
def test_binary_data_is_refused(tmp_path, capsys):
    blob = tmp_path / "train.dat"
    blob.write_bytes(np.arange(5000, dtype=np.uint16).tobytes())
    one_line_error(capsys, ["train", *TINY, "--data", blob, "--out", tmp_path / "x"], "train.dat", "binary")
    raw = tmp_path / "train.bin"
    raw.write_bytes(np.arange(5000, dtype=np.uint16).tobytes())
    one_line_error(capsys, ["train", *TINY, "--data", raw, "--out", tmp_path / "y"], "train.bin", "sidecar", "dtype")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9 ".encode("latin-1") * 100)
    one_line_error(capsys, ["train", *TINY, "--data", latin, "--out", tmp_path / "z"], "latin.txt", "not UTF-8")


def test_npy_token_file_trains_on_exactly_its_tokens(tmp_path, capsys):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, 6000).astype(np.uint16)
    ids[::97] = 256                                               # document ends (the byte tokenizer's eos)
    path = tmp_path / "ids.npy"
    write_token_file(str(path), ids)
    data = load_data(str(path))
    train, val = data.tokens("train"), data.tokens("val")
    assert np.array_equal(np.concatenate([train, val]), ids) and train[-1] == 256   # split after an eos
    x, _ = data.get_batch("train", 4, 32, torch.Generator().manual_seed(0))
    starts = [next(i for i in range(len(train) - 31) if np.array_equal(train[i: i + 32], row)) for row in x.numpy()]
    assert len(starts) == 4
    assert main(["train", *TINY, "--steps", "2", "--data", str(path), "--eval-tokens", "100",
                 "--out", str(tmp_path / "run")]) == 0
    assert f"{len(train):,} train / {len(val):,} val tokens" in capsys.readouterr().out
    # .bin + sidecar: the same tokens
    write_token_file(str(tmp_path / "ids.bin"), ids, {"eos_id": 256})
    assert np.array_equal(load_data(str(tmp_path / "ids.bin")).tokens("val"), val)


def test_bad_token_files(tmp_path, capsys):
    np.save(tmp_path / "f.npy", np.zeros(100, np.float32))
    one_line_error(capsys, ["train", *TINY, "--data", tmp_path / "f.npy", "--out", tmp_path / "a"], "f.npy", "float32")
    big = np.arange(3000, dtype=np.uint16)
    np.save(tmp_path / "big.npy", big)
    one_line_error(capsys, ["train", *TINY, "--data", tmp_path / "big.npy", "--out", tmp_path / "b"], "big.npy",
                   "token id 2999", "outside the vocabulary")
    write_token_file(str(tmp_path / "t.bin"), np.arange(100, dtype=np.uint16))
    with open(tmp_path / "t.bin", "ab") as f:
        f.write(b"\0")
    one_line_error(capsys, ["train", *TINY, "--data", tmp_path / "t.bin", "--out", tmp_path / "c"], "t.bin",
                   "not a whole number")


def test_max_bytes_counts_bytes_and_caps_one_file(tmp_path):
    p = tmp_path / "one.txt"
    p.write_text("é" * 10_000 + "\n")                            # 2 bytes a character
    c = load_corpus(str(p), max_bytes=5001)
    assert sum(len(d.encode()) for d in c.train + c.val) == 5000   # 2,500 whole characters
    c = load_corpus(str(p), max_bytes=None)
    assert sum(len(d.encode()) for d in c.train + c.val) == 20_001


# --- configs that say what they are -------------------------------------------------------------------------
def test_printed_parameter_split_and_config(tmp_path, text, capsys):
    assert main(["train", "--preset", "gpt", "--n-layers", "1", "--d-model", "32", "--n-heads", "4", "--seq-len",
                 "32", "--batch-size", "2", "--steps", "1", "--warmup", "0", "--data", str(text), "--no-progress",
                 "--out", str(tmp_path / "g")]) == 0
    out = capsys.readouterr().out
    m = CausalLM(presets.get("gpt", n_layers=1, d_model=32, n_heads=4, vocab_size=257, max_seq_len=32))
    blocks = m.num_parameters() - 257 * 32 * 2 - 32 * 32
    assert f"position table {32 * 32 / 1e3:.1f}K" in out and f"blocks {blocks / 1e3:.1f}K" in out
    assert "lm_head 8.2K" in out                                   # gpt is untied
    assert "max_seq_len=32" in out and "dropout=0.1" in out and "n_heads=4" in out   # the table follows --seq-len


def test_unknown_set_field_names_the_nearest(tmp_path, capsys):
    one_line_error(capsys, ["train", *TINY, "--set", "nheads=4", "--out", tmp_path / "x"], "unknown config field",
                   "'nheads'", "n_heads")
    with pytest.raises(ConfigError, match="d_model"):
        presets.get("mamba2", dmodel=3)


# --- fused LM head + loss -----------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 7, 64, None])
@pytest.mark.parametrize("sparse", [False, True])   # True: most targets ignored (MQAR), only valid rows meet the head
def test_linear_cross_entropy_equals_full(chunk, sparse):
    torch.manual_seed(0)
    x = torch.randn(53, 24, dtype=torch.float64, requires_grad=True)
    w = torch.randn(61, 24, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 61, (53,))
    if sparse:
        t[torch.arange(53) % 5 != 2] = -100
    else:
        t[::4] = -100
    a = linear_cross_entropy(x, w, t, chunk=chunk)
    ga = torch.autograd.grad(a * 1.7, (x, w))
    b = cross_entropy_ref(x @ w.T, t)
    gb = torch.autograd.grad(b * 1.7, (x, w))
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for u, v in zip(ga, gb):
        torch.testing.assert_close(u, v, rtol=1e-10, atol=1e-12)


def test_linear_cross_entropy_bf16_and_all_ignored():
    torch.manual_seed(0)
    x, w = torch.randn(40, 32, requires_grad=True), torch.randn(50, 32, requires_grad=True)
    t = torch.randint(0, 50, (40,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = linear_cross_entropy(x, w, t, chunk=9)
        b = cross_entropy_ref((x @ w.T).float(), t)
    ga, gb = torch.autograd.grad(a, (x, w)), torch.autograd.grad(b, (x, w))
    torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    assert ga[0].dtype == torch.float32 and ga[1].dtype == torch.float32
    for u, v in zip(ga, gb):
        assert (u - v).norm() / v.norm() < 3e-2
    z = linear_cross_entropy(x, w, torch.full((40,), -100))
    assert z.item() == 0 and torch.autograd.grad(z, x)[0].abs().max() == 0


def test_model_loss_is_fused_unless_logits_are_asked_for():
    torch.manual_seed(0)
    m = CausalLM(presets.get("mamba2-attention", n_layers=2, d_model=32, n_heads=2, vocab_size=300, ssd_headdim=16,
                             ssd_d_state=16, ssd_chunk_size=16))
    ids = torch.randint(0, 300, (2, 19))
    fused = m(ids, labels=ids)
    assert fused.logits is None
    fused.loss.backward()
    g1 = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    full = m(ids, labels=ids, return_logits=True)
    assert full.logits.shape == (2, 19, 300)
    full.loss.backward()
    torch.testing.assert_close(fused.loss, full.loss, rtol=1e-6, atol=1e-6)
    for a, p in zip(g1, m.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        assert m(ids).logits.shape == (2, 19, 300)


# --- allocator ----------------------------------------------------------------------------------------------
# glibc's own behaviour, without torch: a freed 64 MiB block is either unmapped (and page-faulted in again on
# the next allocation) or kept in the heap, depending on the thresholds the process runs with
FAULTS = textwrap.dedent("""
    import ctypes, resource
    {setup}
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.memset.argtypes, libc.free.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t], [ctypes.c_void_p]
    def churn():
        p = libc.malloc(64 << 20); libc.memset(p, 1, 64 << 20); libc.free(p)
    churn()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        churn()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
""")


def _clean_env(**env) -> dict:
    """No MALLOC_* or LD_PRELOAD of the caller's; this checkout's hybridlm."""
    return {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": os.environ.get("PYTHONPATH", ""), **env}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_cli_entry_point_keeps_freed_memory_and_import_does_not():
    def faults(setup):
        r = subprocess.run([sys.executable, "-c", FAULTS.format(setup=setup)], capture_output=True, text=True,
                           check=True, env=_clean_env())
        return int(r.stdout.split()[-1])
    plain = faults("import hybridlm")
    cli = faults("from hybridlm.cli import main\nmain(['info', '--list'])")
    assert plain > 4 * 16000 and cli < 100, (plain, cli)        # 64 MiB = 16,384 pages per allocation
    # the FSDP policy: a 64 MiB block goes back to the OS when freed, after the command line had kept it
    release = faults("from hybridlm.cli import main\nmain(['info', '--list'])\n"
                     "from hybridlm.runtime import set_allocator\nset_allocator('release')")
    assert release > 4 * 16000, release


@pytest.mark.parametrize("argv, world, policy", [
    (["train"], 1, "keep"), (["train", "--parallel", "fsdp"], 1, "keep"),       # one process: nothing to shard
    (["train", "--parallel", "fsdp"], 2, "release"), (["train", "--parallel", "ddp"], 2, "keep"),
    (["train"], 2, "keep"), (["info", "--list"], 2, "keep")])
def test_allocator_policy_per_run_kind(monkeypatch, argv, world, policy):
    from hybridlm.cli import build_parser
    from hybridlm.runtime import allocator_policy
    monkeypatch.setenv("WORLD_SIZE", str(world))        # as torchrun sets it
    assert allocator_policy(getattr(build_parser(argv).parse_args(argv), "parallel", None)) == policy


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_allocator_in_force_says_what_applies():
    def said(setup, **env):
        code = f"{setup}\nfrom hybridlm.runtime import allocator_in_force\nprint(allocator_in_force())"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env=_clean_env(**env)).stdout.strip().splitlines()[-1]
    assert said("import hybridlm").startswith("the default")
    assert said("from hybridlm.cli import main\nmain(['info', '--list'])").startswith("glibc keep: freed blocks")
    assert said("from hybridlm.runtime import set_allocator\nset_allocator('release')").startswith("glibc release")
    assert said("from hybridlm.runtime import set_allocator\nset_allocator('release')",
                MALLOC_MMAP_THRESHOLD_="131072") == "glibc, from the environment (MALLOC_MMAP_THRESHOLD_=131072)"
    with pytest.raises(ValueError, match="keep, release"):
        from hybridlm.runtime import set_allocator
        set_allocator("hoard")
