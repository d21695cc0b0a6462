"""`--dtype auto` (hybridlm.dtypes): bf16 on CPUs with AMX-BF16 / AVX512-BF16 and GPUs with bf16, float32 elsewhere,
with the CPU flags mocked; the train header names the choice and the checkpoint records it; a short bf16 training
curve ends within 1% of float32's validation loss."""
import json
import os

import pytest
import torch

from hybridlm import dtypes
from hybridlm.errors import ConfigError


@pytest.fixture(autouse=True)
def _detect(monkeypatch):
    """conftest pins auto to float32 for the rest of the suite; here auto detects."""
    monkeypatch.delenv("HYBRIDLM_AUTO_DTYPE", raising=False)


def test_env_pins_auto(monkeypatch):
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: {"amx_bf16"})
    monkeypatch.setenv("HYBRIDLM_AUTO_DTYPE", "float32")
    assert dtypes.resolve_dtype("auto", "cpu") == ("float32", "float32 (auto: HYBRIDLM_AUTO_DTYPE)")
    assert dtypes.resolve_dtype("bfloat16", "cpu")[0] == "bfloat16"
    monkeypatch.setenv("HYBRIDLM_AUTO_DTYPE", "fp8")
    with pytest.raises(ConfigError, match="HYBRIDLM_AUTO_DTYPE must be float32 or bfloat16, got 'fp8'"):
        dtypes.resolve_dtype("auto", "cpu")


@pytest.mark.parametrize("flags, want, why", [
    ({"avx2", "avx512f", "amx_bf16", "amx_tile", "avx512_bf16"}, "bfloat16", "AMX-BF16"),
    ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16", "AVX512-BF16"),
    ({"avx2", "avx512f", "avx512_vnni"}, "float32", "no AMX-BF16 or AVX512-BF16"),
    (set(), "float32", "no AMX-BF16 or AVX512-BF16"),
])
def test_auto_on_cpu_follows_the_flags(monkeypatch, flags, want, why):
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: flags)
    dtype, label = dtypes.resolve_dtype("auto", "cpu")
    assert dtype == want and label.startswith(f"{want} (auto: ") and why in label
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dtypes.resolve_dtype("auto", "auto")[0] == want            # auto device = the CPU here


def test_auto_on_gpu_and_explicit_choices(monkeypatch):
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: set())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for ok, want in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda ok=ok: ok)
        assert dtypes.resolve_dtype("auto", "cuda:0")[0] == want
        assert dtypes.resolve_dtype("auto", "auto")[0] == want        # auto device = the GPU
    assert dtypes.resolve_dtype("float32", "cuda") == ("float32", "float32")
    assert dtypes.resolve_dtype("bfloat16", "cpu") == ("bfloat16", "bfloat16")
    with pytest.raises(ConfigError, match="dtype must be one of auto, float32, bfloat16, got 'fp8'"):
        dtypes.resolve_dtype("fp8", "cpu")
    with pytest.raises(ConfigError, match="device must be"):
        dtypes.resolve_dtype("auto", "gpu")


def test_cpu_flags_read_from_cpuinfo(tmp_path, monkeypatch):
    """The flags line of /proc/cpuinfo (here a copy), split into names."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx2 amx_bf16 amx_tile\n\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: real_open(info if p == "/proc/cpuinfo" else p, *a, **k))
    assert {"avx2", "amx_bf16", "amx_tile"} <= dtypes.cpu_flags() and "processor" not in dtypes.cpu_flags()


def test_train_header_and_checkpoint_record_the_choice(tmp_path, monkeypatch, capsys):
    """`hybridlm train` defaults to auto: on a mocked AMX CPU it trains under bf16 autocast, says so in the header
    and records bfloat16 (not auto) in the checkpoint's train config."""
    from hybridlm.cli import main
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: {"amx_bf16"})
    out = tmp_path / "run"
    assert main(["train", "--preset", "mamba2-attention", "--n-layers", "1", "--d-model", "32", "--set",
                 "ssd_headdim=16", "--set", "ssd_d_state=16", "--set", "n_heads=2", "--max-bytes", "100000",
                 "--steps", "1", "--seq-len", "32", "--batch-size", "2", "--eval-tokens", "200", "--device", "cpu",
                 "--out", str(out), "--no-progress"]) == 0
    assert "compute bfloat16 (auto: the CPU has AMX-BF16), autocast with float32 weights" in capsys.readouterr().out
    with open(os.path.join(out, "step-000001", "trainer_state.json")) as f:
        assert json.load(f)["train_config"]["dtype"] == "bfloat16"


def _final_val_losses(steps: int, batch: int, seq_len: int) -> dict:
    """Final validation loss of one small hybrid (SSD, Rodimus GLA, Gated DeltaNet, attention) trained in float32
    and under bf16 autocast, same seed and batches."""
    import tempfile

    from hybridlm import presets
    from hybridlm.data.corpus import stdlib_corpus
    from hybridlm.data.loader import TokenData
    from hybridlm.data.tokenizer import ByteTokenizer
    from hybridlm.train import TrainConfig, train
    data = TokenData.from_corpus(stdlib_corpus(max_bytes=400_000), ByteTokenizer())
    cfg = presets.get("mamba2-attention", layout="MRGA", n_layers=1, d_model=64, vocab_size=257, max_seq_len=128,
                      n_heads=2, ssd_headdim=16, ssd_d_state=16, ssd_chunk_size=16)
    out = {}
    for dtype in ("float32", "bfloat16"):
        with tempfile.TemporaryDirectory() as d:
            s = train(cfg, TrainConfig(steps=steps, batch_size=batch, seq_len=seq_len, lr=3e-3, warmup=5,
                                       eval_every=0, eval_tokens=4000, save_every=0, log_every=steps, seed=1,
                                       dtype=dtype, device="cpu"), data, d, progress=False)
        out[dtype] = s["val_loss"]
    return out


def _check_curve(losses: dict):
    f32, bf16 = losses["float32"], losses["bfloat16"]
    assert bf16 != f32                                   # autocast took effect
    assert abs(bf16 - f32) / f32 < 0.01, losses


def test_bf16_training_tracks_float32():
    _check_curve(_final_val_losses(steps=12, batch=4, seq_len=32))


@pytest.mark.slow
def test_bf16_training_tracks_float32_300_steps():
    """The issue's check at small size: 300 steps (2.4243 vs 2.4243 after 60 steps was seen at this size)."""
    _check_curve(_final_val_losses(steps=300, batch=8, seq_len=64))
