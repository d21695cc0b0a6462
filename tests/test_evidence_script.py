"""scripts/evidence.sh dispatches its parts (checked with a stand-in python that only logs its arguments)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
@pytest.mark.parametrize("jobs", ["1", "2"])
def test_evidence_parts_and_lanes(tmp_path, jobs):
    log = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f"#!/usr/bin/env bash\necho \"$*\" >> {log}\n")
    fake.chmod(0o755)
    env = dict(os.environ, PYTHON=str(fake), JOBS=jobs, RESULTS=str(tmp_path / "res"))
    run = subprocess.run(["bash", "scripts/evidence.sh", "report", "ablate:wm-moe", "mqar", "rope", "mqar-t128",
                          "rope-warmup"],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    calls = log.read_text().splitlines()
    assert len(calls) == 6 and calls[-1].startswith("-m hybridlm report")       # the page comes after both lanes
    assert calls.index(next(c for c in calls if "--seq-lens 64 --out" in c)) < \
        calls.index(next(c for c in calls if "--seq-lens 128" in c))               # a lane keeps its order
    assert any("ablate wm-moe --threads 1" in c for c in calls) and any(c.endswith("mqar-rope") for c in calls)
    assert any("--steps 8000 --warmup 80" in c and c.endswith("mqar-rope-warmup") for c in calls)
    bad = subprocess.run(["bash", "scripts/evidence.sh", "nonsense"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown part nonsense" in bad.stderr


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_evidence_mqar_parts_of_the_recall_claims(tmp_path):
    """The MQAR parts behind the recall claims, and DEVICE=cuda sending them to a GPU."""
    log = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f"#!/usr/bin/env bash\necho \"$*\" >> {log}\n")
    fake.chmod(0o755)
    env = dict(os.environ, PYTHON=str(fake), JOBS="1", RESULTS=str(tmp_path / "res"), DEVICE="cuda", MQAR_JOBS="14")
    parts = ["mqar-star", "mqar-inner-budget", "mqar-state-size", "mqar-t128", "mqar-d64"]
    run = subprocess.run(["bash", "scripts/evidence.sh", *parts], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    calls = log.read_text().splitlines()
    assert len(calls) == 5 and all(c.startswith("-m hybridlm mqar --device cuda --jobs 14") for c in calls)
    star, inner, size, t128, d64 = calls
    assert "--d-models 32 --seeds 0 1" in star and "rodimus-n64=" in star and "cheems-ssd-n16=" in star
    assert "--steps 32000" in inner and inner.endswith("mqar-inner-budget")
    assert all(f"{f}-n{n}=" in size for f, ns in (("rodimus", (8, 16, 32, 64)), ("mamba2", (16, 32, 64, 128)))
               for n in ns) and "--seq-lens 128 --d-models 64" in size
    assert "kda=K" in t128 and "attention=A" in t128 and "--seq-lens 64 --d-models 64 --seeds 0 1" in d64
