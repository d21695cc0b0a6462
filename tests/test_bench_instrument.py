"""`hybridlm bench` as the instrument (no transformers needed): presets at a stated depth/size, --quick smoke run,
the fresh-process memory probe, and `hybridlm report`'s verdicts."""
import json


from hybridlm.bench.instrument import preset_config, step_memory
from hybridlm.bench.measure import fresh
from hybridlm.commands.report import render
from hybridlm.eval.claims import (NOT_COMPARABLE, NOT_REPRODUCED, REPRODUCED, ablation_verdict, bench_claims,
                                  gpu_step_times)
from hybridlm.cli import main
from hybridlm.models.sizing import count_parameters, token_mixers


def test_presets_compared_at_the_same_depth_and_size():
    kw = dict(d_model=64, params=None, vocab_size=256, max_seq_len=64)
    for name, layout in (("transformer++", "(AM)*8"), ("mamba2", "S*8"), ("cheems", "((SE)*7 FE)*1"),
                         ("rodimus++", "[RWM]*4")):                        # R and W are both token mixers
        cfg = preset_config(name, layers=8, **kw)
        assert cfg.layout == layout and token_mixers(cfg) >= 8
    sized = {n: preset_config(n, layers=4, d_model=None, params=4_000_000, vocab_size=8192, max_seq_len=64)
             for n in ("transformer++", "mamba2", "rodimus")}
    for cfg in sized.values():
        assert abs(count_parameters(cfg) - 4_000_000) <= 400_000 and token_mixers(cfg) == 4


def test_bench_quick_writes_results_and_three_plots(tmp_path, capsys):
    out = tmp_path / "bench" / "results.json"
    assert main(["bench", "--quick", "--presets", "transformer++,mamba2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["mode"] == "ours" and set(res["configs"]) == {"transformer++", "mamba2"}
    assert all(c["mixer_layers"] == 2 for c in res["configs"].values())
    assert [(r["preset"], r["batch"], r["seq_len"]) for r in res["train"]] == [
        ("transformer++", 2, 32), ("mamba2", 2, 32), ("transformer++", 1, 64), ("mamba2", 1, 64)]
    for r in res["train"]:
        assert r["mode"] == "eager" and r["train_tokens_per_s"] > 0 and r["forward_tokens_per_s"] > 0
        assert 0 < r["train_mfu"] < 2 and len(r["train_times_s"]) == 2
    lat = {r["preset"]: [x for x in res["latency"] if x["preset"] == r["preset"]] for r in res["latency"]}
    assert lat["mamba2"][0]["state_bytes"] == lat["mamba2"][1]["state_bytes"]            # constant state
    assert lat["transformer++"][0]["state_bytes"] < lat["transformer++"][1]["state_bytes"]  # growing KV cache
    assert len(res["plots"]) == 3 and all(p.endswith(".png") for p in res["plots"])
    for p in res["plots"]:
        assert (tmp_path / "bench" / p.rsplit("/", 1)[-1]).stat().st_size > 1000
    assert "state bytes" in capsys.readouterr().out


def test_memory_probe_measures_the_step_in_a_fresh_process():
    cfg = preset_config("mamba2", layers=1, d_model=64, params=None, vocab_size=512, max_seq_len=2048,
                        overrides=dict(ssd_d_state=16, ssd_headdim=32))
    r = fresh(step_memory, config=cfg.to_dict(), batch=1, seq_len=2048)
    # logits alone are 2048 x 512 x 4 B = 4 MiB, and backward keeps a few such tensors; weights are not counted
    assert 4 * 2**20 < r["peak_bytes"] < 512 * 2**20 and r["method"].startswith("VmHWM")


def _ablate(rows, claims):
    return {"recipe": "r", "title": "T", "source": "000_x.txt, table 1", "claims": claims, "_dir": "/nonexistent",
            "meta": {"command": "hybridlm ablate r", "budget": dict(steps=2, batch_size=1, seq_len=8, lr=1e-3,
                     seeds=[0], max_bytes=1, params=None, eval_tokens=0)},
            "rows": [dict(name=n, layout="S", d_model=8, params=1, active_params=1, val_loss=v, val_ppl=1.0,
                          val_tokens=10, tokens_per_s=1.0, wall_s=1.0) for n, v in rows]}


def test_report_verdicts_and_page(tmp_path):
    rows = {"a": {"val_loss": 1.50}, "b": {"val_loss": 1.60}, "c": {"val_loss": 1.51}}
    assert ablation_verdict({"better": "a", "worse": "b"}, rows, 0.02)[0] == REPRODUCED
    assert ablation_verdict({"better": "b", "worse": "a"}, rows, 0.02)[0] == NOT_REPRODUCED
    assert ablation_verdict({"better": "c", "worse": "a"}, rows, 0.02)[0] == NOT_COMPARABLE
    spread = {"a": {"val_loss": 1.50, "val_loss_std": 0.06}, "b": {"val_loss": 1.60}}
    assert ablation_verdict({"better": "a", "worse": "b"}, spread, 0.02)[0] == NOT_COMPARABLE   # 2 x 0.06 > 0.1
    bench = {"configs": {"transformer++": {}, "mamba2": {}}, "train": [
        dict(preset="transformer++", mode="eager", batch=1, seq_len=16384, train_tokens_per_s=700.0, train_mfu=0.3),
        dict(preset="mamba2", mode="eager", batch=1, seq_len=16384, train_tokens_per_s=3500.0, train_mfu=0.3)],
        "latency": [dict(preset="mamba2", context=c, median_ms=1.0, state_bytes=5) for c in (128, 8192)]}
    verdicts = {c["claim"].split(" ")[0] + c["claim"].split(" ")[1]: c["verdict"] for c in bench_claims(bench)}
    assert verdicts == {"mamba2fwd+bwd": "met", "mamba2decode": "met"}
    res = {"dir": str(tmp_path), "ablate": [_ablate([("a", 1.5), ("b", 1.6)], [dict(text="a beats b", better="a",
                                                                                  worse="b", paper="PPL 1 vs 2")])],
           "mqar": None, "bench": None}
    page = render(res, str(tmp_path / "results.md"))
    assert "| a beats b | 000_x.txt | PPL 1 vs 2 | 1.500 vs 1.600 (Δ +0.100; margin 0.020, assumed) | **reproduced** |" \
        in page
    # seeds measure the margin; a claim with `at` is judged at the training length and at that length
    seeded = _ablate([("a", 1.50), ("b", 1.52)], [dict(text="a beats b", better="a", worse="b", at=64,
                                                       paper_delta=0.02)])
    for r, sd, wall in zip(seeded["rows"], (0.01, 0.02), (10, 20)):
        r.update(val_loss_std=sd, val_losses=[r["val_loss"] - sd, r["val_loss"] + sd], seeds=[0, 1], wall_s=wall,
                 val_loss_at={"64": r["val_loss"] + 0.5}, val_loss_at_std={"64": sd})
    page = render(dict(res, ablate=[seeded]), str(tmp_path / "results.md"))
    assert page.count("**not resolvable at this scale**") == 2 and "margin 0.040, 2 × seed s.d." in page
    assert "a beats b — at 64 tokens" in page and "`hybridlm ablate r --scale 4`" in page   # (0.04 / 0.02)^2 = 4
    assert "(≈4.3 CPU-hours as measured here, " in page          # (10 + 20) s x 2 seeds x 4^4 (FLOPs grow as K^4)
    assert "GPU time not measured)" in page and "GPU-hours" not in page          # never a FLOP count
    gpu = gpu_step_times({"env": {"gpu": "NVIDIA H100"}, "steps": {"rows": [
        dict(kind="ablate", recipe="r", scale=4, config=n, ms_per_step=ms) for n, ms in (("a", 50.0), ("b", 100.0))]
        + [dict(kind="mqar", layout="a", d_model=64, ms_per_step=1.0)]}})
    assert gpu_step_times({"dry_run": True, "steps": {"rows": [dict(kind="ablate", recipe="r", scale=4, config="a",
                                                                       ms_per_step=1.0)]}}) == {}
    page = render(dict(res, ablate=[seeded], gpu=gpu), str(tmp_path / "results.md"))
    assert "≈0.00017 GPU-hours from step times measured on NVIDIA H100)" in page   # 2 steps x 2 seeds x 0.15 s
    seeded["claims"][0]["paper_delta"] = 0.1     # the paper's effect exceeds our margin: sized for ours, (0.04/0.02)^2
    assert "`hybridlm ablate r --scale 4`" in render(dict(res, ablate=[seeded]), str(tmp_path / "results.md"))
    assert "| 2.0000 ± 0.0100 |" in page                                                     # the 4x-length column
    assert "No MQAR results yet" in page and "No instrument results yet" in page
    assert main(["report", "--results", str(tmp_path / "missing")]) == 2


def test_mqar_claims_on_a_sweep():
    from hybridlm.eval.claims import mqar_claims, pending_rows

    def row(name, d, acc, state):
        return dict(name=name, layout="x", d_model=d, seq_len=64, num_pairs=4, accuracy=acc, state_bytes=state)
    rows = [row("attention", 32, 0.60, 9), row("attention", 64, 0.99, 9), row("attention", 128, 0.97, 9),
            row("mamba2-n16", 32, 0.2, 100), row("mamba2-n16", 64, 0.5, 200), row("mamba2-n64", 32, 0.4, 400),
            row("mamba2-n64", 64, 0.6, 800), row("rodimus-n16", 32, 0.3, 95), row("rodimus-n16", 64, 0.4, 190),
            row("inner-fn-dynmask", 32, 0.7, 9), row("gated-deltanet", 64, 0.9, 300)]
    got = {c["claim"].split(" ")[0] + " " + c["claim"].split(" ")[1]: c for c in mqar_claims({"rows": rows})}
    assert got["attention is"]["verdict"] == REPRODUCED and "lowest 0.970" in got["attention is"]["here"]
    assert got["SSD accuracy"]["verdict"] == REPRODUCED            # rises with d; N 64 >= N 16 at each d
    assert got["Rodimus at"]["verdict"] == NOT_REPRODUCED and "1 of 2" in got["Rodimus at"]["here"]
    assert got["inner-function attention"]["verdict"] == REPRODUCED
    assert got["Gated DeltaNet"]["verdict"] == REPRODUCED and "vs mamba2-n16 0.50" in got["Gated DeltaNet"]["here"]
    rows[5]["accuracy"] = 0.1                                       # N 64 below N 16 at d 32
    assert {c["claim"][:12]: c["verdict"] for c in mqar_claims({"rows": rows})}["SSD accuracy"] == NOT_REPRODUCED
    rows[5]["rising"] = True            # ... but that run was still gaining when its budget ended: the budget decides
    got = {c["claim"][:12]: c for c in mqar_claims({"rows": rows})}["SSD accuracy"]
    assert got["verdict"] == NOT_COMPARABLE and "still rising" in got["here"]
    rows[5]["rising"] = False           # ... or an lr of the protocol has not run for it yet (an interrupted sweep)
    sweep = {"rows": rows, "meta": {"settings": {"target": 0.99, "lr": [3e-3, 1e-3]},
                                    "trials": [dict(r, lr=3e-3, seed=0) for r in rows]}}
    assert {c["claim"][:12]: c["verdict"] for c in mqar_claims(sweep)}["SSD accuracy"] == NOT_COMPARABLE
    sweep["meta"]["trials"] += [dict(rows[5], lr=1e-3, seed=0)]
    assert {c["claim"][:12]: c["verdict"] for c in mqar_claims(sweep)}["SSD accuracy"] == NOT_REPRODUCED
    # every seed of a row needs its lrs: a second seed without the smaller lr leaves the row pending
    sweep["meta"]["trials"] += [dict(rows[5], lr=3e-3, seed=1)]
    assert pending_rows(sweep)(dict(rows[5], seeds=[0, 1])) and not pending_rows(sweep)(dict(rows[5], seeds=[0]))
    sweep["meta"]["trials"][-1]["rising"] = True             # ... unless that seed was still rising at the larger lr
    assert not pending_rows(sweep)(dict(rows[5], seeds=[0, 1]))


def test_mqar_claims_on_the_state_size_figure_and_a_larger_budget():
    from hybridlm.eval.claims import mqar_claims

    def row(name, acc, state, d=64, T=128, **kw):
        return dict(name=name, layout="x", d_model=d, seq_len=T, num_pairs=8, accuracy=acc, accuracy_min=acc,
                    accuracy_max=acc, state_bytes=state, steps=8000, seeds=[0], **kw)
    rows = [row(f"rodimus-n{n}", 0.99, 1200 * n) for n in (8, 16, 32, 64)] + \
        [row(f"mamba2-n{n}", acc, 1250 * n) for n, acc in ((16, 0.9), (32, 0.98), (64, 0.99), (128, 0.99))]
    def claim(start, *a, **k):
        return next(c for c in mqar_claims(*a, **k) if c["claim"].startswith(start))
    fig = claim("Rodimus at least as accurate", {"rows": rows})
    assert fig["verdict"] == REPRODUCED and "3 of 3 equal-state pairs" in fig["here"] and "n 8/16/32/64" in fig["claim"]
    rows[2]["accuracy"] = 0.9                                     # Rodimus n32 below Mamba-2 N32
    assert claim("Rodimus at least as accurate", {"rows": rows})["verdict"] == NOT_REPRODUCED
    # inner-function attention cut by the 8,000-step budget is judged on a sweep of the point with a larger one
    small = [row("attention", 0.99, 9, d=32, T=64), row("inner-fn-dynmask", 0.6, 9, d=32, T=64, rising=True)]
    sweep = {"rows": small, "meta": {"settings": {"steps": 8000}}}
    inner = "inner-function attention with dynamic mask"
    assert claim(inner, sweep)["verdict"] == NOT_COMPARABLE
    longer = {"rows": [dict(small[1], accuracy=0.991, steps=18500, rising=False)],
              "meta": {"settings": {"steps": 32000}}}
    got = claim(inner, sweep, extra=[longer])
    assert got["verdict"] == REPRODUCED and "within a 32,000-step budget: 18,500 steps" in got["here"]
    assert "8,000 steps leave it at 0.600↑" in got["here"]
