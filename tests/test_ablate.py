"""`hybridlm ablate`: recipe parsing, parameter-budget sizing, bad input, and a --quick smoke run."""
import csv
import json

import pytest

from hybridlm.cli import main
from hybridlm.errors import ConfigError
from hybridlm.models import ModelConfig
from hybridlm.models.sizing import active_parameters, count_parameters, depth_for_mixers, fit_params, parse_count
from hybridlm.train.recipes import list_recipes, load_recipe, parse_recipe

TINY = """
title = "tiny"
source = "a test"
minutes_per_model = 1
[budget]
steps = 2
seq_len = 32
params = "60K"
tolerance = 0.15
width_step = 8
[model]
n_heads = 2
ssd_headdim = 16
ssd_d_state = 16
[[config]]
name = "attn"
layout = "(AM)*2"
[[config]]
name = "ssd"
layout = "S*2"
[[claim]]
text = "attention beats SSD"
better = "attn"
worse = "ssd"
"""


def _tiny(tmp_path, text=TINY):
    path = tmp_path / "tiny.toml"
    path.write_text(text)
    return path


def test_shipped_recipes_parse_and_size_within_tolerance():
    names = list_recipes()
    assert {"wm-position-source", "wm-moe", "rodimus-heads", "rodimus-gates", "mamba2-attention-ratio"} <= set(names)
    for name in names:
        r = load_recipe(name)
        assert r.title and r.source and r.minutes_per_model > 0 and r.claims
    for name in ("mamba2-attention-ratio", "wm-moe"):                     # total and active budgets
        r = load_recipe(name)
        for c in r.configs:
            cfg, n = r.model_config(c, vocab_size=256)
            target = c.params or r.budget.get("params")
            if target:
                got = count_parameters(cfg, active=r.budget["active"])
                assert abs(got - target) <= r.budget["tolerance"] * target, (name, c.name, got)


def test_shipped_recipes_meet_the_evidence_budget():
    """Every shipped recipe trains >= 0.5M tokens per model (5x the first recipes) with >= 3 seeds, so its noise
    margin is a measured seed spread."""
    for name in list_recipes():
        b = load_recipe(name).budget
        assert b["steps"] * b["batch_size"] * b["seq_len"] >= 500_000, name
        assert len(b["seeds"]) >= 3, name


def test_parse_count_and_fit_params():
    assert parse_count("2M") == 2_000_000 and parse_count("500K") == 500_000 and parse_count(1.5e6) == 1_500_000
    with pytest.raises(ConfigError, match="parameter count"):
        parse_count("lots")
    build = lambda d: ModelConfig(layout="(AM)*2", d_model=d, n_heads=2)   # noqa: E731
    cfg, n = fit_params(build, 200_000, range(8, 513, 8), tolerance=0.1)
    assert abs(n - 200_000) <= 20_000 and n == count_parameters(cfg)
    with pytest.raises(ConfigError, match="no d_model meets the budget of 1,000"):
        fit_params(build, 1_000, range(8, 513, 8), tolerance=0.1)          # the embedding alone is larger
    assert depth_for_mixers(lambda n: ModelConfig(layout=f"((SM)*3 AM)*{n}", ssd_headdim=32), 10) == 3


def test_depth_sizing_and_active_parameters(tmp_path):
    r = load_recipe(str(_tiny(tmp_path, TINY.replace('size_by = "width"', "").replace(
        'params = "60K"', 'params = "60K"\nsize_by = "depth"').replace('"(AM)*2"', '"(AM)*{n}"').replace(
        '"S*2"', '"S*{n}"').replace("[model]", "[model]\nd_model = 32"))))
    for c in r.configs:
        cfg, n = r.model_config(c, 256)
        assert cfg.d_model == 32 and abs(n - 60_000) <= 9_000 and "{n}" not in cfg.layout
    from hybridlm.models import CausalLM
    moe = CausalLM(ModelConfig(layout="(AO)*2", d_model=32, n_heads=2, moe_experts=8, moe_topk=2))
    per_expert = 3 * 32 * moe.config.mlp_hidden_size
    assert active_parameters(moe) == moe.num_parameters() - 2 * 6 * per_expert


def test_scale_multiplies_batch_depth_and_width(tmp_path):
    r = load_recipe(str(_tiny(tmp_path)))
    s = r.scaled(2)
    assert s.budget["batch_size"] == 2 * r.budget["batch_size"] and s.budget["params"] == 8 * r.budget["params"]
    assert s.configs[0].layout == "((AM)*2)*2"
    cfg, _ = s.model_config(s.configs[1], 256)
    assert cfg.layout == "(S*2)*2"


@pytest.mark.parametrize("text, message", [
    (TINY.replace('layout = "S*2"', 'layout = "S*2 Q"'), "configuration 'ssd': bad layout 'S\\*2 Q' at column 5"),
    (TINY.replace('name = "ssd"', 'name = "ssd"\nssd_dstate = 8'), "unknown field 'ssd_dstate' \\(did you mean "
                                                                     "'ssd_d_state'\\?\\)"),
    (TINY.replace("steps = 2", "step = 2"), "\\[budget\\]: unknown field 'step'"),
    (TINY.replace('worse = "ssd"', 'worse = "mamba"'), "names unknown configuration 'mamba'"),
    (TINY.replace('title = "tiny"', ""), "missing 'title'"),
], ids=["layout-letter", "model-field", "budget-field", "claim-name", "missing-title"])
def test_bad_recipes_are_one_clear_error(text, message):
    import tomllib
    with pytest.raises(ConfigError, match=message):
        parse_recipe(tomllib.loads(text), "tiny")


def test_budget_no_size_can_meet(tmp_path):
    r = load_recipe(str(_tiny(tmp_path, TINY.replace('params = "60K"', 'params = "1K"'))))
    with pytest.raises(ConfigError, match="recipe 'tiny', configuration 'attn': no d_model meets the budget of 1,000"):
        r.model_config(r.configs[0], 256)


def test_cli_errors_are_one_line(capsys):
    assert main(["ablate", "no-such-recipe"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hybridlm: error: unknown recipe 'no-such-recipe'; shipped recipes:")
    assert main(["ablate", "--list"]) == 0
    assert "rodimus-gates" in capsys.readouterr().out


def test_ablate_quick_writes_table_csv_curves_and_runs(tmp_path, capsys):
    out = tmp_path / "abl"
    assert main(["ablate", str(_tiny(tmp_path)), "--quick", "--out", str(out), "--no-progress"]) == 0
    res = json.loads((out / "ablate.json").read_text())
    assert res["recipe"] == "tiny" and res["title"] == "tiny" and {"torch", "hybridlm", "command"} <= set(res["meta"])
    assert [r["name"] for r in res["rows"]] == ["attn", "ssd"]
    for r in res["rows"]:
        assert {"name", "layout", "params", "val_loss", "val_ppl", "val_tokens", "tokens_per_s", "steps",
                "wall_s"} <= set(r)
        assert r["steps"] == 3 and r["val_tokens"] > 0 and r["val_loss"] > 0 and r["d_model"] == 32
        rows = [json.loads(line) for line in (out / r["name"] / "metrics.jsonl").read_text().splitlines()]
        assert rows[-1]["step"] == 3 and rows[-1]["val_loss"] == pytest.approx(r["val_loss"])
        assert {"step", "loss", "lr", "tokens_per_s", "tokens", "val_loss", "val_ppl"} <= set(rows[-1])
    with open(out / "ablate.csv") as f:
        assert [row["name"] for row in csv.DictReader(f)] == ["attn", "ssd"]
    assert (out / "curves.png").stat().st_size > 1000
    assert "validation on" in capsys.readouterr().out


def _differing(recipe, a, b) -> set[str]:
    """ModelConfig fields (and the layout) in which two configurations of a recipe differ, as written (unsized)."""
    import dataclasses
    ca, cb = (recipe.build(c, 256) for c in (a, b))
    return {f.name for f in dataclasses.fields(ModelConfig) if getattr(ca, f.name) != getattr(cb, f.name)}


@pytest.mark.parametrize("name", sorted(list_recipes()))
def test_every_claim_differs_only_in_what_it_names(name):
    """Recipe isolation: the two configurations of a claim differ in exactly the fields its `varies` lists; a
    claim whose pairing is the paper's own (several things at once) has an isolated claim beside it."""
    r = load_recipe(name)
    by = {c.name: c for c in r.configs}
    for cl in r.claims:
        assert "varies" in cl, f"{name}: claim {cl['text']!r} does not say what it varies"
        assert _differing(r, by[cl["better"]], by[cl["worse"]]) == set(cl["varies"]), cl["text"]
        if cl.get("pairing") == "paper":
            assert any(o.get("pairing", "isolated") == "isolated" and {o["better"], o["worse"]} & {cl["better"]}
                       for o in r.claims), f"{name}: {cl['text']!r} has no isolated pairing"


def test_ablate_resumes_finished_runs_and_adds_seeds(tmp_path, capsys):
    text = TINY.replace("[budget]\n", "[budget]\nseeds = [0, 1]\neval_seq_lens = [64]\n") + 'at = 64\nvaries = ["layout"]\n'
    out = tmp_path / "abl"
    assert main(["ablate", str(_tiny(tmp_path, text)), "--quick", "--out", str(out), "--no-progress"]) == 0
    first = json.loads((out / "ablate.json").read_text())
    row = first["rows"][0]
    assert row["seeds"] == [0, 1] and len(row["val_losses"]) == 2 and row["val_loss_std"] is not None
    assert set(row["val_loss_at"]) == {"64"} and row["val_loss_at"]["64"] > 0
    stamp = (out / "attn" / "seed0" / "metrics.jsonl").stat().st_mtime_ns
    assert main(["ablate", str(_tiny(tmp_path, text)), "--quick", "--out", str(out), "--no-progress",
                 "--seeds", "0,1,2"]) == 0
    again = json.loads((out / "ablate.json").read_text())
    assert (out / "attn" / "seed0" / "metrics.jsonl").stat().st_mtime_ns == stamp    # seed 0 was not retrained
    assert again["rows"][0]["val_losses"][:2] == row["val_losses"] and len(again["rows"][0]["val_losses"]) == 3


def test_ablate_measures_captured_attention_mass(tmp_path, capsys):
    text = """
title = "indexer"
source = "a test"
minutes_per_model = 1
measure = ["captured_mass"]
[model]
n_heads = 2
[[config]]
name = "trained"
preset = "deepseek-sparse"
n_layers = 1
dsa_topk = 4
[[config]]
name = "frozen"
preset = "deepseek-sparse"
n_layers = 1
dsa_topk = 4
dsa_kl_weight = 0.0
[[claim]]
text = "training helps"
better = "trained"
worse = "frozen"
"""
    out = tmp_path / "abl"
    assert main(["ablate", str(_tiny(tmp_path, text)), "--quick", "--out", str(out), "--no-progress"]) == 0
    rows = {r["name"]: r for r in json.loads((out / "ablate.json").read_text())["rows"]}
    for r in rows.values():
        assert 0 < r["captured_random"] < 1 and 0 < r["captured_mass"] <= 1 and 0 < r["captured_mass_init"] <= 1
        assert max(r["captured_mass"], r["captured_mass_init"]) <= r["captured_oracle"] + 1e-6
    # the frozen indexer is still its initialisation: the redrawn init reproduces the run's exactly
    assert rows["frozen"]["captured_mass"] == pytest.approx(rows["frozen"]["captured_mass_init"], abs=1e-9)
    assert rows["trained"]["captured_mass"] != pytest.approx(rows["trained"]["captured_mass_init"], abs=1e-9)
    assert rows["trained"]["indexer_kl"] > 0 and "indexer_kl" not in rows["frozen"]
    metrics = [json.loads(line) for line in (out / "trained" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["indexer_kl"] >= 0 for m in metrics)
    assert "captured attention mass" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="unknown measure 'recall'"):
        load_recipe(str(_tiny(tmp_path, text.replace('"captured_mass"', '"recall"'))))


def test_params_flag_sizes_d_model():
    """`--params N` (train, info): the preset at the width, a multiple of 64, nearest N parameters within 10%."""
    import argparse
    from hybridlm.commands.common import model_config
    from hybridlm.models import presets
    from hybridlm.errors import InputError
    args = argparse.Namespace(preset="mamba2", set=[], n_layers=2, d_model=None, n_heads=None, params="3M")
    cfg = model_config(args, vocab_size=257)
    n = count_parameters(cfg)
    assert cfg.d_model % 64 == 0 and cfg.layout == presets.get("mamba2", n_layers=2).layout and abs(n - 3e6) <= 3e5
    with pytest.raises(InputError, match="--params or --d-model"):
        model_config(argparse.Namespace(**{**vars(args), "d_model": 128}), vocab_size=257)
    with pytest.raises(ConfigError, match="parameter count"):
        model_config(argparse.Namespace(**{**vars(args), "params": "lots"}), vocab_size=257)
