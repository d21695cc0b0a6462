#!/usr/bin/env bash
# The evidence run behind docs/results.md: the MQAR sweep, the RoPE-attention study and every ablation recipe,
# then the page. Every part is resumable (rerun the script: finished runs are kept) and runs one torch thread per
# process. With JOBS=2 (the default on a machine with 2+ cores) two lanes run side by side: the MQAR sweep parts
# in one, the RoPE study and the recipes in the other; the page is written when both are done.
#   bash scripts/evidence.sh                  # everything
#   bash scripts/evidence.sh mqar rope        # some parts: mqar mqar-star mqar-inner-budget mqar-state-size
#                                             #   mqar-t128 mqar-d64 rope rope-warmup ablate:<recipe>... report
# Parts: mqar = T 64 x d_model 32/64/128 x the ten default layouts (seed 0); mqar-star = the d 32 rows whose second
# lr decides a claim (Rodimus n16/n64, Cheems' SSD), seeds 0 and 1; mqar-inner-budget = inner-function attention
# with the dynamic mask at d 32 / T 64 under a 32,000-step budget (8,000 leave it rising), seeds 0 and 1;
# mqar-state-size = Rodimus' figure 1b at d 64 / T 128 (Rodimus n 8/16/32/64 against Mamba-2 N 16/32/64/128), seeds
# 0 and 1; mqar-t128 = T 128 (8 pairs) at d 64: the state families (Mamba-2 N 16/64, Rodimus n 16/64, Gated DeltaNet,
# KDA) beside attention, seeds 0 and 1; mqar-d64 = every default layout at d 64 / T 64, seeds 0 and 1; rope = RoPE
# attention at T 64 / d 64 with 4 heads, rope base 100, half rotary dims and no positions
# (lr 3e-3, 4,000 steps); rope-warmup = RoPE attention there under the sweep's 8,000 steps with the 4,000-step
# schedule's warmup (80), seeds 0 and 1; one ablate:<recipe> per shipped recipe (3 seeds each).
# Cost, measured with two single-thread lanes on a 2-core machine: an MQAR point at T 64 / d 32 takes 3-45 minutes
# per lr (Gated DeltaNet and KDA stop early at 3-5; attention 8-17; SSD and Rodimus use the whole 8,000 steps,
# 20-45), a point at d 128 or T 128 about 2x its per-step cost; the 30-point T 64 grid is 10-20 CPU-hours and T 128
# as much again, so `mqar` alone exceeds a 6-hour run on 2 cores (a GPU runs it with --device cuda). The RoPE study
# takes about 0.6 CPU-hours; a recipe model 2-8 minutes per seed (the indexer's trained sparse models the longest),
# about 5.5 CPU-hours for the six recipes (under 3 hours on two lanes). On a shared core (load 7-8 on 2 cores) a
# Rodimus run at d 32 ran 1.3-1.5 steps/s: ~100 minutes per 8,000-step lr. DEVICE=cuda runs the MQAR parts on a GPU
# and MQAR_JOBS=N runs N points at once (one H200 ran 40 such runs in 12 minutes, 14 sweeps at once: the steps are
# launch-bound, so sweeps side by side fill the GPU); `hybridlm mqar --merge DIR... --out $RESULTS/mqar` joins runs
# made elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
JOBS=${JOBS:-$( [ "$(nproc)" -ge 2 ] && echo 2 || echo 1 )}
RESULTS=${RESULTS:-docs/results}
export OMP_NUM_THREADS=1
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(mqar-star mqar-inner-budget mqar-state-size mqar-t128 mqar-d64 mqar rope rope-warmup $("$PY" -c "from hybridlm.train.recipes import list_recipes; print(' '.join('ablate:' + n for n in list_recipes()))") report)

# the default sweep's layouts (hybridlm mqar --help), by family
ATTN='attention=A:pos_embedding="learned"'
M2='mamba2-n16=S:ssd_d_state=16,mamba2-n64=S:ssd_d_state=64'
ROD='rodimus-n16=R:rodimus_d_state=16,rodimus-n64=R:rodimus_d_state=64'
CHEEMS='cheems-ssd-n16=S:ssd_d_state=16:wm_ssd_rope=true'
INNER='inner-fn-dynmask=F:wm_dyn_mask="position":wm_inner_values=2:pos_embedding="learned"'
mqar() { "$PY" -m hybridlm mqar ${DEVICE:+--device "$DEVICE"} ${MQAR_JOBS:+--jobs "$MQAR_JOBS"} "$@"; }

run_part() {
  echo "== $1 ($(date -u +%H:%M:%S))"
  case "$1" in
    mqar) mqar --seq-lens 64 --out "$RESULTS/mqar" ;;
    mqar-star) mqar --seq-lens 64 --d-models 32 --seeds 0 1 --layouts "$ROD,$CHEEMS" --out "$RESULTS/mqar" ;;
    mqar-inner-budget) mqar --seq-lens 64 --d-models 32 --seeds 0 1 --steps 32000 --layouts "$INNER" \
            --out "$RESULTS/mqar-inner-budget" ;;
    mqar-state-size) mqar --seq-lens 128 --d-models 64 --seeds 0 1 --out "$RESULTS/mqar" --layouts \
            "$ROD,rodimus-n8=R:rodimus_d_state=8,rodimus-n32=R:rodimus_d_state=32,$M2,mamba2-n32=S:ssd_d_state=32,mamba2-n128=S:ssd_d_state=128" ;;
    mqar-t128) mqar --seq-lens 128 --d-models 64 --seeds 0 1 --out "$RESULTS/mqar" \
            --layouts "$ATTN,$M2,$ROD,gated-deltanet=G,kda=K" ;;
    mqar-d64) mqar --seq-lens 64 --d-models 64 --seeds 0 1 --out "$RESULTS/mqar" ;;
    rope) "$PY" -m hybridlm mqar --d-models 64 --seq-lens 64 --lr 3e-3 --steps 4000 \
            --layouts 'rope=A,rope-4heads=A:n_heads=4,rope-base100=A:rope_base=100.0,rope-half=A:rope_dim=32,nope=A:pos_embedding="none"' \
            --out "$RESULTS/mqar-rope" ;;
    rope-warmup) "$PY" -m hybridlm mqar --layouts attention-rope=A --d-models 64 --seq-lens 64 --lr 3e-3 \
            --steps 8000 --warmup 80 --seeds 0 1 --out "$RESULTS/mqar-rope-warmup" ;;
    ablate:*) "$PY" -m hybridlm ablate "${1#ablate:}" --threads 1 --no-checkpoints --no-progress \
            --out "$RESULTS/ablate/${1#ablate:}" ;;
    report) "$PY" -m hybridlm report --results "$RESULTS" --out docs/results.md ;;
    *) echo "unknown part $1 (mqar, mqar-star, mqar-inner-budget, mqar-state-size, mqar-t128, mqar-d64, rope," \
            "rope-warmup, ablate:<recipe>, report)" >&2; return 2 ;;
  esac
}

lane_a=() lane_b=() last=()
for part in "${parts[@]}"; do
  case "$part" in
    mqar*) lane_a+=("$part") ;;
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
