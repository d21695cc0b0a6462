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
