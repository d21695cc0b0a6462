"""Every `hybridlm bench --suite NAME --quick` and `python -m hybridlm.bench.parallel --quick` of the README runs
and writes its JSON through the one writer (hf, decode, twins and the instrument have their own tests)."""
import json

import pytest

from hybridlm.bench.measure import Case, clock, peak_memory, run_cases
from hybridlm.bench.registry import SUITES
from hybridlm.cli import main


@pytest.mark.parametrize("name", ["mla", "rodimus", "delta", "gla", "moe", "attention",
                                  "wm", "quantize"])
def test_suite_quick(name, tmp_path):
    import torch
    if name == "wm":
        pytest.importorskip("transformers")
    out, threads = tmp_path / f"{name}.json", torch.get_num_threads()
    try:                # one thread: the token-loop references are thousands of tiny ops
        assert main(["bench", "--suite", name, "--quick", "--threads", "1", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    res = json.loads(out.read_text())
    assert res["suite"] == name and "meta" in res


def test_suite_help_lists_every_suite(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(f"{n}: " in text for n in SUITES)


def test_clock_interleaves_and_cases_give_one_row_schema():
    calls = []
    times = clock({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3, warmup=1)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"] and all(len(t) == 3 for t in times.values())
    rows = run_cases([Case("x", lambda: {"one": lambda: None, "two": lambda: None}, work=8, unit="tokens")], 2)
    assert [(r["case"], r["variant"], r["unit"], r["repeats"]) for r in rows] == [("x", "one", "tokens", 2),
                                                                                  ("x", "two", "tokens", 2)]
    assert all(r["per_s"] > 0 and r["min_s"] <= r["median_s"] <= r["max_s"] for r in rows)


def test_memory_probe_sees_an_allocation():
    import torch
    r = peak_memory(lambda: torch.ones(4 * 2**20).add_(1), what="tensors")
    assert r["peak_bytes"] >= 16 * 2**20


def test_parallel_quick(tmp_path):
    """The parallel bench as a suite and through its module entry point (what torchrun runs)."""
    from hybridlm.bench.parallel import main as parallel
    out = tmp_path / "parallel.json"
    assert parallel(["--quick", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["suite"] == "parallel" and res["world"] == 1 and res["tokens_per_s"] > 0
    assert res["train_peak_mb_per_rank"][0] > 0


def test_llamacpp_suite_says_what_it_needs():
    from hybridlm.bench.llamacpp import llama_cpp_sources
    from hybridlm.errors import ConfigError
    with pytest.raises(ConfigError, match="convert_hf_to_gguf.*--llamacpp-src"):
        llama_cpp_sources("/nonexistent")


def test_llamacpp_suite_quick(tmp_path):
    """Where llama-cpp-python and its sources are installed: the tiny models through both runtimes, and llama.cpp's
    float32 logits equal ours (the same weights, read by two programs)."""
    import os
    pytest.importorskip("llama_cpp")
    src = os.environ.get("LLAMACPP_SRC", "")       # the test's own input: where llama.cpp's sources are
    if not os.path.isfile(os.path.join(src, "convert_hf_to_gguf.py")):
        pytest.skip("LLAMACPP_SRC is not set to llama.cpp's sources")
    out = tmp_path / "llamacpp.json"
    assert main(["bench", "--suite", "llamacpp", "--quick", "--dir", str(tmp_path), "--runtimes", "f32,q4_0",
                 "--llamacpp-src", src, "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    for name, m in res["models"].items():
        agree = m["float32_agreement"]
        assert agree["max_abs_logit_diff"] < 1e-3 * max(1.0, agree["logit_scale"]), name
    assert {(r["runtime"], r["weights"]) for r in res["rows"]} >= {("llama.cpp", "q4_0"), ("hybridlm", "int4")}


def test_release_bench_quick(tmp_path):
    """The released-size Rodimus+ bench, tiny: write, convert, decode float / int8 / int4 in fresh processes, JSON."""
    from hybridlm.bench.rodimus_release import main as release
    out = tmp_path / "release.json"
    assert release(["--quick", "--dir", str(tmp_path), "--contexts", "16", "--steps", "2", "--dtype", "float32",
                    "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = {(r["model"], r["weights"]) for r in res["decode"]}
    assert rows == {(m, w) for m in ("rodimus+", "transformer++") for w in ("float", "int8", "int4")}
    assert all(r["decode_tokens_per_s"] > 0 and r["dtype"] == "float32" for r in res["decode"])


def test_decode_profile_parts_add_up_and_bytes_are_the_weights(tmp_path):
    """`--suite decode-profile --quick`: each model's parts add up to its instrumented step, the bytes are the
    matrices read (a Llama's MLPs by their module, the lm head by its kernel call), the library and the modules are
    left as found,
    and `scripts/decode_profile.py` (the same module from its file) runs against the installed package."""
    pytest.importorskip("transformers")
    import subprocess
    import sys

    import torch

    from hybridlm.bench import decode_profile
    from hybridlm.layers import cpu_steps
    from hybridlm.ops import cpu_kernels
    if not cpu_kernels.available():
        pytest.skip("the CPU kernels are not built")
    out, threads = tmp_path / "dp.json", torch.get_num_threads()
    lib, steps = cpu_kernels._lib, dict(cpu_steps.STEPS)
    try:
        assert main(["bench", "--suite", "decode-profile", "--quick", "--threads", "1", "--families", "llama",
                     "--formats", "bf16,int4", "--steps", "2", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    assert cpu_kernels._lib is lib and cpu_steps.STEPS == steps
    res = json.loads(out.read_text())
    assert [r["format"] for r in res["rows"]] == ["bf16", "int4"] and res["read_gb_per_s"] > 0
    model = decode_profile.build("llama", "bf16", 32, quick=True)
    mlp_bytes = sum(b.mixer.w_in.weight.nbytes + b.mixer.w_out.weight.nbytes for b in model.blocks
                    if type(b.mixer).__name__ == "MLP")
    for r in res["rows"]:
        assert abs(sum(p["ms"] for p in r["parts"].values()) - r["instrumented_ms"]) < 1e-6
        assert all(p["native_ms"] <= p["ms"] + 1e-9 for p in r["parts"].values())
    bf16 = res["rows"][0]
    assert abs(bf16["parts"]["MLP"]["mb"] * 1e6 - mlp_bytes) < 1
    assert abs(bf16["kernels"]["mv_bf16_io"]["mb"] * 1e6 - model.lm_head.weight.nbytes) < 1
    assert abs(bf16["parts"]["lm head"]["mb"] * 1e6 - model.lm_head.weight.nbytes) < 1
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    script = subprocess.run([sys.executable, "scripts/decode_profile.py", "--quick", "--families", "llama",
                             "--formats", "int8", "--steps", "1"], capture_output=True, text=True,
                            cwd=__import__("os").path.dirname(__import__("os").path.dirname(__file__)))
    assert script.returncode == 0 and "| llama | int8 |" in script.stdout, script.stderr[-2000:]


def test_empty_params_drops_a_suites_default_size():
    """`--params ''` with --d-model: the serve suite's default 125M is dropped, the width given is kept."""
    import argparse

    from hybridlm.bench import registry
    from hybridlm.commands import bench
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    s = registry.settings("serve", **registry.given(p.parse_args(["--suite", "serve", "--params", "", "--d-model",
                                                                     "64"])))
    assert (s["params"], s["d_model"]) == ("", 64)
    with pytest.raises(SystemExit):
        p.parse_args(["--params", "lots"])
