"""Any transformers tool opens a hybridlm directory: a fresh interpreter that never imports hybridlm loads a run, its
step directory and its `convert --to-hf` export with the Auto classes and trust_remote_code=True (the shim imports the
installed hybridlm) and gets our loader's logits; without hybridlm installed, one line names the package to install;
lm-eval's own CLI evaluates a run (slow)."""
import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hybridlm import CausalLM, presets  # noqa: E402
from hybridlm.checkpoint import load_pretrained, save_step_checkpoint, write_manifest  # noqa: E402
from hybridlm.checkpoint.remote_code import SHIM_FILE  # noqa: E402
from hybridlm.data.tokenizer import ByteTokenizer  # noqa: E402
from hybridlm.hf.directory import export_to_hf  # noqa: E402

TEXT = "def add(a, b):\n    return a + b\n"

# Run in a fresh interpreter: makes hybridlm unimportable and tries to load the run (the error), then lets it be
# imported and loads each directory without importing hybridlm itself (the shim does).
FRESH = r"""
import json, sys
from importlib.abc import MetaPathFinder


class NoHybridLM(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "hybridlm":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


dirs, out = sys.argv[1:-1], sys.argv[-1]
run = dirs[0]
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
sys.meta_path.insert(0, NoHybridLM())
try:
    AutoModelForCausalLM.from_pretrained(run, trust_remote_code=True)
    missing = None
except ImportError as e:
    missing = str(e)
sys.meta_path.pop(0)
report = {"missing": missing, "imported_before": sorted(m for m in sys.modules if m.startswith("hybridlm"))}
logits = {}
for i, d in enumerate(dirs):
    config = AutoConfig.from_pretrained(d, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
    tok = AutoTokenizer.from_pretrained(d, trust_remote_code=True)
    ids = tok(%r, return_tensors="pt").input_ids
    logits[f"ids{i}"], logits[f"logits{i}"] = ids, model(ids).logits.detach().contiguous()
    report[d] = [type(config).__module__, type(model).__module__, type(model).__name__]
save_file(logits, out)
print(json.dumps(report))
""" % TEXT


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """An old run (step 1 written before directories carried the shim) saved again at step 2, and step 1 exported
    with `convert --to-hf`; then FRESH on the run, its step directory and the export."""
    root = tmp_path_factory.mktemp("remote")
    run, hf = root / "run", root / "hf"
    torch.manual_seed(0)
    model = CausalLM(presets.get("mamba2-attention", n_layers=1, d_model=32, n_heads=2, ssd_headdim=16,
                                 ssd_d_state=16, vocab_size=257, max_seq_len=64)).eval()
    old = save_step_checkpoint(str(run), 1, model, tokenizer=ByteTokenizer())
    for d in (str(run), old):                     # as an older hybridlm wrote them: no shim, no auto_map
        os.remove(os.path.join(d, SHIM_FILE))
        with open(os.path.join(d, "config.json")) as f:
            cfg = json.load(f)
        del cfg["auto_map"]
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
    write_manifest(old)
    export_to_hf(old, str(hf))                    # convert --to-hf gives an old run the shim
    new = save_step_checkpoint(str(run), 2, model, tokenizer=ByteTokenizer())   # so does its next save
    dirs = [str(run), new, str(hf)]
    env = dict(os.environ, HF_MODULES_CACHE=str(root / "modules"), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", FRESH, *dirs, str(root / "logits.safetensors")], capture_output=True,
                       text=True, env=env, timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    from safetensors.torch import load_file
    return dirs, json.loads(r.stdout.strip().splitlines()[-1]), load_file(root / "logits.safetensors")


def test_fresh_interpreter_loads_every_directory_with_our_loaders_logits(fresh):
    dirs, report, got = fresh
    assert report["imported_before"] == []                # the loading code itself never imported hybridlm
    model, tok = load_pretrained(dirs[0])
    ids = torch.tensor([tok.encode(TEXT)])
    with torch.no_grad():
        ref = model(ids).logits
    for i, d in enumerate(dirs):
        assert report[d] == ["hybridlm.hf.modeling", "hybridlm.hf.modeling", "HybridLMForCausalLM"], d
        assert torch.equal(got[f"ids{i}"], ids), d       # AutoTokenizer encodes as our tokenizer
        assert torch.equal(got[f"logits{i}"], ref), d


def test_without_hybridlm_one_line_names_the_package(fresh):
    missing = fresh[1]["missing"]
    assert missing is not None and "\n" not in missing and "pip install hybridlm" in missing, missing


def test_shim_only_imports_and_native_export_has_none(tmp_path):
    """The shim holds no model code (a directory never goes stale); --as-native stays free of remote code."""
    import ast
    from hybridlm.checkpoint.remote_code import SHIM
    doc, code = ast.parse(SHIM).body                       # a docstring and one import
    assert isinstance(code, ast.ImportFrom) and code.module == "hybridlm.hf.modeling"
    m = CausalLM(presets.get("mamba2", n_layers=1, d_model=32, vocab_size=50, ssd_headdim=16))
    save_step_checkpoint(str(tmp_path / "run"), 1, m)
    export_to_hf(str(tmp_path / "run"), str(tmp_path / "native"), native=True)
    assert not (tmp_path / "native" / SHIM_FILE).exists()
    assert "auto_map" not in json.loads((tmp_path / "native" / "config.json").read_text())


@pytest.mark.slow
def test_lm_eval_cli_evaluates_a_run(fresh):
    """`lm_eval --model hf --model_args pretrained=RUN,trust_remote_code=True` on a shipped task (run from the tasks
    directory: their data_files are relative to it)."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    from hybridlm.eval.harness_tasks import TASKS_DIR
    run = fresh[0][0]
    r = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                        f"pretrained={run},trust_remote_code=True,dtype=float32", "--device", "cpu",
                        "--tasks", "hybridlm_copy", "--include_path", ".", "--limit", "5"],
                       cwd=TASKS_DIR, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    row = next(ln for ln in r.stdout.splitlines() if ln.startswith("|hybridlm_copy"))
    assert "|acc" in row, r.stdout
