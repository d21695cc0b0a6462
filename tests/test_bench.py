"""`hybridlm bench --compare-hf --quick`: runs in seconds and writes JSON of the documented shape."""
import argparse
import json

import pytest

pytest.importorskip("transformers")

from hybridlm.bench import run  # noqa: E402


def _args(*argv):
    p = argparse.ArgumentParser()
    run.add_arguments(p)
    return p.parse_args(list(argv))


def test_compare_hf_quick_writes_results(tmp_path, capsys):
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
    """`python -m hybridlm.bench.twins` (= `hybridlm bench --suite twins`): every preset against its transformers
    twin on the same weights (build_twin checks their logits agree first), JSON and a markdown table."""
    pytest.importorskip("transformers")
    from hybridlm.bench.twins import main, twins
    out = tmp_path / "twins.json"
    assert main(["--d-model", "64", "--layers", "2", "--vocab-size", "64", "--shapes", "1x16", "--repeats", "1",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["train"]
    assert {r["preset"] for r in rows} == set(twins()) and all(r["ours_tokens_per_s"] > 0 for r in rows)
    assert "`zamba2` | `Zamba2ForCausalLM`" in (tmp_path / "twins.md").read_text()
