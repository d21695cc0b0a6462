"""The letter table (models/registry.py): every letter declared once, complete whatever the import order; renamed
config fields (models/config.py RENAMED) still load."""
import importlib
import json
import os
import subprocess
import sys
import warnings

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
        with config.quiet_unread():          # SMALL sizes every letter, whichever ones the preset uses
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


# --- traits: the library asks the letter, never a list of letters ------------------------------------------------
@pytest.fixture
def throwaway():
    """register(letter, **traits) for test letters (an MLP as module), removed from the table afterwards."""
    made = []

    def reg(letter: str, **traits):
        register(letter, lambda cfg, idx: LETTERS["M"].build(cfg, idx), token=True, doc="test letter", **traits)
        made.append(letter)
    yield reg
    for letter in made:
        del LETTERS[letter]


def test_a_letter_is_treated_by_its_traits_alone(throwaway):
    """DDP's find_unused_parameters, context parallelism's refusal, the two-hop block's attention and the unread-field
    warning follow a new letter's registry entry, with no edit anywhere else."""
    from hybridlm.train.context_parallel import check_layout
    from hybridlm.train.parallel import expects_unused_parameters
    throwaway("Q", attention=True, reads=("swa_window",), unused_params=lambda cfg: cfg.dropout > 0,
              no_context_parallel=lambda cfg: "Q drops whole sequences" if cfg.dropout else None)
    throwaway("X", unused_params=True, no_context_parallel="X routes whole sequences")
    throwaway("Y")
    cfg = ModelConfig(layout="QM YM", d_model=32, n_heads=2)
    assert not expects_unused_parameters(cfg)
    check_layout(cfg)
    on = cfg.replace(dropout=0.1)
    assert expects_unused_parameters(on)
    with pytest.raises(ConfigError, match="does not support layer 'Q' in layout 'QM YM': Q drops whole sequences"):
        check_layout(on)
    layer = cfg.replace(layer_overrides={0: {"dropout": 0.1}})         # a trait is asked of each layer's config
    assert expects_unused_parameters(layer)
    with pytest.raises(ConfigError, match="layer 'Q'"):
        check_layout(layer)
    assert expects_unused_parameters(cfg.replace(layout="YM XM"))
    with pytest.raises(ConfigError, match="does not support layer 'X' in layout 'YM XM': X routes whole sequences"):
        check_layout(cfg.replace(layout="YM XM"))
    ModelConfig(layout="[RQM]", d_model=32, n_heads=2)                   # Q is attention-like, Y is not
    with pytest.raises(ConfigError, match="missing its attention"):
        ModelConfig(layout="[RYM]", d_model=32, n_heads=2)
    with pytest.warns(UserWarning, match=r"swa_window \(read by W, Q\)"):
        cfg.replace(layout="AM", swa_window=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg.replace(swa_window=8)                                          # Q reads it


def test_the_library_keeps_no_set_of_letters():
    """Outside models/ no code lists letters: it asks the registry for their traits."""
    import re
    root = os.path.join(hybridlm.__path__[0])
    pattern = re.compile(r"""set\(["'][A-Z]{2,}["']\)|\{["'][A-Z]["'](, *["'][A-Z]["'])+\}|in ["'][A-Z]{2,}["']""")
    for dirpath, _, files in os.walk(root):
        if os.path.basename(dirpath) == "models":
            continue
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(dirpath, f)) as fh:
                    assert not pattern.search(fh.read()), os.path.join(dirpath, f)


def test_a_field_no_letter_of_the_layout_reads_warns_once():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ModelConfig(layout="(AM)*2", d_model=32, n_heads=2, moe_experts=4, ssd_d_state=16, window=8,
                    layer_overrides={1: {"mlp_hidden": 64}})
    assert len(w) == 1 and w[0].filename == __file__                    # one warning, at the caller's line
    msg = str(w[0].message)
    assert "ssd_d_state (read by S)" in msg and "moe_experts (read by O)" in msg and "window" not in msg
    with pytest.warns(UserWarning, match=r"'AM' has no letter that reads d_conv \(read by S, R, K, G, B, C\)"):
        presets.get("transformer++", n_layers=1, layout="AM", d_conv=3)   # what a caller sets on a preset warns
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ModelConfig(layout="(AM)*2 SO", d_model=32, n_heads=2, moe_experts=4, ssd_d_state=16, ssd_headdim=16)
        for name in presets.names():        # a preset's own fields serve every depth: Kimi-Linear's MLA comes at 4
            for n in range(1, 9):
                presets.get(name, n_layers=n)
        with config.quiet_unread():
            ModelConfig(layout="AM", moe_experts=4)


def test_configs_converted_from_transformers_stay_silent():
    """A converter fills every field of its family: Kimi-Linear's MLA fields too when no layer is MLA."""
    transformers = pytest.importorskip("transformers")
    from hybridlm.hf import config_from_transformers
    hf = transformers.AutoConfig.for_model("kimi_linear", vocab_size=64, hidden_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                           intermediate_size=64, linear_attn_config={
                                               "kda_layers": [1, 2], "full_attn_layers": [], "num_heads": 4,
                                               "head_dim": 16, "short_conv_kernel_size": 4})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = config_from_transformers(hf)
    assert "L" not in cfg.layout and config.unread(cfg)                # there was something to warn about


def test_old_short_conv_names_load():
    """ssd_d_conv, rodimus_d_conv, kda_d_conv, gdn_conv, mamba1_d_conv and conv_kernel are one field, d_conv."""
    assert set(config.MERGED) == {k for k, v in config.RENAMED.items() if v == "d_conv"} and len(config.MERGED) == 6
    base = ModelConfig(layout="AM", d_model=32, n_heads=2)
    ssd = ModelConfig(layout="SM", d_model=32, ssd_headdim=16, ssd_d_state=16)
    for old in config.MERGED:
        assert ssd.replace(**{old: 3}).d_conv == 3                                          # --set, a recipe
        assert presets.get("lfm2", n_layers=3, **{old: 2}).d_conv == 2
    # a config.json from before the merge carries all six; only the kernel of a letter in its layout counts
    before = dict(base.to_dict(), layout="(CM)*2 AM", ssd_d_conv=4, rodimus_d_conv=4, kda_d_conv=4, gdn_conv=4,
                  mamba1_d_conv=4, conv_kernel=3)
    del before["d_conv"]
    assert ModelConfig.from_dict(before) == base.replace(layout="(CM)*2 AM", d_conv=3)
    assert ModelConfig.from_dict(dict(before, layout="SM", ssd_headdim=16, ssd_d_state=16)).d_conv == 4
    assert ModelConfig.from_dict(dict(before, layout="AM")) == base
    assert ModelConfig.from_dict(dict(before, layer_overrides={"0": {"conv_kernel": 2}})).layer_overrides == {
        0: {"d_conv": 2}}
    with pytest.raises(ConfigError, match=r"'ssd_d_conv' = 4 and 'conv_kernel' = 3: two names of one field \(d_conv"):
        ModelConfig.from_dict(dict(before, layout="SM CM", ssd_headdim=16))


def test_attention_and_indexer_traits_answer_for_the_letters():
    """Who asks "is this attention / does it pick keys with an indexer" asks the registry (FLOPs, ablations)."""
    from hybridlm.models.registry import attention_layers, has_indexer
    cfg = ModelConfig(layout="(W A S)*2 L", d_model=64, n_heads=4, vocab_size=64, swa_window=16, window=None)
    assert [(x, k) for x, _, k in attention_layers(cfg)] == [("W", 16), ("A", None)] * 2 + [("L", None)]
    assert not has_indexer(cfg) and has_indexer(ModelConfig(layout="I M", d_model=64, n_heads=4, vocab_size=64))
