#!/usr/bin/env bash
# The allocator policies measured (docs/memory.md): each run a fresh `hybridlm train` process tree, the policies
# interleaved so that a shared machine's load falls on all of them alike.
#   bash scripts/allocator.sh fsdp [REPEATS]      # 100M mamba2-attention, 2 FSDP2 ranks: peak rank RSS and wall
#                                                 # under the run's own policy (release), keep, glibc's dynamic one
#   bash scripts/allocator.sh seq16k [REPEATS]    # one process, one 16,384-token sequence per step: s/step under
#                                                 # the run's own policy (keep) and release; with BEFORE=SRC also
#                                                 # the hybridlm of another checkout's src/ (e.g. before a change)
# Prints one line per run: case, policy, peak RSS of the largest process (GNU time), wall, s/step.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export OMP_NUM_THREADS=1
what=${1:?fsdp or seq16k}
repeats=${2:-1}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# MALLOC_* set by the caller leave the command's policy alone (hybridlm.runtime.set_allocator)
KEEP="MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=2147483647 MALLOC_TOP_PAD_=268435456"
RELEASE="MALLOC_MMAP_THRESHOLD_=131072 MALLOC_TRIM_THRESHOLD_=131072 MALLOC_TOP_PAD_=131072"
DYNAMIC="MALLOC_TOP_PAD_=131072"     # glibc's own dynamic mmap threshold (it grows to 32 MiB)

one() {   # one(name, env, command...)
  local name=$1 envs=$2
  shift 2
  rm -rf "$tmp/run"
  env $envs /usr/bin/time -f "%M %e" -o "$tmp/time" "$@" --out "$tmp/run" --no-progress --log-every 1 \
    > "$tmp/log" 2>&1 || { tail -5 "$tmp/log"; exit 1; }
  read -r kb wall < "$tmp/time"
  step=$("$PY" -c "import json, sys; r = [json.loads(l) for l in open(sys.argv[1])][1:]
print(round(sum(1 / x['tokens_per_s'] * x['tokens'] / x['step'] for x in r) / len(r), 2))" "$tmp/run/metrics.jsonl")
  echo "$what  $name  peak $(( kb / 1000 )) MB  wall ${wall} s  ${step} s/step (steps 2+)  load $(cut -d' ' -f1 /proc/loadavg)"
}

if [ "$what" = fsdp ]; then
  cmd=(torchrun --standalone --nproc_per_node 2 -m hybridlm train --preset mamba2-attention --params 100M
       --seq-len 256 --batch-size 2 --steps 3 --parallel fsdp --grad-checkpointing --eval-tokens 0 --dtype float32)
  for _ in $(seq "$repeats"); do
    one "policy(release)" "" "${cmd[@]}"
    one "keep" "$KEEP" "${cmd[@]}"
    one "glibc-dynamic" "$DYNAMIC" "${cmd[@]}"
  done
elif [ "$what" = seq16k ]; then
  # --no-doc-mask: causal attention takes SDPA's tiled path (a [T, T] document mask would cost 1 GB per head)
  cmd=("$PY" -m hybridlm train --preset mamba2-attention --seq-len 16384 --batch-size 1 --steps 3 --warmup 1
       --eval-tokens 0 --dtype float32 --no-doc-mask)
  for _ in $(seq "$repeats"); do
    [ -n "${BEFORE:-}" ] && one "before" "PYTHONPATH=$BEFORE" "${cmd[@]}"
    one "policy(keep)" "" "${cmd[@]}"
    one "release" "$RELEASE" "${cmd[@]}"
  done
else
  echo "usage: $0 fsdp|seq16k [REPEATS]" >&2
  exit 2
fi
