"""The repository carries source, docs and small results, never build artefacts, weights or run directories' copies.

Checked on `git ls-files` (skipped outside a git checkout, e.g. an unpacked sdist).
"""
import collections
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_BYTES = 1 << 20
# what a build, a packager or a training run leaves behind
ARTEFACT_SUFFIXES = (".whl", ".tar.gz", ".tgz", ".zip", ".egg", ".so", ".pyd", ".dylib", ".o", ".a", ".pyc",
                     ".safetensors", ".gguf", ".pt", ".pth", ".bin", ".ckpt", ".npy", ".npz")
ARTEFACT_PARTS = {"__pycache__", ".pytest_cache", ".hypothesis", "build", "dist"}
# a run directory's files besides metrics.jsonl / result.json: the tokenizer, the weights' index, the latest pointer
RUN_FILES = {"tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json", "latest"}


def _tracked() -> list[tuple[str, str]]:
    """(blob hash, path) of every tracked file."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-s", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [(entry.split()[1], entry.split("\t", 1)[1]) for entry in out.split("\0") if entry]


def test_no_file_over_a_megabyte():
    big = [f"{p} ({(ROOT / p).stat().st_size:,} bytes)" for _, p in _tracked()
           if (ROOT / p).is_file() and (ROOT / p).stat().st_size > MAX_BYTES]
    assert not big, "tracked files over 1 MB: " + ", ".join(big)


def test_no_build_artefacts():
    bad = [p for _, p in _tracked() if p.endswith(ARTEFACT_SUFFIXES) or ARTEFACT_PARTS & set(p.split("/")[:-1])
           or p.split("/")[-1].endswith(".egg-info")]
    assert not bad, "build artefacts are tracked (add them to .gitignore): " + ", ".join(bad)


def test_no_run_directory_copies():
    """docs/results keeps metrics, summaries and plots: not the tokenizer and weight index of every run, nor any
    file twice."""
    tracked = _tracked()
    runs = [p for _, p in tracked if p.startswith("docs/results/") and p.split("/")[-1] in RUN_FILES]
    assert not runs, "run-directory artefacts under docs/results: " + ", ".join(runs[:5])
    empty = "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"           # git's hash of an empty file (py.typed, __init__.py)
    copies = collections.defaultdict(list)
    for blob, p in tracked:
        if p.startswith("docs/results/") and blob != empty:
            copies[blob].append(p)
    dup = [ps for ps in copies.values() if len(ps) > 1]
    assert not dup, "identical files under docs/results: " + "; ".join(", ".join(ps) for ps in dup[:3])
