"""MQAR data generators, the `hybridlm mqar` sweep and `hybridlm plot` (through the CLI)."""
import json

import pytest
import torch

from hybridlm.cli import main as cli
from hybridlm.data.mqar import IGNORE, curriculum, mqar
from hybridlm.errors import InputError


def _structure(x, y, num_pairs, vocab):
    """Check one batch: returns nothing, asserts every MQAR invariant row by row."""
    half = vocab // 2
    for row, lab in zip(x.tolist(), y.tolist()):
        answers = [t for t, v in enumerate(lab) if v != IGNORE]
        assert len(answers) == num_pairs                              # one answer per pair
        keys = [row[t - 1] for t in answers]                          # the query right before each answer
        assert len(set(keys)) == num_pairs and all(1 <= k < half for k in keys)
        for k, t in zip(keys, answers):
            first = row.index(k)                                      # the key's pair comes first ...
            assert first < t - 1 and row[first + 1] == lab[t]         # ... and its value is the answer
            assert half <= lab[t] < vocab
            assert row.count(k) == 2                                  # pair + query: no other repeat
        assert sum(1 for t in range(len(row)) if row[t] in keys) == 2 * num_pairs


@pytest.mark.parametrize("hard", [False, True])
def test_generator_structure(hard):
    x, y = mqar(16, 64, 8, 64, seed=3, hard=hard)
    assert x.shape == y.shape == (16, 64) and x.dtype == y.dtype == torch.long
    assert 0 <= x.min() and x.max() < 64
    _structure(x, y, 8, 64)


def test_zoology_layout_and_hard_filler():
    x, y = mqar(64, 64, 4, 128, seed=0)
    assert (x[:, 0:8:2] < 64).all() and (x[:, 1:8:2] >= 64).all()    # pairs packed first: key, value, ...
    assert (x[:, 8:] != 0).sum(1).eq(4).all()                         # then only the queries; 0 elsewhere
    xh, yh = mqar(64, 64, 4, 128, seed=0, hard=True)
    assert ((xh != 0).sum(1) > 40).all()                              # random filler everywhere
    queries = (yh != IGNORE).nonzero()[:, 1] - 1
    assert (queries >= 32).all()                                      # queries after the pairs' half
    # power law (a = 0.01): most queries sit in the first slots of the query section
    gaps = ((y != IGNORE).nonzero()[:, 1] - 1 - 8) // 2
    assert (gaps < 8).float().mean() > 0.3


def test_deterministic_under_seed():
    a = mqar(8, 128, 16, 256, seed=7, hard=True)
    b = mqar(8, 128, 16, 256, seed=7, hard=True)
    c = mqar(8, 128, 16, 256, seed=8, hard=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    torch.manual_seed(123)                                            # the global RNG plays no part
    assert torch.equal(a[0], mqar(8, 128, 16, 256, seed=7, hard=True)[0])
    assert not torch.equal(a[0], c[0])


def test_curriculum_and_bad_sizes():
    assert curriculum(64) == [8, 16, 32, 64] and curriculum(2) == [1, 2]
    with pytest.raises(InputError, match="too short for 16 key-value pairs"):
        mqar(4, 60, 16, 256)
    with pytest.raises(InputError, match="vocab_size"):
        mqar(4, 64, 16, 20)


def test_mqar_quick_cli(tmp_path, capsys):
    out = tmp_path / "mq"
    assert cli(["mqar", "--quick", "--lr", "3e-3", "1e-2", "--out", str(out)]) == 0
    data = json.loads((out / "mqar.json").read_text())
    rows = data["rows"]
    assert {r["name"] for r in rows} == {"attention", "mamba2"} and len(data["meta"]["trials"]) == 4
    for r in rows:
        assert set(r) == {"name", "layout", "d_model", "seq_len", "num_pairs", "accuracy", "accuracy_min",
                          "accuracy_max", "seeds", "params", "state_bytes", "lr", "steps", "rising", "devices"}
        assert 0 <= r["accuracy"] <= 1 and r["params"] > 0 and r["state_bytes"] > 0 and r["lr"] in (3e-3, 1e-2)
    assert rows[0]["layout"] == "(AM)*2"
    assert all(t["curve"] and t["curve"][-1][0] == t["steps"] for t in data["meta"]["trials"])
    assert {t["device"] for t in data["meta"]["trials"]} == {"cpu"} and rows[0]["devices"] == ["cpu"]
    assert (out / "mqar.csv").read_text().startswith("name,layout,d_model")
    for png in ("mqar.png", "mqar-state.png", "mqar-curves.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_mqar_resumes_finished_runs_and_refuses_another_protocol(tmp_path, capsys, monkeypatch):
    out = tmp_path / "mq"
    assert cli(["mqar", "--quick", "--out", str(out)]) == 0
    first = json.loads((out / "mqar.json").read_text())["meta"]["trials"]
    assert json.loads((out / "mqar.json").read_text())["meta"]["settings"]["schedule"].startswith(
        "linear warmup over 1 steps")                                   # the page states the warmup it ran
    import hybridlm.eval.mqar as ev

    def fail(*a, **k):
        raise AssertionError("a finished run was trained again")
    monkeypatch.setattr(ev, "train_mqar", fail)
    capsys.readouterr()
    assert cli(["mqar", "--quick", "--out", str(out)]) == 0                 # everything done: nothing trains
    assert "resuming: 4 runs done" in capsys.readouterr().out
    assert json.loads((out / "mqar.json").read_text())["meta"]["trials"] == first
    assert cli(["mqar", "--quick", "--out", str(out), "--weight-decay", "0"]) == 2
    assert "another protocol" in capsys.readouterr().err
    assert cli(["mqar", "--quick", "--out", str(out), "--warmup", "0"]) == 2    # the schedule is the protocol too
    assert "warmup: 1 there, 0 here" in capsys.readouterr().err
    data = json.loads((out / "mqar.json").read_text())                   # a file from before --warmup: the default
    del data["meta"]["settings"]["warmup"]
    (out / "mqar.json").write_text(json.dumps(data))
    assert cli(["mqar", "--quick", "--out", str(out)]) == 0


def test_sweeps_sharing_an_out_directory_keep_each_others_runs(tmp_path):
    """Two sweeps over different axes write one mqar.json: each write merges what the other wrote meanwhile, unless
    the protocol differs."""
    from hybridlm.eval.mqar_sweep import write_results

    def trial(name, d):
        return dict(name=name, layout="(AM)*2", d_model=d, seq_len=64, num_pairs=4, lr=3e-3, seed=0, accuracy=0.5,
                    loss=1.0, params=1, state_bytes=1, steps=10, rising=False)
    settings = {"steps": 10, "layers": 2, "pairs": "T/16", "hard": False, "vocab_size": 64, "curriculum": False,
                "batch_size": 8, "train_examples": 64, "test_examples": 32, "eval_every": 5, "target": 0.99,
                "weight_decay": 0.1}
    write_results(str(tmp_path), {"command": "hybridlm mqar --d-models 32", "settings": settings}, [trial("a", 32)])
    mine = [trial("b", 64)]                                    # a second sweep that started before the first wrote
    write_results(str(tmp_path), {"command": "hybridlm mqar --d-models 64", "settings": settings}, mine)
    res = json.loads((tmp_path / "mqar.json").read_text())
    assert [(t["name"], t["d_model"]) for t in res["meta"]["trials"]] == [("a", 32), ("b", 64)] == \
        [(t["name"], t["d_model"]) for t in mine]
    assert res["meta"]["commands"] == ["hybridlm mqar --d-models 32", "hybridlm mqar --d-models 64"]
    assert len(res["rows"]) == 2 and not list(tmp_path.glob("*.tmp"))
    other = dict(settings, steps=20)                           # another protocol: nothing of the file is merged
    write_results(str(tmp_path), {"command": "x", "settings": other}, [trial("c", 32)])
    assert [t["name"] for t in json.loads((tmp_path / "mqar.json").read_text())["meta"]["trials"]] == ["c"]


def test_warmup_sets_the_schedule(monkeypatch):
    """--warmup / warmup= replaces the default (2% of the budget, at most 200 steps) and is checked."""
    import hybridlm.eval.mqar as ev
    from hybridlm.eval.mqar_sweep import build_config
    assert [ev.warmup_steps(s) for s in (6, 4000, 8000, 20000)] == [1, 80, 160, 200]
    lrs = []
    real = ev.lr_at
    monkeypatch.setattr(ev, "lr_at", lambda step, **k: lrs.append((step, k["warmup"])) or real(step, **k))
    task = ev.MQARTask(seq_len=32, num_pairs=2, vocab_size=64, train_examples=64, test_examples=16)
    cfg = build_config("(AM)*1", {}, d_model=16, seq_len=32, vocab_size=64, layers=1)
    ev.train_mqar(cfg, task, steps=4, batch_size=8, lr=1e-3, eval_every=5, warmup=3, target=1.01, progress=False)
    assert sorted(set(lrs)) == [(0, 3), (1, 3), (2, 3), (3, 3)]     # (once per param group)
    with pytest.raises(InputError, match=r"warmup must be in \[0, steps\): got 4 warmup steps for 4 steps"):
        ev.train_mqar(cfg, task, steps=4, batch_size=8, lr=1e-3, warmup=4, progress=False)


def test_early_stopping_stops_at_the_threshold(monkeypatch):
    """Held-out accuracy is checked every eval_every steps; the run stops at the first check >= target, and a
    target above 1 uses the whole budget. Once an lr reaches the target the sweep skips the others."""
    import hybridlm.eval.mqar as ev
    from hybridlm.eval.mqar_sweep import build_config
    seen = iter([0.2, 0.5, 0.995, 1.0])
    monkeypatch.setattr(ev, "accuracy", lambda *a, **k: next(seen))
    task = ev.MQARTask(seq_len=32, num_pairs=2, vocab_size=64, train_examples=64, test_examples=16)
    cfg = build_config("(AM)*1", {}, d_model=16, seq_len=32, vocab_size=64, layers=1)
    r = ev.train_mqar(cfg, task, steps=40, batch_size=8, lr=1e-3, eval_every=5, progress=False)
    assert r["steps"] == 15 and r["stopped_early"] and r["accuracy"] == 0.995
    assert [s for s, _ in r["curve"]] == [5, 10, 15]
    monkeypatch.setattr(ev, "accuracy", lambda *a, **k: 0.999)
    r = ev.train_mqar(cfg, task, steps=12, batch_size=8, lr=1e-3, eval_every=5, target=1.01, progress=False)
    assert r["steps"] == 12 and not r["stopped_early"] and [s for s, _ in r["curve"]] == [5, 10, 12]


def test_lr_sweep_stops_once_one_reaches_the_target(tmp_path, monkeypatch, capsys):
    import hybridlm.eval.mqar as ev
    calls = []

    def fake(cfg, task, *, lr, steps, **k):
        calls.append(lr)
        return {"accuracy": 0.995 if lr == 3e-3 else 0.3, "loss": 1.0, "params": 1, "steps": steps,
                "stopped_early": lr == 3e-3, "curve": [[steps, 0.3]], "wall_s": 0.0}
    monkeypatch.setattr(ev, "train_mqar", fake)
    assert cli(["mqar", "--quick", "--lr", "1e-3", "3e-3", "1e-2", "--layouts", "a=A", "--out", str(tmp_path)]) == 0
    assert calls == [1e-3, 3e-3]
    row = json.loads((tmp_path / "mqar.json").read_text())["rows"][0]
    assert row["lr"] == 3e-3 and row["accuracy"] == 0.995


def test_lr_sweep_skips_smaller_lrs_after_a_rising_run(tmp_path, monkeypatch):
    """A run still rising when its budget ends was cut by the budget: a smaller lr learns slower, so it is not
    tried; a run that plateaued below the target gets the next lr."""
    import hybridlm.eval.mqar as ev
    calls = []

    def fake(cfg, task, *, lr, steps, **k):
        calls.append(lr)
        curve = [[steps // 2, 0.3], [steps, 0.6 if lr == 3e-3 else 0.3]]    # 3e-3 rises, 1e-2 is flat
        return {"accuracy": curve[-1][1], "loss": 1.0, "params": 1, "steps": steps, "stopped_early": False,
                "curve": curve, "wall_s": 0.0}
    monkeypatch.setattr(ev, "train_mqar", fake)
    assert cli(["mqar", "--quick", "--lr", "1e-2", "3e-3", "1e-3", "--layouts", "a=A", "--out", str(tmp_path)]) == 0
    assert calls == [1e-2, 3e-3]
    trials = json.loads((tmp_path / "mqar.json").read_text())["meta"]["trials"]
    assert {t["lr"]: t["rising"] for t in trials} == {1e-2: False, 3e-3: True}
    calls.clear()                                           # ascending: a larger lr than the rising one still runs
    assert cli(["mqar", "--quick", "--lr", "3e-3", "1e-2", "1e-3", "--layouts", "a=A", "--out", str(tmp_path / "b")]) == 0
    assert calls == [3e-3, 1e-2]


@pytest.mark.parametrize("argv, needle", [
    (["--layouts", "x=bogus"], "neither a preset nor a layout"),
    (["--layouts", "x=A:no_such_field=1"], "no_such_field"),
    (["--pairs-div", "2"], "too short for 16 key-value pairs"),
    (["--warmup", "6"], "warmup must be in [0, steps): got 6 warmup steps for 6 steps"),
])
def test_mqar_bad_input(tmp_path, capsys, argv, needle):
    assert cli(["mqar", "--quick", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hybridlm: error: ") and needle in err[0], err


def test_plot_cli(tmp_path, capsys):
    for i, name in enumerate(("a", "b")):
        (tmp_path / name).mkdir()
        lines = [{"step": s, "loss": 5.0 - s / 10 - i, "lr": 1e-3, "tokens_per_s": 1.0, "tokens": s * 10,
                  "val_loss": (5.2 - s / 10) if s % 5 == 0 else None, "val_ppl": None} for s in range(1, 11)]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    png = tmp_path / "curves.png"
    assert cli(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert cli(["plot", str(tmp_path / "a"), "--metric", "val_loss", "--out", str(png)]) == 0
    assert cli(["plot", str(tmp_path / "missing"), "--out", str(png)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_layout_specs():
    from hybridlm.eval.mqar_sweep import build_config, parse_layouts
    specs = parse_layouts("t=transformer++, x=(AM)*3,r=R:rodimus_d_state=8", layers=2)
    assert specs == [("t", "transformer++", {}), ("x", "(AM)*3", {}), ("r", "(RM)*2", {"rodimus_d_state": 8})]
    cfgs = [build_config(v, o, d_model=16, seq_len=32, vocab_size=64, layers=2) for _, v, o in specs]
    assert [c.layout for c in cfgs] == ["(AM)*2", "(AM)*3", "(RM)*2"]
    assert cfgs[2].rodimus_d_state == 8 and cfgs[1].n_heads == 1 and cfgs[0].ssd_headdim == 32
    with pytest.raises(InputError, match="twice"):
        parse_layouts("a=A,a=S", layers=2)


def test_still_rising_marks_runs_cut_by_the_budget():
    from hybridlm.eval.mqar_sweep import still_rising
    assert still_rising([[250, 0.3], [750, 0.5], [1000, 0.6]], 1000)           # +0.1 over the last quarter
    assert not still_rising([[250, 0.3], [750, 0.6], [1000, 0.605]], 1000)     # flat at the end
    assert not still_rising([[250, 0.5], [500, 0.995]], 1000)                  # stopped early at the target
    assert not still_rising([], 1000)


def test_merge_joins_runs_made_elsewhere_and_records_their_device(tmp_path, capsys):
    """`--merge` adds another machine's runs (same protocol) to --out without training: the runs keep the device
    they ran on, the source's command is recorded against --out, and another protocol is refused."""
    here, gpu = tmp_path / "here", tmp_path / "gpu"
    assert cli(["mqar", "--quick", "--out", str(here), "--layouts", "a=A"]) == 0
    assert cli(["mqar", "--quick", "--out", str(gpu), "--layouts", "m=S:ssd_d_state=16"]) == 0
    res = json.loads((gpu / "mqar.json").read_text())
    res["meta"]["device"] = "cuda (NVIDIA H200)"
    for t in res["meta"]["trials"]:
        del t["device"]                                   # a file from before runs recorded it: the meta's
    (gpu / "mqar.json").write_text(json.dumps(res))
    assert cli(["mqar", "--merge", str(gpu), "--out", str(here)]) == 0
    merged = json.loads((here / "mqar.json").read_text())
    assert {(t["name"], t["device"]) for t in merged["meta"]["trials"]} == {("a", "cpu"), ("m", "cuda (NVIDIA H200)")}
    assert {r["name"]: r["devices"] for r in merged["rows"]} == {"a": ["cpu"], "m": ["cuda (NVIDIA H200)"]}
    assert not any(str(gpu) in c for c in merged["meta"]["commands"] + [merged["meta"]["command"]])  # as --out
    assert cli(["mqar", "--merge", str(gpu), "--out", str(here)]) == 0     # twice: nothing new
    assert len(json.loads((here / "mqar.json").read_text())["meta"]["trials"]) == len(merged["meta"]["trials"])
    other = tmp_path / "other"
    assert cli(["mqar", "--quick", "--out", str(other), "--layouts", "a=A", "--weight-decay", "0"]) == 0
    capsys.readouterr()
    assert cli(["mqar", "--merge", str(other), "--out", str(here)]) == 2
    assert "another protocol" in capsys.readouterr().err
    assert cli(["mqar", "--merge", str(tmp_path / "none"), "--out", str(here)]) == 2


def test_state_size_figure(tmp_path):
    """Rodimus figure 1b: where both families ran at 3+ state sizes at one (d_model, T), mqar-families.png plots
    accuracy against state bytes, one line per family."""
    from hybridlm.eval.mqar_plots import plot_families
    from hybridlm.eval.mqar_sweep import state_size_points

    def row(name, acc, state, d=64):
        return dict(name=name, d_model=d, seq_len=128, num_pairs=8, accuracy=acc, accuracy_min=acc, accuracy_max=acc,
                    state_bytes=state)
    rows = [row(f"rodimus-n{n}", 0.9, 1200 * n) for n in (8, 16, 32)] + \
        [row(f"mamba2-n{n}", 0.8, 1250 * n) for n in (16, 32, 64)] + [row("rodimus-n16", 0.5, 9, d=32), row("kda", 1, 5)]
    assert list(state_size_points(rows)) == [(64, 128)] and len(state_size_points(rows)[(64, 128)]) == 6
    assert not state_size_points(rows[:5])                                  # Mamba-2 at two sizes only
    plot_families(rows, str(tmp_path / "f.png"), "t")
    assert (tmp_path / "f.png").stat().st_size > 1000
