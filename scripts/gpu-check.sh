#!/usr/bin/env bash
# The GPU check from the source tree, on a bare GPU machine: no install, the machine's own torch and triton
# (hybridlm's pure-Python needs: safetensors, tokenizers, tqdm, einops, numpy, matplotlib). It measures every GPU
# claim of hybridlm in one run (~9 minutes on an H100) and writes a JSON and a markdown table:
#
#     bash scripts/gpu-check.sh                              # -> runs/gpu/gpu-check.json and .md
#     bash scripts/gpu-check.sh --out /tmp/gpu.json --parts kernels,decode
#     bash scripts/gpu-check.sh --dry-run                    # CPU, tiny sizes, Triton's interpreter (~1-2 minutes)
#
# flash-linear-attention (`pip install fla-core`, pure Python; the gpu extra) is what the models run on CUDA for S, R, G
# and K when it imports, and is timed beside our kernels; the dry run skips its rows (its kernels need a GPU) and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# FLA's kernels autotune on first use (2-16 s a kernel; a delta-rule preset's first training step took over 100 s on
# an H200): keep the winners on disk with the compiled kernels, so a second run, or a run given this folder back
# (TRITON_CACHE_DIR; same GPU, Triton and FLA), skips the tuning
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1} TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/runs/gpu/triton-cache}
exec "$PY" -m hybridlm bench --suite gpu "$@"
