"""The GPU check (`hybridlm bench --suite gpu`, scripts/gpu-check.sh) as a CPU dry run: every part runs at tiny
sizes under Triton's interpreter and leaves numbers, so the check cannot rot while no GPU is at hand."""
import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from hybridlm.bench import gpu                                      # noqa: E402
from hybridlm.errors import ConfigError                             # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "gpu-check.json"
    # generous budgets: a loaded CI machine must not cut a part (the run itself takes well under a minute)
    res = gpu.run_gpu_check(dry_run=True, log=lambda *_: None, write=lambda r: gpu.write(r, str(out)), time_limit=900)
    assert all(not res[p]["cut"] for p in gpu.PARTS), [res[p]["cut"] for p in gpu.PARTS]
    return res, out


def test_dry_run_measures_every_part(dry):
    res, out = dry
    on_disk = json.loads(out.read_text())
    assert set(gpu.PARTS) <= set(on_disk) and on_disk["dry_run"] is True
    c = res["correctness"]
    assert c["failed"] == 0, [r for r in c["rows"] if not r["ok"]]
    assert {r["check"] for r in c["rows"]} >= {"ssd triton", "gla triton", "cdmoe triton", "decode = forward",
                                                "bf16 train step"}
    assert all(_finite(r["max_rel_err"]) for r in c["rows"] if "max_rel_err" in r)
    ops = {r["op"] for r in res["kernels"]["rows"] if _finite(r.get("ours", {}).get("fwd_bwd_ms"))}
    assert "ssd" in ops and "gla" in ops
    train = [r for r in res["training"]["rows"] if _finite(r.get("mfu"))]
    assert {r["seq_len"] for r in train} == {64, 128}
    assert all(r["vs_transformer"] == 1.0 for r in train if r["preset"] == "transformer++")
    assert all(_finite(r["vs_transformer"]) for r in train)
    assert {r["batch"] for r in res["decode"]["rows"] if _finite(r.get("ms_per_token"))} == {1, 4}
    assert all(_finite(r.get("peak_bytes")) for r in res["memory"]["rows"])
    assert any(_finite(r.get("ms_per_step")) for r in res["steps"]["rows"])
    md = out.with_suffix(".md").read_text()
    assert "### Correctness" in md and "### Decode" in md and "dry run" in md


def test_budget_cuts_with_a_note_and_every_row_is_written():
    """A part writes the results on each row, so a job that hangs past the run's timeout leaves the rows before it
    (on an H200 the kernels part's GLA job, FLA autotuning, once outlived the run and took the SSD row with it)."""
    b = gpu.Budget(0.0)
    assert not b.fits("the big one", 1.0) and b.cut == ["the big one"]
    seen = []
    res = gpu.run_gpu_check(dry_run=True, parts=["memory"], log=lambda *_: None, time_limit=120,
                            write=lambda r: seen.append((r.get("running"), len(r["memory"]["rows"]))))
    assert res["memory"]["rows"] and res["memory"]["cut"] == []
    n = len(res["memory"]["rows"])
    assert seen == [("memory", k) for k in range(1, n + 1)] + [(None, n)]
    assert "stopped during the memory part" in gpu.to_markdown(dict(res, running="memory"))


def test_dry_run_skips_fla_rows_and_says_so(monkeypatch):
    """With fla installed on a machine without a GPU its kernels cannot run (`RuntimeError: 0 active drivers`): the dry
    run skips FLA's rows with a note instead of failing every one (fla's presence mocked: none of its code runs)."""
    from hybridlm.ops import fla
    monkeypatch.setattr(fla, "available", lambda: True)
    monkeypatch.setattr(gpu, "DRY", dict(gpu.DRY, kernels=dict(gpu.DRY["kernels"], ops=("delta", "kda"))))
    res = gpu.run_gpu_check(dry_run=True, parts=["kernels"], log=lambda *_: None, time_limit=300)
    rows = res["kernels"]["rows"]
    assert [r["op"] for r in rows] == ["delta", "kda"], rows
    assert all("skipped" in r["fla"] and _finite(r["pytorch"]["fwd_bwd_ms"]) for r in rows), rows
    assert "FLA's kernel rows skipped" in gpu.to_markdown(res)


def test_training_forces_fla_where_it_refuses_this_triton(monkeypatch):
    """On Hopper with Triton < 3.7.1 FLA refuses its gated backward (#640): the training part lifts the guard and
    forces FLA's dispatch for the timing, and says so (device checks mocked)."""
    import torch

    from hybridlm.bench import kernels as kn
    from hybridlm.bench.gpu import timings
    from hybridlm.ops import fla
    monkeypatch.delenv("HYBRIDLM_FLA", raising=False)
    monkeypatch.setattr(fla, "available", lambda: True)
    monkeypatch.setattr(fla, "trusted", lambda index: False)
    monkeypatch.setattr(kn, "fla_hopper_guard_off", lambda: True)
    out = {}
    try:
        timings._force_fla(torch.device("cuda", 0), out, log=lambda *_: None)
        assert os.environ["HYBRIDLM_FLA"] == "force" and "#640" in out["notes"][0]
    finally:
        os.environ.pop("HYBRIDLM_FLA", None)


def test_unknown_part_is_one_clear_error():
    with pytest.raises(ConfigError, match="unknown GPU-check part"):
        gpu.run_gpu_check(dry_run=True, parts=["kernel"])


def test_script_help_runs_from_the_source_tree():
    """scripts/gpu-check.sh uses the tree's src/ and the `bench` command's flags."""
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu-check.sh"), "--help"], capture_output=True,
                       text=True, env=dict(os.environ, PYTHON=sys.executable))
    assert p.returncode == 0 and "--dry-run" in p.stdout and "--parts" in p.stdout
