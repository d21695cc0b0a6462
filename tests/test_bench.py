"""`hybridlm bench --compare-hf --quick` and the preset instrument: run in seconds and write JSON of the documented
shape."""
import argparse
import json

import pytest
import torch

from hybridlm.commands import bench as run
from hybridlm.bench import measure as tp
from hybridlm.errors import ConfigError


def _args(*argv):
    p = argparse.ArgumentParser()
    run.add_arguments(p)
    return p.parse_args(list(argv))


def test_compare_hf_quick_writes_results(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "bench" / "results.json"
    assert run.main(_args("--compare-hf", "--quick", "--out", str(out))) == 0
    res = json.loads(out.read_text())
    assert res["mode"] == "compare-hf"
    assert {"train", "decode", "latency", "targets", "configs", "meta", "matmul_peak_gflops"} <= set(res)
    assert {r["arch"] for r in res["train"]} == {"llama", "mamba2"}
    assert len(res["train"]) == 4                                   # 2 archs x 2 batch shapes
    for r in res["train"]:
        for k in ("ours_tokens_per_s", "hf_tokens_per_s", "ratio", "ours_mfu", "hf_mfu"):
            assert r[k] > 0, k
        assert r["ratio"] == pytest.approx(r["ours_tokens_per_s"] / r["hf_tokens_per_s"])
        assert len(r["ours_times_s"]) == len(r["hf_times_s"]) >= 2
    assert [r["arch"] for r in res["decode"]] == ["llama", "mamba2"]
    for r in res["decode"]:
        assert r["ours_tokens_per_s"] > 0 and r["hf_tokens_per_s"] > 0 and r["context"] > 0
    assert [r["context"] for r in res["latency"]] == sorted(r["context"] for r in res["latency"])
    assert len(res["latency"]) == 2 and res["latency"][0]["state_bytes"] == res["latency"][1]["state_bytes"]
    for t in res["targets"].values():
        assert {"target", "measured", "met"} <= set(t)
    assert res["configs"]["llama"]["hf_class"] == "LlamaForCausalLM"
    assert res["configs"]["mamba2"]["hf_class"] == "Mamba2ForCausalLM"
    assert res["plot"] is None or res["plot"].endswith(".png")
    printed = capsys.readouterr().out
    assert "ratio" in printed and "targets" in printed


def test_bad_shapes_argument():
    with pytest.raises(SystemExit):
        _args("--shapes", "4by512")


def test_twins_bench_smoke(tmp_path):
    """`hybridlm bench --suite twins`: every preset against its transformers twin on the same weights (build_twin
    checks their logits agree first), JSON and a markdown table; a flag the suite does not take is refused."""
    pytest.importorskip("transformers")
    from hybridlm.commands.bench import main
    from hybridlm.bench.twins import twins
    from hybridlm.errors import ConfigError
    out = tmp_path / "twins.json"
    assert main(_args("--suite", "twins", "--d-model", "64", "--layers", "2", "--vocab-size", "64", "--shapes",
                      "1x16", "--repeats", "1", "--out", str(out))) == 0
    rows = json.loads(out.read_text())["train"]
    assert {r["preset"] for r in rows} == set(twins()) and all(r["ours_tokens_per_s"] > 0 for r in rows)
    assert "`zamba2` | `Zamba2ForCausalLM`" in (tmp_path / "twins.md").read_text()
    with pytest.raises(ConfigError, match="--suite mla does not take --d-model"):
        main(_args("--suite", "mla", "--d-model", "64", "--out", str(out)))



def test_instrument_bfloat16_autocast_records_device_and_dtype(tmp_path, capsys):
    """`--dtype bfloat16` on the CPU (autocast works there): float32 weights, the settings name device and dtype,
    MFU is against the bf16 matmul peak and no datasheet peak is known for a CPU."""
    out = tmp_path / "mfu.json"
    assert run.main(_args("--presets", "mamba2", "--quick", "--dtype", "bfloat16", "--shapes", "1x32",
                          "--latency-contexts", "16", "--no-plot", "--out", str(out))) == 0
    res = json.loads(out.read_text())
    assert res["settings"]["device"] == "cpu" and res["settings"]["dtype"] == "bfloat16"
    assert res["device"]["dtype"] == "bfloat16" and res["device"]["nominal_peak_tflops"] is None
    (row,) = res["train"]
    assert row["train_tokens_per_s"] > 0 and row["train_mfu"] > 0 and row["train_mfu_nominal"] is None
    assert res["latency"][0]["median_ms"] > 0
    assert "bfloat16" in capsys.readouterr().out


def test_train_step_runs_under_autocast():
    """The step closures autocast to the asked dtype on the ids' device and leave the weights float32."""
    seen = []

    class Spy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(4, 4)

        def forward(self, ids, labels=None):
            seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
            y = self.w(ids.float())
            return type("Out", (), {"loss": y.float().square().mean(), "logits": y})()

    m, ids = Spy(), torch.ones(2, 4, dtype=torch.long)
    tp.train_step(m, ids, torch.bfloat16)()
    tp.forward_step(m, ids, torch.bfloat16)()
    tp.train_step(m, ids)()
    assert [s[0] for s in seen] == [True, True, False] and seen[0][1] == seen[1][1] == torch.bfloat16
    assert m.w.weight.dtype == torch.float32


def test_instrument_cuda_without_cuda_is_one_clear_error(monkeypatch, tmp_path, capsys):
    from hybridlm.cli import main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--presets", "mamba2", "--quick", "--device", "cuda", "--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CUDA is not available" in err[0] and "--device cuda" in err[0]
    with pytest.raises(ConfigError, match="--device"):
        run.main(_args("--compare-hf", "--quick", "--dtype", "bfloat16"))


def test_nominal_peak_only_for_known_gpus_in_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name)
    for name, dtype, want in (("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.0), ("NVIDIA H200", torch.float16, 989.0),
                              ("NVIDIA H100 PCIe", torch.bfloat16, 756.0), ("NVIDIA A100-SXM4-80GB", torch.bfloat16,
                                                                            None),
                              ("NVIDIA H100 80GB HBM3", torch.float32, None)):
        assert tp.nominal_peak_tflops("cuda", dtype) == want, name
    assert tp.nominal_peak_tflops("cpu", torch.bfloat16) is None


@pytest.mark.parametrize("layout", ["(W A)*2", "(F M)*2"])
def test_mfu_counts_every_attention_letter(layout):
    """FLOPs per token = 6·matmul params + 6·2·keys·H·D per attention layer, by hand: T = 64, 4 heads of 16; A and F
    see T/2 = 32 keys per query on average, W (window 16) sees 16 - 16²/(2·64) = 14."""
    from hybridlm.models import CausalLM, ModelConfig
    cfg = ModelConfig(layout=layout, d_model=64, n_heads=4, vocab_size=64, max_seq_len=64, swa_window=16)
    model = CausalLM(cfg)
    keys = {"(W A)*2": 2 * 32 + 2 * 14, "(F M)*2": 2 * 32}[layout]
    attention = 6 * 2 * keys * 4 * 16
    assert tp.train_flops_per_token(model, 64) == 6 * tp.matmul_params(model) + attention


def test_mfu_counts_the_linear_mixers_recurrence():
    """S, R, G and K add 3x their chunked recurrence's forward FLOPs (ops/flops.py), by hand with chunk 64: SSD 2 heads
    of 32 over d_state 16, one B/C group; Rodimus one head, K 16, V = d_inner 64; Gated DeltaNet 4 value heads of 16 (keys 16);
    KDA 4 heads of 16."""
    from hybridlm.models import CausalLM, ModelConfig
    gla = lambda h, k, v, g: 64 * k * g + 64 * v * h + 4 * k * v * h
    delta = lambda h, k, v: gla(h, k, v, h) + h * (64 * k + 64 * (v + k) + 2 * k * v)
    cases = {"S": (dict(ssd_d_state=16, ssd_headdim=32), gla(2, 16, 32, 1)),
             "R": (dict(rodimus_d_state=16), gla(1, 16, 64, 1)),
             "G": (dict(head_dim=16, gdn_v_heads=4, gdn_k_heads=2), delta(4, 16, 16)),
             "K": (dict(kda_head_dim=16), delta(4, 16, 16))}
    for letter, (kw, fwd) in cases.items():
        model = CausalLM(ModelConfig(layout=letter, d_model=32, n_heads=4, vocab_size=64, max_seq_len=64, **kw))
        assert tp.train_flops_per_token(model, 64) == 6 * tp.matmul_params(model) + 3 * fwd, letter


def test_suites_are_declared_one_way():
    """Every suite is a registry row: a function that imports, quick settings among its defaults, each default a
    flag; a flag its suite does not take, or a suite flag without --suite, is one clear error."""
    from hybridlm.bench import registry
    for name, suite in registry.SUITES.items():
        assert callable(suite.function()) and set(suite.quick) <= set(suite.defaults), name
    for key, users in registry.suite_keys().items():       # a flag several suites share has one type
        assert len({registry.flag_type(registry.SUITES[n], key) for n in users}) == 1, key
    s = registry.settings("decode", quick=True, steps=3)
    assert s["steps"] == 3 and s["context"] == 16 and s["out"].endswith("decode.json")
    assert _args("--suite", "release", "--contexts", "16,32", "--weights", "int4").contexts == (16, 32)
    with pytest.raises(ConfigError, match="--suite gla does not take --steps"):
        run.main(_args("--suite", "gla", "--steps", "3"))
    with pytest.raises(ConfigError, match="--dry-run apply to a --suite"):
        run.main(_args("--dry-run"))
