"""`hybridlm convert --to-hf RUN --as-native`: a small random hybridlm model of each family's layout (from our presets)
exports as transformers' own class; a fresh process that never imports hybridlm loads every export with
AutoModelForCausalLM (one process for all of them) and its float32 logits equal ours (<= 1e-5 relative); `--from-hf`
of the export gives our weights bit for bit; a layout no class expresses gets one error naming what stands in the
way."""
import json
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hybridlm import CausalLM, presets  # noqa: E402
from hybridlm.cli import main as cli  # noqa: E402
from hybridlm.errors import ConfigError  # noqa: E402
from hybridlm.hf.directory import convert_from_hf, export_to_hf  # noqa: E402
from hybridlm.hf.native import native_config  # noqa: E402
from hybridlm.train import load_checkpoint, save_checkpoint  # noqa: E402

V = 61
# case -> (preset, sizes, the class --as-native auto writes)
CASES = {
    "llama": ("llama", dict(n_layers=2, n_heads=4, n_kv_heads=2), "LlamaForCausalLM"),
    "mamba2": ("mamba2", dict(n_layers=2, ssd_headdim=16, ssd_ngroups=2), "Mamba2ForCausalLM"),
    "granite-4.0-h": ("granite-hybrid", dict(n_layers=3, n_heads=2, n_kv_heads=1, ssd_headdim=16),
                      "GraniteMoeHybridForCausalLM"),
    "granite-moe-rope": ("granite-hybrid", dict(n_layers=2, layout="SO AO", n_heads=2, n_kv_heads=1, ssd_headdim=16,
                                                pos_embedding="rope", moe_experts=4, moe_hidden=32, moe_shared=True,
                                                moe_shared_hidden=48, embed_scale=2.0),
                         "GraniteMoeHybridForCausalLM"),
    "nemotron-h": ("nemotron-h", dict(n_layers=4, n_heads=2, n_kv_heads=1, head_dim=16, ssd_headdim=16),
                   "NemotronHForCausalLM"),
    "nemotron-h-moe": ("nemotron-h", dict(n_layers=2, layout="SMAO", n_heads=2, n_kv_heads=1, head_dim=16,
                                          ssd_headdim=16, moe_experts=4, moe_topk=2, moe_hidden=32, moe_shared=True,
                                          moe_router="sigmoid", moe_router_bias=True, moe_scale=2.5),
                       "NemotronHForCausalLM"),
    "bamba": ("bamba", dict(n_layers=3, n_heads=2, n_kv_heads=1, ssd_headdim=16), "BambaForCausalLM"),
    "falcon-h1": ("falcon-h1", dict(n_layers=2, n_heads=2, n_kv_heads=1, ssd_headdim=16), "FalconH1ForCausalLM"),
    "jamba": ("jamba", dict(n_layers=1, layout="BM AO BM BO", n_heads=2, n_kv_heads=1, moe_experts=4),
              "JambaForCausalLM"),
    "mamba": ("mamba", dict(n_layers=2), "MambaForCausalLM"),
    "falcon-mamba": ("mamba", dict(n_layers=2, mamba1_bcdt_norm="plain", mamba1_norm_eps=1e-5),
                     "FalconMambaForCausalLM"),
    "zamba2": ("zamba2", dict(n_layers=4, n_heads=2, ssd_headdim=16), "Zamba2ForCausalLM"),
    "qwen3-next": ("qwen3-next", dict(n_layers=4, n_heads=2, n_kv_heads=1, head_dim=16, rope_dim=8, moe_experts=4),
                   "Qwen3NextForCausalLM"),
    "kimi-linear": ("kimi-linear", dict(n_layers=4, moe_experts=4), "KimiLinearForCausalLM"),
    "lfm2": ("lfm2", dict(n_layers=3, n_heads=2, n_kv_heads=1), "Lfm2ForCausalLM"),
    "doge": ("doge-dense", dict(n_layers=2, n_heads=2), "DogeForCausalLM"),
    "deepseek-v3": ("deepseek-mla", dict(n_layers=2, n_heads=2), "DeepseekV3ForCausalLM"),
}
if hasattr(transformers, "DeepseekV32ForCausalLM"):
    CASES["deepseek-v3.2"] = ("deepseek-sparse", dict(n_layers=2, n_heads=2), "DeepseekV32ForCausalLM")

# loads each export with transformers alone (hybridlm made unimportable) and saves its logits
_LOAD = """
import json, sys, torch
sys.modules["hybridlm"] = None
sys.modules["fla"] = None      # FLA's Triton kernels need a GPU: transformers takes its torch path, as without FLA
from transformers import AutoModelForCausalLM
for case, d in json.loads(sys.argv[1]).items():
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.load(d + "/ids.pt"), use_cache=False).logits
    torch.save({"class": type(model).__name__, "logits": logits}, d + "/theirs.pt")
"""


def small(preset: str, **kw) -> CausalLM:
    """A random model of `preset` at d_model 64, its norm gains moved off 1 (so their mappings are exercised)."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = CausalLM(presets.get(preset, d_model=64, vocab_size=V, **kw)).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return m


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """case -> (our model, run dir, export dir, ids, our logits, transformers' result); one subprocess for all."""
    root = tmp_path_factory.mktemp("native")
    out = {}
    for case, (preset, kw, _) in CASES.items():
        m = small(preset, **kw)
        run, d = root / case / "run", root / case / "hf"
        save_checkpoint(str(run), m)
        assert cli(["convert", "--to-hf", str(run), "--out", str(d), "--as-native"]) == 0
        ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(1))
        torch.save(ids, d / "ids.pt")
        with torch.no_grad():
            out[case] = [m, run, d, ids, m(ids).logits]
    dirs = json.dumps({case: str(v[2]) for case, v in out.items()})
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", _LOAD, dirs], check=True, env=env, timeout=600)
    for v in out.values():
        v.append(torch.load(v[2] / "theirs.pt"))
    return out


@pytest.mark.parametrize("case", CASES)
def test_native_export_loads_without_hybridlm_and_computes_ours(case, exported):
    model, run, d, ids, ours, theirs = exported[case]
    assert json.loads((d / "config.json").read_text())["architectures"] == [CASES[case][2]]
    assert theirs["class"] == CASES[case][2]
    err = (theirs["logits"] - ours).abs().max() / ours.abs().max()
    assert err <= 1e-5, f"{case}: relative difference {err:.3g}"


@pytest.mark.parametrize("case", CASES)
def test_native_export_converts_back_bit_for_bit(case, exported, tmp_path):
    model, run, d, *_ = exported[case]
    back, _ = load_checkpoint(convert_from_hf(str(d), str(tmp_path / "back")))
    ours, theirs = model.state_dict(), back.state_dict()
    assert set(ours) == set(theirs)
    assert not [k for k in ours if not torch.equal(ours[k], theirs[k])]


def test_as_native_names_a_family(tmp_path):
    """--as-native FAMILY writes that class when it computes the model (a Llama as Bamba, all attention), and
    refuses with what stands in the way when it does not."""
    save_checkpoint(str(tmp_path / "run"), small("llama", n_layers=2, n_heads=4))
    export_to_hf(str(tmp_path / "run"), str(tmp_path / "b"), native="Bamba")
    assert json.loads((tmp_path / "b" / "config.json").read_text())["architectures"] == ["BambaForCausalLM"]
    with pytest.raises(ConfigError, match=r"--as-native mamba2: this model is not exactly a Mamba2: letter 'A' at "
                                          r"layer 0"):
        export_to_hf(str(tmp_path / "run"), str(tmp_path / "x"), native="mamba2")
    with pytest.raises(ConfigError, match="not exactly a NemotronH: pos_embedding='rope'"):
        export_to_hf(str(tmp_path / "run"), str(tmp_path / "x"), native="NemotronH")
    with pytest.raises(ConfigError, match="'mistral': not a family; choose auto or one of Llama, Mamba2"):
        export_to_hf(str(tmp_path / "run"), str(tmp_path / "x"), native="mistral")


@pytest.mark.parametrize("layout, family, why", [
    ("SM AO", "granitemoehybrid", "letter 'O' at layer 3 (its layers are all dense or all MoE)"),
    ("SM S", "bamba", "the end of the layout (a layer's S is followed by M)"),
    ("SM AM", "jamba", "letter 'S' at layer 0"),
    ("SM Z S", "zamba2", "letter 'M' at layer 1 (its layers are S or Z S)"),
])
def test_as_native_family_names_where_it_stops(layout, family, why):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                   # (fields the short layouts do not read)
        cfg = presets.get("granite-hybrid", n_layers=2, layout=layout, d_model=64, n_heads=2, ssd_headdim=16)
    with pytest.raises(ConfigError, match=re.escape(why)):
        native_config(cfg, family)


def test_as_native_refuses_with_the_obstacle_and_the_closest_families(tmp_path, capsys):
    """A letter no family has: named with its layer, and the families that get furthest; an option no class has:
    named with its value. On the command line: one line, no stack trace."""
    save_checkpoint(str(tmp_path / "r"), small("granite-hybrid", n_layers=2, layout="SM RM AM", n_heads=2,
                                               ssd_headdim=16))
    assert cli(["convert", "--to-hf", str(tmp_path / "r"), "--out", str(tmp_path / "x"), "--as-native"]) != 0
    err = capsys.readouterr().err
    assert "the closest, GraniteMoeHybrid, NemotronH, Bamba, stop at letter 'R' at layer 2." in err
    assert "Traceback" not in err and not (tmp_path / "x").exists()
    save_checkpoint(str(tmp_path / "w"), small("llama", n_layers=2, n_heads=4, window=8))
    with pytest.raises(ConfigError, match=r"layout '\(AM\)\*2' exactly: the closest, Llama, .*stop at window=8\."):
        export_to_hf(str(tmp_path / "w"), str(tmp_path / "x"), native=True)
