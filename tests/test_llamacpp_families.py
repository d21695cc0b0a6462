"""The llama.cpp family bench's inputs: every family's transformers directory, with the fixes llama.cpp's converter
needs, still converts into hybridlm with the same logits; where llama-cpp-python and its sources are installed, the
tiny families run through both runtimes."""
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hybridlm.bench import llamacpp_families as lf  # noqa: E402


@pytest.mark.parametrize("name", sorted(lf.FAMILIES))
def test_fixed_directory_converts_with_the_same_logits(name, tmp_path):
    from hybridlm.checkpoint import load_checkpoint
    from hybridlm.hf.directory import convert_from_hf
    cfg = lf.family_config(name, quick=True)
    torch.manual_seed(0)
    hf_model = getattr(transformers, lf.FAMILIES[name][0].replace("Config", "ForCausalLM"))(cfg).eval()
    hf_model.save_pretrained(tmp_path / "hf")
    lf._fix_dir(name, str(tmp_path / "hf"))
    convert_from_hf(str(tmp_path / "hf"), str(tmp_path / "run"))
    ours = load_checkpoint(str(tmp_path / "run"))[0].eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = hf_model(ids).logits, ours(ids).logits
    assert (a - b).abs().max() < 1e-4 * max(1.0, a.abs().max().item())


def test_unknown_family_is_one_clear_error():
    from hybridlm.errors import ConfigError
    with pytest.raises(ConfigError, match="unknown family 'qwen9'.*qwen3-next"):
        lf.family_config("qwen9")


@pytest.mark.slow
def test_families_through_llama_cpp_quick(tmp_path):
    """Tiny models of every family: llama.cpp's converter and runtime beside hybridlm, through the command; the bf16
    logits after the prompt agree (two programs reading the same weights in bf16)."""
    from hybridlm.cli import main
    pytest.importorskip("llama_cpp")
    src = os.environ.get("LLAMACPP_SRC", "")       # the test's own input
    if not os.path.isfile(os.path.join(src, "convert_hf_to_gguf.py")):
        pytest.skip("LLAMACPP_SRC is not set to llama.cpp's sources")
    out = tmp_path / "families.json"
    assert main(["bench", "--suite", "llamacpp", "--quick", "--families", "all", "--runtimes", "bf16,q8_0",
                 "--llamacpp-src", src, "--dir", str(tmp_path), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    for name, f in res["families"].items():
        agree = f["agreement"]
        assert agree["max_abs_logit_diff"] < 0.1 * max(1.0, agree["logit_scale"]), name
    assert len(res["rows"]) == 2 * len(lf.FAMILIES)
    assert "| qwen3-next |" in (tmp_path / "families.md").read_text()


def test_the_two_llamacpp_suites_share_one_module_and_record_the_host():
    """bench/llamacpp.py and bench/llamacpp_families.py import what they share from bench/llamacpp_jobs.py, not each
    other the other way round; a result's meta and markdown say the CPU, its vector flags and the kernel path."""
    import ast
    import hybridlm.bench.llamacpp as lc
    from hybridlm.bench import registry
    tree = ast.parse(open(lf.__file__).read())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "llamacpp" not in imported and "llamacpp_jobs" in imported
    assert lc.hybridlm_job is lf.hybridlm_job
    meta = registry.meta(False)
    assert meta["cpu"] and isinstance(meta["cpu_flags"], list) and meta["cpu_kernels"]
    line = registry.host_line(meta)
    assert meta["cpu"] in line and meta["cpu_kernels"] in line
    res = {**meta, "rows": [{"family": "llama", "parameters": 1e9, "llamacpp": "bf16", "hybridlm": "bfloat16",
                             "decode_tokens_per_s": {"llamacpp": [10.0], "hybridlm": [12.0]}, "decode_ratio": 1.2,
                             "prefill_tokens_per_s": {"llamacpp": [100.0], "hybridlm": [90.0]},
                             "prefill_ratio": 0.9}]}
    md = lf.families_table(res)
    assert md.startswith(line) and "| llama | 1.00B | bf16 / bfloat16 |" in md


def test_models_and_servers_tables_lead_with_the_host():
    from hybridlm.bench.llamacpp import models_table
    from hybridlm.bench.registry import cpu_host, host_line
    from hybridlm.bench.serve import servers_table
    host = cpu_host()
    rows = [{"model": "llama", "runtime": "llama.cpp", "weights": "q4_0", "parameters": 2e9,
             "decode_tokens_per_s": [10.0], "prefill_tokens_per_s": [100.0]},
            {"model": "llama", "runtime": "hybridlm", "weights": "int4", "parameters": 2e9,
             "decode_tokens_per_s": [5.0], "prefill_tokens_per_s": [50.0], "decode_vs_llamacpp": 0.5,
             "prefill_vs_llamacpp": 0.5}]
    md = models_table({**host, "rows": rows})
    assert md.startswith(host_line(host)) and "| llama | 2.00B | q4_0 / int4 | 10.0 | 5.0 | 0.50x |" in md
    level = lambda c, t: {"concurrency": c, "tokens_per_s": t}           # noqa: E731
    res = {"host": host,
           "servers": {"hybridlm": {"levels": [level(1, 8.0), level(16, 30.0)]},
                       "llama-server": {"levels": [level(1, 10.0), level(16, 40.0)]}}}
    md = servers_table(res)
    assert md.startswith(host_line(host)) and "| 16 | 40.0 | 30.0 | 0.75x |" in md
