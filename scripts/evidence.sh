#!/usr/bin/env bash
# The evidence run behind docs/results.md: the MQAR sweep, the RoPE-attention study and every ablation recipe,
# then the page. Each part is resumable (rerun the script: finished runs are kept), one torch thread per
# process, PARTS run in order; `JOBS=2 bash scripts/evidence.sh` runs two MQAR points at once on 2 cores.
#   bash scripts/evidence.sh                 # everything (about 6 CPU-hours on a 2-core machine)
#   bash scripts/evidence.sh mqar rope       # some parts: mqar rope ablate:<recipe>... report
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
JOBS=${JOBS:-1}
RESULTS=${RESULTS:-docs/results}
export OMP_NUM_THREADS=1
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(mqar rope $("$PY" -c "from hybridlm.train.recipes import list_recipes; print(' '.join('ablate:' + n for n in list_recipes()))") report)
for part in "${parts[@]}"; do
  echo "== $part ($(date -u +%H:%M:%S))"
  case "$part" in
    mqar) "$PY" -m hybridlm mqar --jobs "$JOBS" --out "$RESULTS/mqar" ;;
    rope) "$PY" -m hybridlm mqar --jobs "$JOBS" --d-models 64 --seq-lens 64 \
            --layouts 'learned=A:pos_embedding="learned",rope=A,rope-4heads=A:n_heads=4,rope-base100=A:rope_base=100.0,rope-half=A:rope_dim=32,nope=A:pos_embedding="none"' \
            --out "$RESULTS/mqar-rope" ;;
    ablate:*) "$PY" -m hybridlm ablate "${part#ablate:}" --threads 1 --no-checkpoints --no-progress \
            --out "$RESULTS/ablate/${part#ablate:}" ;;
    report) "$PY" -m hybridlm report --results "$RESULTS" --out docs/results.md ;;
    *) echo "unknown part $part (mqar, rope, ablate:<recipe>, report)" >&2; exit 2 ;;
  esac
done
