"""`hybridlm bench --suite gpu`: every GPU claim of hybridlm measured in one command, part by part, each part
with its own time budget (a part that would overrun is cut with a note; the run goes on), results written after
every row, so a run stopped from outside (or a job that hangs past its timeout) still leaves what it measured.

In this order (the most-wanted figures first):

    training     tokens/s, its ratio to transformer++'s, and MFU (FLOPs counted per letter, against a bf16 8192³
                 matmul timed in this process) at ~125M parameters, batch 8 x 2,048 and 8 x 8,192, bf16 autocast,
                 eager and per-block torch.compile; the models take FLA's kernels for S, R, G, K when it is installed
    kernels      forward+backward ms of each letter's op in its three forms at batch 8, T 4096: FLA's kernel through
                 ops/fla.py, our Triton kernel where we have one (S, R; CDMoE against a gated MLP), our PyTorch form
                 (mamba_ssm's SSD beside them when installed)
    correctness  each Triton kernel (SSD, GLA, CDMoE), each FLA adapter (S, R, G, K) and the chunked gated delta rule
                 against its float32 reference, forward and gradients, two shapes each; decode (static step, as a CUDA
                 graph) = full forward for four preset families; one bf16 training step per family, loss and
                 gradients finite
    decode       ms/token at batch 1 and tokens/s at batch 64, contexts 1k and 8k, static step as a CUDA graph
    memory       peak allocated by one 16k-token training step, mamba2 vs transformer++
    steps        ms per optimizer step of the ablation recipes (scales 1, 2, 4, 8) and the MQAR sweep's models: what
                 the results page's GPU-time estimates are computed from

`--dry-run` runs all of it on the CPU at tiny sizes with Triton's interpreter, in about a minute: the check cannot
rot while no GPU is at hand (tests/test_gpu_check.py). FLA's rows are skipped there, with a note: its Triton kernels
do not run under the interpreter (their mappings are checked on a CPU by tests/test_ops_fla.py).
scripts/gpu-check.sh runs it from the source tree. The parts live in checks.py (correctness) and timings.py (the
rest); report.py writes the JSON and markdown.

    hybridlm bench --suite gpu --out runs/gpu/gpu.json          # on a GPU machine: ~10 minutes
    hybridlm bench --suite gpu --dry-run --out /tmp/gpu.json    # anywhere
    hybridlm bench --suite gpu --parts kernels,decode           # only some parts
"""

import os
import time
from typing import Callable

import torch

from .checks import part_correctness
from .common import DRY, FULL, PARTS, Budget, Rows, free
from .report import targets, to_markdown, write
from .timings import part_decode, part_kernels, part_memory, part_steps, part_training

__all__ = ["PARTS", "Budget", "Rows", "environment", "gpu_suite", "run_gpu_check", "targets", "to_markdown", "write"]

PART_FNS = {"correctness": part_correctness, "kernels": part_kernels, "training": part_training,
            "decode": part_decode, "memory": part_memory, "steps": part_steps}


def environment(device) -> dict:
    """The machine, torch / triton versions and (on CUDA) the GPU."""
    from ...runtime import machine_meta
    env = machine_meta()
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_memory_gib=round(p.total_memory / 2 ** 30, 1),
                   multiprocessors=p.multi_processor_count, cuda=torch.version.cuda)
    else:
        env.update(gpu=None, triton_interpret=os.environ.get("TRITON_INTERPRET"))
    return env


def run_gpu_check(dry_run: bool = False, parts=None, log=print, write: Callable[[dict], None] | None = None,
                  time_limit: float | None = None) -> dict:
    """Every part of `parts` (default all) in order, each under its budget (scaled so that they add up to
    `time_limit` seconds when given); `write(res)` after every row and every part (res["running"] names the part
    in progress until it ends)."""
    from ...errors import ConfigError
    parts = list(parts or PARTS)
    bad = [p for p in parts if p not in PART_FNS]
    if bad:
        raise ConfigError(f"unknown GPU-check part(s) {', '.join(bad)}: choose from {', '.join(PARTS)}")
    s = dict(DRY if dry_run else FULL)
    if time_limit:
        total = sum(s["budget_s"][p] for p in parts)
        s["budget_s"] = {p: s["budget_s"][p] * time_limit / total for p in parts}
    cuda = torch.cuda.is_available() and not dry_run
    if not cuda and not dry_run:
        raise ConfigError("the GPU check needs a CUDA GPU; --dry-run runs it on the CPU at tiny sizes")
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton is imported: kernels on CPU tensors
    device = torch.device("cuda" if cuda else "cpu")
    res = {"suite": "gpu", "dry_run": dry_run, "env": environment(device), "parts": {}}

    def save():
        res["targets"] = targets(res)
        if write:
            write(res)
    log(f"GPU check on {res['env'].get('gpu') or 'cpu (dry run, Triton interpreter)'}: {', '.join(parts)}")
    for part in parts:
        budget, t0 = Budget(s["budget_s"][part]), time.perf_counter()
        log(f"[{part}] budget {s['budget_s'][part]:.0f} s")
        out = res[part] = {"rows": Rows(save)}
        res["running"] = part
        try:
            PART_FNS[part](s, device, budget, log, out)
        except Exception as e:                     # noqa: BLE001 - a part that breaks is reported, the run goes on
            out["error"] = f"{type(e).__name__}: {e}"[:500]
            log(f"  {part} failed: {out['error']}")
        out.update(wall_s=round(time.perf_counter() - t0, 1), budget_s=s["budget_s"][part],
                   cut=[f"cut for time: {c}" for c in budget.cut])
        for c in out["cut"]:
            log(f"  {c}")
        res["parts"][part] = out["wall_s"]
        del res["running"]
        save()
        free(device)
    return res


def gpu_suite(s: dict, log=print) -> dict:
    """The bench suite: settings dry_run (or quick), parts ("a,b"), time_limit, out (written on every row)."""
    parts = [x.strip() for x in s["parts"].split(",") if x.strip()] if s.get("parts") else None
    res = run_gpu_check(dry_run=bool(s.get("dry_run") or s.get("quick")), parts=parts, log=log,
                        write=lambda r: write(r, s["out"]), time_limit=s.get("time_limit"))
    return dict(res, markdown=to_markdown(res), ok=not (res.get("correctness") or {}).get("failed"))
