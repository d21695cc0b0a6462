"""Peak memory of one training step (forward + backward) or one forward, each case in a fresh process.

    peak = step_peak_bytes(cfg, batch=1, seq_len=16384)          # bytes above the resident size before the step

CPU: the child process builds the model, runs one tiny warm-up step (8 tokens: one-time lazy set-up such as
thread pools, with next to no memory; a full-size warm-up would leave its freed memory resident in the
allocator and hide the step's peak), resets the kernel's peak-RSS counter (`/proc/self/clear_refs` = 5, Linux)
and reads VmHWM after the full-size step; without that file it falls back to ru_maxrss. The figure is the
peak resident size during the step minus the resident size before it: activations, gradients and temporaries,
not the weights. CUDA: torch.cuda.max_memory_allocated over the step minus the allocation
before it, in this process (the caching allocator makes that exact). A fresh process per case keeps one
case's freed-but-cached memory from hiding the next one's peak; it sets the allocator as the `hybridlm` command
does (hybridlm.runtime.tune_allocator). `dtype` bfloat16/float16: the step runs under autocast (float32 weights),
as `hybridlm bench --dtype` times it.
"""
import json
import os
import subprocess
import sys

import torch

from ..errors import HybridLMError
from ..models.config import ModelConfig
from .throughput import DTYPES, precision


def _rss_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _step(model, ids, train: bool, full_logits: bool = False, dtype: str = "float32"):
    if train:
        with precision(ids.device.type, DTYPES[dtype]):
            loss = model(ids, labels=ids, return_logits=full_logits).loss
        loss.backward()
        for p in model.parameters():
            p.grad = None
    else:
        with torch.inference_mode(), precision(ids.device.type, DTYPES[dtype]):
            model(ids, logits_to_keep=1)


def measure_here(cfg: ModelConfig, batch: int, seq_len: int, train: bool = True, device: str = "cpu",
                 full_logits: bool = False, dtype: str = "float32") -> dict:
    """Peak bytes of one step measured in this process (call it in a fresh one on CPU). `full_logits`: the
    training step materialises [tokens, vocab] logits (the unfused head + loss) instead of the chunked loss."""
    import gc
    import resource

    from ..models import CausalLM
    torch.manual_seed(0)
    model = CausalLM(cfg).to(device).train(train)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=device)
    if device.startswith("cuda"):
        _step(model, ids, train, full_logits, dtype)                # warm-up; the caching allocator keeps it
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        _step(model, ids, train, full_logits, dtype)
        torch.cuda.synchronize()
        return {"peak_bytes": torch.cuda.max_memory_allocated() - before, "method": "cuda.max_memory_allocated"}
    _step(model, ids[:1, :8], train, full_logits, dtype)            # one-time set-up, ~no memory
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                                            # peak RSS := current RSS
        method = "VmHWM after clear_refs"
    except OSError:
        method = "ru_maxrss (includes the warm-up step's peak)"
    before = _rss_kib("VmRSS")
    if before is None:                                              # no /proc: resource only (KiB on Linux)
        before, method = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "ru_maxrss delta"
    _step(model, ids, train, full_logits, dtype)
    peak = _rss_kib("VmHWM") if method.startswith("VmHWM") else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_bytes": max(0, peak - before) * 1024, "method": method}


def step_peak_bytes(cfg: ModelConfig, batch: int, seq_len: int, train: bool = True, device: str = "cpu",
                    threads: int | None = None, full_logits: bool = False, dtype: str = "float32") -> dict:
    """measure_here in a fresh Python process (CPU) or in this one (CUDA). -> {"peak_bytes", "method"}."""
    if device.startswith("cuda"):
        return measure_here(cfg, batch, seq_len, train, device, full_logits, dtype)
    job = json.dumps({"config": cfg.to_dict(), "batch": batch, "seq_len": seq_len, "train": train,
                      "full_logits": full_logits, "dtype": dtype,
                      "threads": threads or torch.get_num_threads()})
    proc = subprocess.run([sys.executable, "-m", "hybridlm.bench.memory"], input=job, capture_output=True, text=True,
                          env=dict(os.environ))
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise HybridLMError(f"memory probe for {batch}x{seq_len} failed: {last}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    from ..runtime import tune_allocator
    tune_allocator()                                    # the allocator the `hybridlm` command runs with
    job = json.loads(sys.stdin.read())
    torch.set_num_threads(job["threads"])
    res = measure_here(ModelConfig.from_dict(job["config"]), job["batch"], job["seq_len"], job["train"],
                       full_logits=job.get("full_logits", False), dtype=job.get("dtype", "float32"))
    print(json.dumps(res))
