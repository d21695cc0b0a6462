#!/usr/bin/env bash
# The evidence run behind docs/results.md: the MQAR sweep, the RoPE-attention study and every ablation recipe,
# then the page. Every part is resumable (rerun the script: finished runs are kept) and runs one torch thread per
# process. With JOBS=2 (the default on a machine with 2+ cores) two lanes run side by side: the MQAR sweep parts
# in one, the RoPE study and the recipes in the other; the page is written when both are done.
#   bash scripts/evidence.sh                  # everything
#   bash scripts/evidence.sh mqar rope        # some parts: mqar mqar-t128 rope rope-warmup ablate:<recipe>... report
# Parts: mqar = T 64 x d_model 32/64/128 x the ten default layouts; mqar-t128 = T 128 (8 pairs) at d_model 64 and
# 128; rope = RoPE attention at T 64 / d 64 with 4 heads, rope base 100, half rotary dims and no positions
# (lr 3e-3, 4,000 steps); rope-warmup = RoPE attention there under the sweep's 8,000 steps with the 4,000-step
# schedule's warmup (80), seeds 0 and 1; one ablate:<recipe> per shipped recipe (3 seeds each).
# Cost, measured with two single-thread lanes on a 2-core machine: an MQAR point at T 64 / d 32 takes 3-45 minutes
# per lr (Gated DeltaNet and KDA stop early at 3-5; attention 8-17; SSD and Rodimus use the whole 8,000 steps,
# 20-45), a point at d 128 or T 128 about 2x its per-step cost; the 30-point T 64 grid is 10-20 CPU-hours and T 128
# as much again, so `mqar` alone exceeds a 6-hour run on 2 cores (a GPU runs it with --device cuda). The RoPE study
# takes about 0.6 CPU-hours; a recipe model 2-8 minutes per seed (the indexer's trained sparse models the longest),
# about 5.5 CPU-hours for the six recipes (under 3 hours on two lanes).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
JOBS=${JOBS:-$( [ "$(nproc)" -ge 2 ] && echo 2 || echo 1 )}
RESULTS=${RESULTS:-docs/results}
export OMP_NUM_THREADS=1
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(mqar mqar-t128 rope rope-warmup $("$PY" -c "from hybridlm.train.recipes import list_recipes; print(' '.join('ablate:' + n for n in list_recipes()))") report)

run_part() {
  echo "== $1 ($(date -u +%H:%M:%S))"
  case "$1" in
    mqar) "$PY" -m hybridlm mqar --seq-lens 64 --out "$RESULTS/mqar" ;;
    mqar-t128) "$PY" -m hybridlm mqar --seq-lens 128 --d-models 64 128 --out "$RESULTS/mqar" ;;
    rope) "$PY" -m hybridlm mqar --d-models 64 --seq-lens 64 --lr 3e-3 --steps 4000 \
            --layouts 'rope=A,rope-4heads=A:n_heads=4,rope-base100=A:rope_base=100.0,rope-half=A:rope_dim=32,nope=A:pos_embedding="none"' \
            --out "$RESULTS/mqar-rope" ;;
    rope-warmup) "$PY" -m hybridlm mqar --layouts attention-rope=A --d-models 64 --seq-lens 64 --lr 3e-3 \
            --steps 8000 --warmup 80 --seeds 0 1 --out "$RESULTS/mqar-rope-warmup" ;;
    ablate:*) "$PY" -m hybridlm ablate "${1#ablate:}" --threads 1 --no-checkpoints --no-progress \
            --out "$RESULTS/ablate/${1#ablate:}" ;;
    report) "$PY" -m hybridlm report --results "$RESULTS" --out docs/results.md ;;
    *) echo "unknown part $1 (mqar, mqar-t128, rope, rope-warmup, ablate:<recipe>, report)" >&2; return 2 ;;
  esac
}

lane_a=() lane_b=() last=()
for part in "${parts[@]}"; do
  case "$part" in
    mqar|mqar-t128) lane_a+=("$part") ;;
    report) last+=("$part") ;;
    *) lane_b+=("$part") ;;
  esac
done
if [ "$JOBS" -ge 2 ]; then      # two single-thread lanes; sweeps sharing an --out merge each other's runs
  ( for p in "${lane_a[@]}"; do run_part "$p"; done ) & a=$!
  ( for p in "${lane_b[@]}"; do run_part "$p"; done ) & b=$!
  wait $a; wait $b
else
  for p in "${lane_a[@]}" "${lane_b[@]}"; do run_part "$p"; done
fi
for p in "${last[@]}"; do run_part "$p"; done
