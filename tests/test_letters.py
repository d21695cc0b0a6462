"""The letter table (models/registry.py): every letter declared once, complete whatever the import order; renamed
config fields (models/config.py RENAMED) still load."""
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

import hybridlm
from hybridlm import CausalLM, ModelConfig, presets
from hybridlm.errors import ConfigError
from hybridlm.models import causal_lm, config
from hybridlm.models.layout import flatten, parse_layout
from hybridlm.models.registry import LETTERS, register

SMALL = dict(d_model=64, n_heads=4, vocab_size=97, ssd_headdim=16, ssd_d_state=16, rodimus_d_state=16,
             mlp_hidden=None, mamba1_d_state=4, max_seq_len=256)


def _presets_built(whole: bool) -> dict:
    """Each preset: its default config and the module types built from it at small sizes: of every layer of the
    preset's shortest layouts built by the table on the CPU (fast), or (whole) of the CausalLM built on meta (which
    imports torch._dynamo: seconds more in a fresh interpreter)."""
    out = {}
    for name in presets.names():
        cfg = presets.get(name, n_layers=min(presets.PRESETS[name].n_layers, 10 if whole else 3), **SMALL)
        if whole:
            with torch.device("meta"):
                mods = list(CausalLM(cfg).named_modules())
        else:
            layers = flatten(parse_layout(cfg.layout, LETTERS.keys()))
            mods = [(f"{i}{x}", LETTERS[x].build(cfg.for_layer(i), i)) for i, x in enumerate(layers)]
        out[name] = {"config": json.loads(presets.get(name).to_json()),
                     "modules": [f"{n}:{type(x).__module__}.{type(x).__qualname__}" for n, x in mods]}
    return out


# In a fresh interpreter: hybridlm and hybridlm.models as bare packages (their __init__ not run), the family modules
# imported in the reverse of models/__init__.py's order, then the two __init__ run, then every preset built.
_REVERSED = r"""
import importlib, importlib.util, json, os, re, sys
root = sys.argv[1]
def bare(name, path):
    spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    return spec, mod
top_spec, top = bare("hybridlm", root)
models_spec, models = bare("hybridlm.models", os.path.join(root, "models"))
top.models = models
order = re.findall(r"\bmixers_\w+", open(os.path.join(root, "models", "__init__.py")).read())
order += sorted(f[:-3] for f in os.listdir(os.path.join(root, "models"))
                if f.startswith("mixers_") and f.endswith(".py") and f[:-3] not in order)
for name in reversed(order):
    importlib.import_module("hybridlm.models." + name)
models_spec.loader.exec_module(models)
top_spec.loader.exec_module(top)
sys.path.insert(0, sys.argv[2])
import test_letters
print(json.dumps({"order": list(reversed(order)), "letters": test_letters._table(),
                  "built": test_letters._presets_built(sys.argv[3] == "whole")}))
"""


def _table() -> list:
    return [[k, v.token, v.doc, v.residual, [o.field for o in v.options]] for k, v in LETTERS.items()]


@pytest.mark.parametrize("whole", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_import_order_does_not_matter(whole):
    root, here = hybridlm.__path__[0], os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _REVERSED, root, here, "whole" if whole else "layers"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(got["order"]) >= 9 and got["order"][0] == "mixers_zamba"
    assert got["letters"] == json.loads(json.dumps(_table()))
    want = _presets_built(whole)
    assert got["built"].keys() == want.keys()
    for name in want:
        assert got["built"][name] == want[name], name


def test_every_named_builder_exists():
    """The table names builders in family modules as "module:function": each must import."""
    refs = [f for L in LETTERS.values()
            for f in (L.builder, L.validator, L.check, *(g for o in L.options for g in (o.build, o.validate)))]
    refs += [*config.CONFIG_CHECKS, *causal_lm.BLOCKS.values()]
    named = [f.ref for f in refs if hasattr(f, "ref")]
    assert len(named) > 20
    for ref in named:
        mod, name = ref.split(":")
        assert callable(getattr(importlib.import_module(f"hybridlm.models.{mod}"), name)), ref


def test_a_letter_is_declared_once():
    with pytest.raises(ValueError, match="'A' is already registered"):
        register("A", lambda cfg, idx: None, token=True)
    register("Q", "mixers_wm:inner_attention", token=True, doc="test letter")
    try:
        with pytest.raises(ValueError, match="'Q' is already registered"):
            register("Q", "mixers_wm:inner_attention", token=True)
    finally:
        del LETTERS["Q"]


def test_options_are_part_of_the_letter():
    """wm_dyn_mask on A and wm_ssd_rope on S are options of the letter's one entry."""
    from hybridlm.layers.attention import Attention
    from hybridlm.layers.mamba2 import Mamba2
    from hybridlm.layers.rope_ssd import RopeSSD
    from hybridlm.layers.wm_attention import WMAttention
    assert [o.field for o in LETTERS["A"].options] == ["wm_dyn_mask"]
    assert [o.field for o in LETTERS["S"].options] == ["wm_ssd_rope"]
    cfg = ModelConfig(layout="AS", d_model=32, n_heads=2, ssd_headdim=16, ssd_d_state=16)
    assert type(LETTERS["A"].build(cfg, 0)) is Attention and type(LETTERS["S"].build(cfg, 1)) is Mamba2
    on = cfg.replace(wm_dyn_mask="dt", wm_ssd_rope=True)
    assert type(LETTERS["A"].build(on, 0)) is WMAttention and type(LETTERS["S"].build(on, 1)) is RopeSSD
    with pytest.raises(ConfigError, match="wm_keep_window"):     # an option's check runs with the option off too
        cfg.replace(wm_keep_window=4)
    with pytest.raises(ConfigError, match="attn_output_gate does not support wm_dyn_mask"):
        cfg.replace(wm_dyn_mask="position", attn_output_gate=True)


OLD = {"wm_moe_experts": 4, "wm_moe_topk": 1, "wm_moe_hidden": 48, "wm_moe_shared": True}
NEW = {"moe_experts": 4, "moe_topk": 1, "moe_hidden": 48, "moe_shared": True}


def test_old_field_names_still_load(tmp_path):
    assert {config.RENAMED[k] for k in OLD} == NEW.keys()
    base = dict(layout="AO AM", d_model=32, n_heads=2)
    want = ModelConfig(**base, **NEW, layer_overrides={1: {"moe_topk": 2}})
    old = dict(ModelConfig(**base).to_dict(), **OLD, layer_overrides={"1": {"wm_moe_topk": 2}})
    for k in NEW:
        del old[k]
    assert ModelConfig.from_dict(old) == want
    assert ModelConfig.from_dict(json.loads(json.dumps(old))) == want       # a config.json
    assert ModelConfig(**base).replace(**OLD) == want.replace(layer_overrides={})
    assert presets.get("deepseek-mla-moe", wm_moe_experts=4) == presets.get("deepseek-mla-moe", moe_experts=4)
    with pytest.raises(ConfigError, match="wm_moe_topk.*moe_topk"):
        ModelConfig.from_dict(dict(base, wm_moe_topk=1, moe_topk=2))
    # a checkpoint whose config.json has the old names loads as the new config, weights included
    from hybridlm.checkpoint import load_checkpoint, load_config, save_checkpoint
    model = CausalLM(want)
    path = save_checkpoint(str(tmp_path), model)
    with open(os.path.join(path, "config.json")) as f:
        d = json.load(f)
    d["hybridlm"] = old
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(d, f)
    from hybridlm.checkpoint import write_manifest
    write_manifest(path)
    assert load_config(path) == want
    loaded, _ = load_checkpoint(path)
    assert loaded.config == want
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


def test_old_field_names_in_transformers_config_and_recipes():
    from hybridlm.train.recipes import parse_recipe
    raw = {"title": "t", "source": "s", "minutes_per_model": 1, "model": {"wm_moe_experts": 4},
           "config": [{"name": "a", "layout": "AO", "wm_moe_shared": True}, {"name": "b", "layout": "AO"}],
           "claim": [{"text": "x", "better": "a", "worse": "b", "varies": ["wm_moe_shared"]}]}
    r = parse_recipe(raw, "old")
    assert r.model == {"moe_experts": 4} and r.configs[0].fields == {"moe_shared": True}
    assert r.claims[0]["varies"] == ["moe_shared"]
    pytest.importorskip("transformers")
    from hybridlm.hf.modeling import HybridLMConfig
    hf = HybridLMConfig(hybridlm=dict(layout="AO", d_model=32, n_heads=2, **OLD))
    assert hf.model_config == ModelConfig(layout="AO", d_model=32, n_heads=2, **NEW)
    assert "wm_moe_experts" not in hf.hybridlm and hf.hybridlm["moe_experts"] == 4
